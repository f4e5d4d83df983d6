"""The small test runner the Python test scripts share: a registry, Skip, the
expected-error helpers and a main loop that prints one line per test and a
'N passed, N failed, N skipped' summary (what CTest and gpu-check read)."""

import sys
import traceback

from moelink import MoelinkError, Status

TESTS = []


class Skip(Exception):
    pass


def test(fn):
    TESTS.append(fn)
    return fn


def expect_raises(exc_type, fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except exc_type as e:
        return e
    raise AssertionError("expected %s from %s" % (exc_type.__name__, getattr(fn, "__name__", fn)))


def expect_moelink_error(status, substring, fn, *args, **kwargs):
    e = expect_raises(MoelinkError, fn, *args, **kwargs)
    assert e.status == status, "status %s (%s), expected %s" % (e.status_name, e.message, status)
    assert e.status_name == "MOELINK_" + Status(status).name, e.status_name
    assert substring in e.message, "message %r lacks %r" % (e.message, substring)
    assert substring in str(e), str(e)
    return e


def run(pick):
    """Runs the registered tests whose names contain one of `pick` (all when
    empty); returns (passed, failed, skipped)."""
    passed = failed = skipped = 0
    for fn in TESTS:
        if pick and not any(p in fn.__name__ for p in pick):
            continue
        try:
            fn()
        except Skip as s:
            skipped += 1
            print("skip - %s: %s" % (fn.__name__, s))
        except Exception:
            failed += 1
            print("FAIL - %s" % fn.__name__)
            traceback.print_exc(file=sys.stdout)
        else:
            passed += 1
            print("ok - %s" % fn.__name__)
        sys.stdout.flush()
    return passed, failed, skipped


def summary(passed, failed, skipped):
    print("%d passed, %d failed, %d skipped" % (passed, failed, skipped))
    return 1 if failed else 0
