#!/usr/bin/env python3
"""The communicator-level Python binding (moelink.Comm, TP, EP) on CPU ranks.

Run under the launcher, every rank the same script:
    moelink launch -n 2 -- python3 tests/python/test_comm_cpu.py [name-substring ...]
Every rank makes every input from a seed and its rank, so each can rebuild
all the others' inputs and compute the whole reference with numpy:
collectives bitwise (integer-valued data, exact in every dtype) and with a
rounding bound (random f32); alltoallv bitwise on random counts with zeros;
TP ops against float64 matmul with the header's roundings (partials rounded
to the dtype, summed in rank order in fp32) plus bitwise agreement between
ranks; EP against the single-rank moelink.MoE on all ranks' tokens
concatenated in rank order. Every test runs on every rank in the same
order: the error paths tested are the ones all ranks hit alike.
Exits non-zero on a failure; the last line is 'N passed, N failed, N skipped'.
"""

import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))

import moelink  # noqa: E402
from moelink import Status  # noqa: E402
from harness import expect_moelink_error, expect_raises, run, summary, test  # noqa: E402

CTX = COMM = None
R = P = 0


def rng_of(seed, rank):
    return np.random.default_rng([seed, rank])


# dtype name -> (numpy storage dtype, to storage, from storage)
DT = {
    "f32": (np.float32, lambda a: np.asarray(a, np.float32), lambda a: a.astype(np.float64)),
    "f16": (np.float16, lambda a: np.asarray(a, np.float16), lambda a: a.astype(np.float64)),
    "bf16": (np.uint16, moelink.to_bf16, lambda a: moelink.from_bf16(a).astype(np.float64)),
}


def int_data(seed, rank, shape, dt):
    """Small integers: exact in every dtype, and so are their sums over <= 8 ranks."""
    v = rng_of(seed, rank).integers(-8, 9, size=shape).astype(np.float32)
    return DT[dt][1](v)


def poison(shape, dt):
    return DT[dt][1](np.full(shape, np.nan, np.float32))


def bits(a):
    """The bytes of an array, to compare bitwise."""
    return np.ascontiguousarray(a).view(np.uint8).tobytes()


# ---------------------------------------------------------------------------
# Communicator
# ---------------------------------------------------------------------------

@test
def test_comm_from_env():
    assert COMM.rank == int(os.environ["MOELINK_RANK"]), COMM.rank
    assert COMM.size == int(os.environ["MOELINK_WORLD_SIZE"]), COMM.size
    assert moelink.Comm.in_launch()
    assert isinstance(COMM.handle, int) and COMM.handle
    assert "rank %d of %d" % (R, P) in repr(COMM)
    COMM.check()
    # Without the launcher's id the library refuses, naming the variable.
    saved = os.environ.pop("MOELINK_UNIQUE_ID")
    try:
        expect_moelink_error(Status.ERR_INVALID_ARGUMENT, "MOELINK_UNIQUE_ID is not set",
                             moelink.Comm.from_env, CTX)
    finally:
        os.environ["MOELINK_UNIQUE_ID"] = saved


@test
def test_comm_bad_arguments():
    expect_raises(TypeError, moelink.Comm, "cpu")
    expect_raises(ValueError, moelink.Comm, CTX, 0, P)
    expect_raises(TypeError, moelink.Comm, CTX, R, P, 12345)
    expect_moelink_error(Status.ERR_INVALID_ARGUMENT, "256 hex digits", moelink.Comm, CTX, R, P,
                         "not hex")


# ---------------------------------------------------------------------------
# Collectives
# ---------------------------------------------------------------------------

SIZES = [1, 7, 1003]


@test
def test_allreduce_exact_every_dtype():
    for dt in ("f32", "f16", "bf16"):
        for n in SIZES:
            seed = 100 + n
            want = sum(DT[dt][2](int_data(seed, r, (n,), dt)) for r in range(P))
            mine = int_data(seed, R, (n,), dt)
            got = COMM.allreduce(mine)
            assert got.dtype == mine.dtype and got.shape == (n,)
            assert bits(got) == bits(DT[dt][1](want.astype(np.float32))), (dt, n)
            out = poison((n,), dt)
            assert COMM.allreduce(mine, out=out) is out
            assert bits(out) == bits(got), (dt, n)
            # in place
            inplace = mine.copy()
            assert COMM.allreduce(inplace, out=inplace) is inplace
            assert bits(inplace) == bits(got), (dt, n, "in place")
    # any shape: elementwise
    x = int_data(7, R, (3, 5, 2), "f32")
    got = COMM.allreduce(x)
    assert got.shape == (3, 5, 2)
    assert np.array_equal(got, sum(int_data(7, r, (3, 5, 2), "f32") for r in range(P)))


@test
def test_allreduce_random_f32():
    n = 4097
    xs = [rng_of(5, r).standard_normal(n).astype(np.float32) for r in range(P)]
    got = COMM.allreduce(xs[R])
    want = sum(x.astype(np.float64) for x in xs)
    bound = (P + 1) * 2.0 ** -24 * sum(np.abs(x.astype(np.float64)) for x in xs)
    err = np.abs(got - want)
    assert np.all(err <= bound), float((err - bound).max())
    # every rank has bitwise the same sum
    every = COMM.allgather(got)
    for r in range(P):
        assert bits(every[r * n:(r + 1) * n]) == bits(got), r


@test
def test_allgather_every_dtype():
    for dt in ("f32", "f16", "bf16"):
        for shape in ((1,), (9,), (5, 3), (0, 4)):
            seed = 200 + len(shape) * 10 + shape[0]
            mine = int_data(seed, R, shape, dt)
            if dt != "bf16":  # random payload too: a copy is bitwise
                mine = DT[dt][1](rng_of(seed, R).standard_normal(shape))
                parts = [DT[dt][1](rng_of(seed, r).standard_normal(shape)) for r in range(P)]
            else:
                parts = [int_data(seed, r, shape, dt) for r in range(P)]
            want = np.concatenate(parts, axis=0)
            got = COMM.allgather(mine)
            assert got.shape == (P * shape[0],) + shape[1:], got.shape
            assert bits(got) == bits(want), (dt, shape)
            out = poison(want.shape, dt)
            assert COMM.allgather(mine, out=out) is out and bits(out) == bits(want)


@test
def test_reduce_scatter_every_dtype():
    for dt in ("f32", "f16", "bf16"):
        for rows, cols in ((P, 1), (3 * P, 7), (5 * P, 33)):
            seed = 300 + rows + cols
            total = sum(DT[dt][2](int_data(seed, r, (rows, cols), dt)) for r in range(P))
            n = rows // P
            want = DT[dt][1](total[R * n:(R + 1) * n].astype(np.float32))
            out = poison((n, cols), dt)
            got = COMM.reduce_scatter(int_data(seed, R, (rows, cols), dt), out=out)
            assert got is out and got.shape == (n, cols)
            assert bits(got) == bits(want), (dt, rows, cols)
    # random f32, 1-D
    n = 129
    xs = [rng_of(9, r).standard_normal(n * P).astype(np.float32) for r in range(P)]
    got = COMM.reduce_scatter(xs[R])
    want = sum(x.astype(np.float64) for x in xs)[R * n:(R + 1) * n]
    bound = (P + 1) * 2.0 ** -24 * sum(np.abs(x.astype(np.float64)) for x in xs)[R * n:(R + 1) * n]
    assert got.shape == (n,) and np.all(np.abs(got - want) <= bound)


@test
def test_collective_argument_errors():
    x = np.zeros(6 * P, np.float32)
    expect_raises(TypeError, COMM.allreduce, np.zeros(4, np.int32))
    expect_raises(TypeError, COMM.allreduce, [1.0, 2.0])
    expect_raises(ValueError, COMM.allreduce, np.zeros((4, 4), np.float32)[:, ::2])
    expect_raises(ValueError, COMM.allreduce, x, out=np.zeros(6 * P + 1, np.float32))
    expect_raises(TypeError, COMM.allreduce, x, out=np.zeros(6 * P, np.float16))
    ro = np.zeros(6 * P, np.float32)
    ro.flags.writeable = False
    expect_raises(ValueError, COMM.allreduce, x, out=ro)
    expect_raises(ValueError, COMM.allgather, x, out=np.zeros(6 * P * P + 1, np.float32))
    expect_raises(ValueError, COMM.allgather, np.ones((), np.float32))
    if P > 1:
        expect_raises(ValueError, COMM.reduce_scatter, np.zeros(P + 1, np.float32))
    expect_raises(ValueError, COMM.reduce_scatter, x, out=np.zeros(7, np.float32))
    # the communicator still works
    assert np.array_equal(COMM.allreduce(np.ones(3, np.float32)), np.full(3, P, np.float32))


# ---------------------------------------------------------------------------
# alltoallv
# ---------------------------------------------------------------------------

def a2a_counts(seed):
    """[src, dst] element counts: random, with zeros (and a whole zero row
    or column when there are several ranks)."""
    c = rng_of(seed, 999).integers(0, 9, size=(P, P)).astype(np.int64)
    c[rng_of(seed, 998).random((P, P)) < 0.3] = 0
    if P > 1:
        c[seed % P, :] = 0  # a rank that sends nothing
    return c


def a2a_payload(seed, src, n, dt):
    return DT[dt][1](rng_of(seed, 500 + src).standard_normal(n) * 4)


@test
def test_alltoallv_packed_every_dtype():
    for it, dt in enumerate(("f32", "f16", "bf16", "f32", "f32")):
        seed = 40 + it
        C = a2a_counts(seed)
        sends = [a2a_payload(seed, s, int(C[s].sum()), dt) for s in range(P)]
        starts = [np.concatenate(([0], np.cumsum(C[s])[:-1])) for s in range(P)]
        want = np.concatenate([sends[s][starts[s][R]:starts[s][R] + C[s, R]] for s in range(P)])
        total = want.shape[0]
        cap = total + 3
        recv = poison((cap,), dt)
        got, counts = COMM.alltoallv(sends[R], C[R].copy(), recv=recv)
        assert got is recv and counts.dtype == np.int64 and counts.shape == (P,)
        assert np.array_equal(counts, C[:, R]), (counts, C[:, R])
        assert bits(got[:total]) == bits(want), (dt, seed)
        assert bits(got[total:]) == bits(poison((3,), dt)), "wrote past the data"
        # recv_capacity instead of recv; recv_offsets filled
        offs = np.full(P, -7, np.int64)
        rcounts = np.full(P, -7, np.int64)
        got2, c2 = COMM.alltoallv(sends[R], C[R].copy(), total, recv_counts=rcounts,
                                  recv_offsets=offs)
        assert c2 is rcounts and np.array_equal(c2, C[:, R])
        assert got2.shape == (total,) and bits(got2) == bits(want)
        assert np.array_equal(offs, np.concatenate(([0], np.cumsum(C[:, R])[:-1]))), offs


@test
def test_alltoallv_send_offsets():
    # Each rank lays its per-peer ranges out in reverse rank order with gaps.
    seed = 77
    C = a2a_counts(seed)
    layouts = []
    for s in range(P):
        offs = np.zeros(P, np.int64)
        pos = 2
        for p in reversed(range(P)):
            offs[p] = pos
            pos += int(C[s, p]) + 1
        buf = a2a_payload(seed, s, pos, "f32")
        layouts.append((buf, offs))
    want = np.concatenate([layouts[s][0][layouts[s][1][R]:layouts[s][1][R] + C[s, R]]
                           for s in range(P)])
    buf, offs = layouts[R]
    got, counts = COMM.alltoallv(buf, C[R].copy(), want.shape[0], send_offsets=offs)
    assert np.array_equal(counts, C[:, R]) and bits(got) == bits(want)


@test
def test_alltoallv_capacity_overflow():
    seed = 61
    C = a2a_counts(seed)
    C[:, :] = np.maximum(C, 1)  # every rank receives something
    sends = [a2a_payload(seed, s, int(C[s].sum()), "f32") for s in range(P)]
    starts = [np.concatenate(([0], np.cumsum(C[s])[:-1])) for s in range(P)]
    want = np.concatenate([sends[s][starts[s][R]:starts[s][R] + C[s, R]] for s in range(P)])
    cap = want.shape[0] - 1
    recv = poison((cap,), "f32")
    counts = np.full(P, -1, np.int64)
    expect_moelink_error(Status.ERR_INVALID_ARGUMENT, "capacity", COMM.alltoallv, sends[R],
                         C[R].copy(), recv=recv, recv_counts=counts)
    assert np.array_equal(counts, C[:, R]), "full counts even when dropped"
    assert bits(recv) == bits(want[:cap]), "what fits arrived"
    # the communicator is still usable, and zero capacity with nothing to receive works
    z = np.zeros(P, np.int64)
    got, c0 = COMM.alltoallv(np.zeros(0, np.float32), z, 0)
    assert got.shape == (0,) and np.array_equal(c0, z)


@test
def test_alltoallv_negative_count():
    # Rank 0 passes -1 for the last rank: it is sent as 0 and rank 0 reports it.
    seed = 88
    C = a2a_counts(seed)
    C[:, :] = np.maximum(C, 1)
    mine = C[R].copy()
    if R == 0:
        mine[P - 1] = -1
    eff = C.copy()
    eff[0, P - 1] = 0
    n_send = int(np.maximum(mine, 0).sum())
    send = a2a_payload(seed, R, n_send, "f32")
    cap = int(eff[:, R].sum())
    counts = np.full(P, -5, np.int64)
    if R == 0:
        expect_moelink_error(Status.ERR_INVALID_ARGUMENT, "send_counts[%d] is -1" % (P - 1),
                             COMM.alltoallv, send, mine, cap, recv_counts=counts)
    else:
        COMM.alltoallv(send, mine, cap, recv_counts=counts)
    assert np.array_equal(counts, eff[:, R]), (counts, eff[:, R])


@test
def test_alltoallv_argument_errors():
    z = np.zeros(P, np.int64)
    f = np.zeros(4, np.float32)
    expect_raises(TypeError, COMM.alltoallv, f, np.zeros(P, np.int32), 4)
    expect_raises(ValueError, COMM.alltoallv, f, np.zeros(P + 1, np.int64), 4)
    expect_raises(ValueError, COMM.alltoallv, f.reshape(2, 2), z, 4)
    expect_raises(ValueError, COMM.alltoallv, f, z)
    expect_raises(ValueError, COMM.alltoallv, f, z, -1)
    expect_raises(ValueError, COMM.alltoallv, f, z, 3, recv=np.zeros(4, np.float32))
    expect_raises(TypeError, COMM.alltoallv, f, z, recv=np.zeros(4, np.float16))
    expect_raises(TypeError, COMM.alltoallv, f, z, 4, recv_counts=np.zeros(P, np.int32))
    over = np.full(P, 2, np.int64)  # 2P > 4 elements when P > 2; make it overflow always
    over[-1] = 5
    expect_raises(ValueError, COMM.alltoallv, f, over, 64)
    bad_off = np.zeros(P, np.int64)
    bad_off[0] = 3
    expect_raises(ValueError, COMM.alltoallv, f, np.full(P, 2, np.int64), 64,
                  send_offsets=bad_off)


# ---------------------------------------------------------------------------
# Tensor parallelism (f32: exact references up to the GEMM's own summation order)
# ---------------------------------------------------------------------------

def f32_sum_in_rank_order(parts):
    acc = parts[0].astype(np.float32)
    for p in parts[1:]:
        acc = (acc + p.astype(np.float32)).astype(np.float32)
    return acc


def gemm_bound(a, b):
    """|fp32 GEMM - exact| <= k * 2^-24 * (|a| |b|^T) (any summation order) + the final rounding."""
    k = a.shape[1]
    return (k + 1) * 2.0 ** -24 * (np.abs(a.astype(np.float64)) @ np.abs(b.astype(np.float64)).T)


def same_on_every_rank(c):
    every = COMM.allgather(np.ascontiguousarray(c).reshape(1, -1))
    return all(bits(every[r]) == bits(every[0]) for r in range(P))


TP_SHAPES = [(1, 1, 1), (3, 7, 129), (5, 33, 17), (2, 1, 64)]  # (rows per rank, n, k)


@test
def test_tp_ag_gemm_f32():
    with moelink.TP(COMM, "f32", max_m=8 * P, max_n=40, max_k=130) as tp:
        assert tp.workspace_size() > 0 and "f32" in repr(tp)
        for i, (mr, n, k) in enumerate(TP_SHAPES):
            a_all = [rng_of(10 + i, r).standard_normal((mr, k)).astype(np.float32)
                     for r in range(P)]
            b = rng_of(20 + i, 0).standard_normal((n, k)).astype(np.float32)
            A = np.concatenate(a_all)
            exact = A.astype(np.float64) @ b.astype(np.float64).T
            out = np.full((mr * P, n), np.nan, np.float32)
            got = tp.ag_gemm(a_all[R], b, out=out)
            assert got is out and got.shape == (mr * P, n)
            assert np.all(np.abs(got - exact) <= gemm_bound(A, b)), (mr, n, k)
            assert same_on_every_rank(got)
            assert bits(tp.ag_gemm(a_all[R], b)) == bits(got), "not deterministic"
        # integer data: every GEMM is exact, so the result is bitwise numpy's
        a_all = [int_data(30, r, (3, 11), "f32") for r in range(P)]
        b = int_data(31, 0, (5, 11), "f32")
        want = (np.concatenate(a_all) @ b.T).astype(np.float32)
        assert bits(tp.ag_gemm(a_all[R], b)) == bits(want)
        # m = 0
        z = tp.ag_gemm(np.zeros((0, 4), np.float32), np.ones((3, 4), np.float32))
        assert z.shape == (0, 3)


def tp_reduce_case(i, m, n, k):
    a_all = [rng_of(40 + i, r).standard_normal((m, k)).astype(np.float32) for r in range(P)]
    b_all = [rng_of(50 + i, r).standard_normal((n, k)).astype(np.float32) for r in range(P)]
    partials = [(a.astype(np.float64) @ b.astype(np.float64).T).astype(np.float32)
                for a, b in zip(a_all, b_all)]
    # The header's roundings: each partial rounded to the dtype, summed in rank
    # order in fp32. What is left is each partial's own GEMM error, carried
    # through the sum (bounded by the sum of the partial bounds, plus the
    # sum's own roundings, which the reference repeats exactly).
    ref = f32_sum_in_rank_order(partials).astype(np.float64)
    bound = sum(gemm_bound(a, b) for a, b in zip(a_all, b_all))
    bound = bound * (1 + 2.0 ** -20) + P * 2.0 ** -24 * np.abs(ref)
    return a_all, b_all, ref, bound


@test
def test_tp_gemm_rs_f32():
    with moelink.TP(COMM, "f32", max_m=8 * P, max_n=40, max_k=130) as tp:
        for i, (mr, n, k) in enumerate(TP_SHAPES):
            m = mr * P
            a_all, b_all, ref, bound = tp_reduce_case(i, m, n, k)
            out = np.full((mr, n), np.nan, np.float32)
            got = tp.gemm_rs(a_all[R], b_all[R], out=out)
            assert got is out and got.shape == (mr, n)
            rows = slice(R * mr, (R + 1) * mr)
            assert np.all(np.abs(got - ref[rows]) <= bound[rows]), (mr, n, k)
            assert bits(tp.gemm_rs(a_all[R], b_all[R])) == bits(got), "not deterministic"
        a_all = [int_data(60, r, (2 * P, 9), "f32") for r in range(P)]
        b_all = [int_data(61, r, (4, 9), "f32") for r in range(P)]
        want = sum(a @ b.T for a, b in zip(a_all, b_all)).astype(np.float32)
        assert bits(tp.gemm_rs(a_all[R], b_all[R])) == bits(want[2 * R:2 * R + 2])


@test
def test_tp_gemm_ar_f32():
    with moelink.TP(COMM, "f32", max_m=8 * P, max_n=40, max_k=130) as tp:
        for i, (mr, n, k) in enumerate(TP_SHAPES + [(7, 3, 5)]):
            m = mr + (P - 1)  # gemm_ar takes any m
            a_all, b_all, ref, bound = tp_reduce_case(10 + i, m, n, k)
            out = np.full((m, n), np.nan, np.float32)
            got = tp.gemm_ar(a_all[R], b_all[R], out=out)
            assert got is out and got.shape == (m, n)
            assert np.all(np.abs(got - ref) <= bound), (m, n, k)
            assert same_on_every_rank(got)
        a_all = [int_data(70, r, (3, 9), "f32") for r in range(P)]
        b_all = [int_data(71, r, (4, 9), "f32") for r in range(P)]
        want = sum(a @ b.T for a, b in zip(a_all, b_all)).astype(np.float32)
        assert bits(tp.gemm_ar(a_all[R], b_all[R])) == bits(want)


@test
def test_tp_errors():
    expect_moelink_error(Status.ERR_INVALID_ARGUMENT, "must all be >= 1", moelink.TP, COMM,
                         "f32", 0, 4, 4)
    expect_moelink_error(Status.ERR_UNSUPPORTED, "not supported", moelink.TP, COMM, "fp8",
                         4, 4, 4)
    expect_raises(ValueError, moelink.TP, COMM, "f64", 4, 4, 4)
    expect_raises(TypeError, moelink.TP, CTX, "f32", 4, 4, 4)
    tp = moelink.TP(COMM, "f32", max_m=4 * P, max_n=8, max_k=8)
    a = np.ones((2, 8), np.float32)
    b = np.ones((3, 8), np.float32)
    expect_raises(TypeError, tp.gemm_ar, a.astype(np.float16), b)
    expect_raises(ValueError, tp.gemm_ar, a, np.ones((3, 7), np.float32))
    expect_raises(ValueError, tp.gemm_ar, a, b, out=np.zeros((2, 4), np.float32))
    expect_raises(ValueError, tp.gemm_ar, np.ones((8, 4), np.float32).T, b[:, :8])
    if P > 1:
        expect_raises(ValueError, tp.gemm_rs, np.ones((P + 1, 8), np.float32), b)
    # sizes past the config: the library's check, alike on every rank
    expect_moelink_error(Status.ERR_INVALID_ARGUMENT, "exceed the tp's max_m", tp.gemm_ar,
                         np.ones((4 * P + 1, 8), np.float32), b)
    expect_moelink_error(Status.ERR_INVALID_ARGUMENT, "exceed", tp.ag_gemm,
                         np.ones((5, 8), np.float32), b)
    assert np.array_equal(tp.gemm_ar(a, b), np.full((2, 3), 8.0 * P, np.float32))
    tp.close()
    tp.close()
    expect_raises(ValueError, tp.gemm_ar, a, b)


# ---------------------------------------------------------------------------
# Expert parallelism against the single-rank layer
# ---------------------------------------------------------------------------

EP_CFG = dict(hidden=24, inter=10, experts=6, top_k=2, router="sigmoid", n_group=1,
              topk_group=1, routed_scaling=1.5, correction_bias=True, shared_inter=6,
              shared_gate=True)


def ep_weights(cfg, seed):
    g = rng_of(seed, 0)
    H, I, E, Is = cfg["hidden"], cfg["inter"], cfg["experts"], cfg["shared_inter"]

    def w(*shape, scale=1.0):
        return (g.standard_normal(shape) * scale).astype(np.float32)

    return dict(router=w(E, H, scale=0.5), correction_bias=w(E, scale=0.1),
                gate_up=w(E, 2 * I, H, scale=H ** -0.5), down=w(E, H, I, scale=I ** -0.5),
                shared_gate_up=w(2 * Is, H, scale=H ** -0.5),
                shared_down=w(H, Is, scale=Is ** -0.5), shared_gate=w(H, scale=H ** -0.5))


def ep_check(ep, W, tokens, seed, cfg, max_tokens):
    xs = [rng_of(seed, r).standard_normal((tokens[r], cfg["hidden"])).astype(np.float32)
          for r in range(P)]
    out = np.full(xs[R].shape, np.nan, np.float32)
    got = ep.forward(xs[R], out=out)
    assert got is out
    with moelink.MoE(CTX, dtype="f32", max_tokens=max_tokens, **cfg) as moe:
        moe.set_weights(**W)
        ref = moe.forward(np.concatenate(xs)).astype(np.float64)
    lo = sum(tokens[:R])
    mine = ref[lo:lo + tokens[R]]
    rms = np.sqrt(np.mean(ref ** 2)) if ref.size else 0.0
    err = np.abs(got - mine)
    assert np.all(err <= 1e-5 * (np.abs(mine) + rms)), (tokens, float(err.max()))
    again = ep.forward(xs[R])
    assert bits(again) == bits(got), "EP forward is not deterministic"


@test
def test_ep_forward_matches_single_rank():
    cfg = EP_CFG
    W = ep_weights(cfg, 3)
    E, El = cfg["experts"], cfg["experts"] // P
    for recv_capacity, max_tokens in ((0, 16), (5, 8)):
        with moelink.EP(COMM, dtype="f32", max_tokens=max_tokens, recv_capacity=recv_capacity,
                        **cfg) as ep:
            assert ep.local_experts == El and ep.first_expert == R * El, (ep.first_expert,)
            assert ep.num_experts == E and ep.dtype == "f32" and ep.workspace_size() > 0
            assert ep.recv_capacity == (recv_capacity or max_tokens * min(P, cfg["top_k"]))
            assert ep.call_tokens == max_tokens  # 0 resolves to max_tokens
            assert ep.config["router"] == "sigmoid" and ep.config["shared_gate"]
            f = ep.first_expert
            ep.set_weights(router=W["router"], correction_bias=W["correction_bias"],
                           gate_up=np.ascontiguousarray(W["gate_up"][f:f + El]),
                           down=np.ascontiguousarray(W["down"][f:f + El]),
                           shared_gate_up=W["shared_gate_up"], shared_down=W["shared_down"],
                           shared_gate=W["shared_gate"])
            assert set(ep.weights) == set(W)
            rng = rng_of(11, recv_capacity)  # same on every rank
            for it in range(3):
                tokens = [int(t) for t in rng.integers(0, 2 * max_tokens + 3, size=P)]
                if it == 0:
                    tokens[P - 1] = 0  # a rank with no tokens still serves its experts
                if it == 1:
                    tokens[0] = 3 * max_tokens + 1  # several steps
                ep_check(ep, W, tokens, 1000 + it, cfg, max_tokens)


@test
def test_ep_fp8_dispatch():
    # Rows that travel as FP8 / MXFP8: close to the unquantized layer (e4m3
    # keeps 3 mantissa bits), deterministic, and the config is checked.
    cfg = dict(EP_CFG, hidden=128, shared_inter=0, shared_gate=False)
    W = ep_weights(dict(cfg, shared_inter=1), 5)
    El = cfg["experts"] // P
    x = rng_of(21, R).standard_normal((5, 128)).astype(np.float32)
    outs = {}
    for q in ("none", "fp8", "mxfp8"):
        with moelink.EP(COMM, dtype="f32", max_tokens=8, dispatch_quant=q, **cfg) as ep:
            assert ep.dispatch_quant == q
            f = ep.first_expert
            ep.set_weights(router=W["router"], correction_bias=W["correction_bias"],
                           gate_up=np.ascontiguousarray(W["gate_up"][f:f + El]),
                           down=np.ascontiguousarray(W["down"][f:f + El]))
            outs[q] = ep.forward(x)
            assert bits(ep.forward(x)) == bits(outs[q]), q
    ref = outs["none"].astype(np.float64)
    for q in ("fp8", "mxfp8"):
        d = outs[q] - ref
        rel = np.sqrt(np.sum(d * d) / np.sum(ref * ref))
        assert 0 < rel < 0.08, (q, rel)
    expect_raises(ValueError, moelink.EP, COMM, dtype="f32", dispatch_quant="int8", **cfg)
    expect_moelink_error(Status.ERR_INVALID_ARGUMENT, "multiple of the FP8 block", moelink.EP,
                         COMM, dtype="f32", max_tokens=8, dispatch_quant="fp8", **EP_CFG)


@test
def test_ep_dispatch_combine():
    # The two exchanges with this rank's own experts between them (a plain
    # MoE of E/P experts on the received rows) give the forward's output; the
    # received rows are other ranks' token rows with their local ids.
    cfg = dict(EP_CFG, shared_inter=0, shared_gate=False)
    W = ep_weights(dict(cfg, shared_inter=1), 6)
    El, k, H, M = cfg["experts"] // P, cfg["top_k"], cfg["hidden"], 8
    full = {n: W[n] for n in ("router", "correction_bias", "gate_up", "down")}
    with moelink.EP(COMM, dtype="f32", max_tokens=M, recv_capacity=P * M, **cfg) as ep, \
            moelink.MoE(CTX, dtype="f32", max_tokens=M, **cfg) as router, \
            moelink.MoE(CTX, dtype="f32", max_tokens=P * M, **dict(cfg, experts=El,
                                                                   top_k=min(k, El),
                                                                   n_group=1, topk_group=1,
                                                                   correction_bias=False)) \
            as local:
        f = ep.first_expert
        sl = dict(gate_up=np.ascontiguousarray(W["gate_up"][f:f + El]),
                  down=np.ascontiguousarray(W["down"][f:f + El]))
        ep.set_weights(router=W["router"], correction_bias=W["correction_bias"], **sl)
        router.set_weights(**full)
        local.set_weights(router=np.zeros((El, H), np.float32), **sl)
        rng = rng_of(31, 0)  # same on every rank
        for it in range(3):
            tokens = [int(t) for t in rng.integers(0, M + 1, size=P)]
            xs = [rng_of(500 + it, r).standard_normal((tokens[r], H)).astype(np.float32)
                  for r in range(P)]
            x = xs[R]
            ids, w = router.route(x)
            got = ep.dispatch(x, ids, w)
            assert got.capacity == P * M and got.top_k == min(k, El) and got.num_tokens == len(x)
            held = got.expert_ids[:, 0] >= 0
            # every held row is some rank's token that has an expert here
            want = 0
            for r in range(P):
                rid, _ = router.route(xs[r])
                mine = (rid >= f) & (rid < f + El)
                want += int(np.count_nonzero(mine.any(axis=1)))
                for t in np.nonzero(mine.any(axis=1))[0]:
                    hit = np.all(got.rows[held] == xs[r][t], axis=1)
                    assert hit.any(), (r, int(t))
            assert int(np.count_nonzero(held)) == want, (int(np.count_nonzero(held)), want)
            plan = local.plan(got.expert_ids)
            y = local.experts(got.rows, plan, got.weights)
            out = ep.combine(y, plan.pair_rows)
            ref = ep.forward(x)
            err = np.abs(out - ref)
            assert out.shape == x.shape and np.all(err <= 1e-5 * (np.abs(ref) + 1e-3)), \
                float(err.max()) if err.size else 0.0
        expect_raises(ValueError, ep.combine, y)  # no dispatch pending
        expect_raises(ValueError, ep.dispatch_quantized, np.zeros((1, H), np.uint8),
                      np.zeros((1, 1), np.float32), ids[:1], w[:1])


def _e4m3_table():
    # All 256 codes, decoded from the bit layout (1-4-3, bias 7, 0x7f/0xff NaN).
    v = np.zeros(256, np.float64)
    for b in range(256):
        e, m = (b >> 3) & 15, b & 7
        mag = m * 2.0 ** -9 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
        v[b] = np.nan if (e == 15 and m == 7) else (-mag if b & 0x80 else mag)
    return v


def _e4m3_ref(vals):
    # The nearest magnitude code to |x| (ties to the even code), saturating at
    # 448, with x's sign bit.
    mags = _e4m3_table()[:0x7f]
    out = np.zeros(vals.shape, np.uint8)
    for i, x in enumerate(vals.ravel()):
        d = np.abs(mags - min(abs(float(x)), 448.0))
        best = np.nonzero(d == d.min())[0]
        if len(best) > 1:
            best = best[(best & 1) == 0]
        out.ravel()[i] = int(best[0]) | (0x80 if np.signbit(x) else 0)
    return out


@test
def test_quantize():
    # moelink_quantize against a reference written here from the definitions.
    table = _e4m3_table()
    g = rng_of(41, R)
    x = (g.standard_normal((3, 256)) * np.exp(g.uniform(-6, 6, (3, 1)))).astype(np.float32)
    x[1, :128] = 0.0  # a block of zeros
    q, s = CTX.quantize(x, "fp8")
    assert q.shape == (3, 256) and q.dtype == np.uint8 and s.shape == (3, 2)
    for r in range(3):
        for b in range(2):
            blk = x[r, b * 128:(b + 1) * 128]
            amax = np.float32(np.max(np.abs(blk)))
            sc = np.float32(amax / np.float32(448.0))
            assert s[r, b] == sc, (r, b, s[r, b], sc)
            want = _e4m3_ref((blk / sc).astype(np.float32)) if sc > 0 else np.zeros(128, np.uint8)
            assert np.array_equal(q[r, b * 128:(b + 1) * 128], want), (r, b)
    back = CTX.dequantize(q, s, "fp8", dtype="f32")
    want = (table[q].astype(np.float32) * np.repeat(s, 128, axis=1)).astype(np.float32)
    assert np.array_equal(back, want)
    rel = np.abs(back - x) / (np.repeat(np.max(np.abs(x).reshape(3, 2, 128), axis=2), 128,
                                        axis=1) + 1e-30)
    assert np.all(rel <= 2.0 ** -4), float(rel.max())
    q2, e = CTX.quantize(x, "mxfp8")
    assert e.shape == (3, 8) and e.dtype == np.uint8
    for r in range(3):
        for b in range(8):
            blk = x[r, b * 32:(b + 1) * 32]
            amax = float(np.max(np.abs(blk)))
            X = 0 if amax == 0 else int(np.clip(np.floor(np.log2(amax)) - 8, -127, 127))
            assert e[r, b] == X + 127, (r, b, int(e[r, b]), X)
            want = _e4m3_ref((blk * np.float32(2.0 ** -X)).astype(np.float32))
            assert np.array_equal(q2[r, b * 32:(b + 1) * 32], want), (r, b)
    expect_raises(ValueError, CTX.quantize, x[:, :100], "fp8")
    expect_raises(ValueError, CTX.quantize, x, "int4")


@test
def test_ep_errors():
    cfg = dict(EP_CFG)
    W = ep_weights(cfg, 4)
    if P > 1:
        bad = dict(cfg, experts=6 * P + 1)
        expect_moelink_error(Status.ERR_INVALID_ARGUMENT, "not a multiple of the %d ranks" % P,
                             moelink.EP, COMM, dtype="f32", max_tokens=8, **bad)
    expect_moelink_error(Status.ERR_INVALID_ARGUMENT, "top_k", moelink.EP, COMM, dtype="f32",
                         max_tokens=8, **dict(cfg, top_k=cfg["experts"] + 1))
    expect_raises(TypeError, moelink.EP, CTX, dtype="f32", **cfg)
    ep = moelink.EP(COMM, dtype="f32", max_tokens=8, **cfg)
    El, f = ep.local_experts, ep.first_expert
    x = np.ones((3, cfg["hidden"]), np.float32)
    # no weights on any rank: every rank refuses alike
    expect_moelink_error(Status.ERR_INVALID_STATE, "before moelink_ep_set_weights", ep.forward, x)
    full = dict(W)
    if P > 1:  # the whole layer's experts instead of this rank's slice
        expect_raises(ValueError, ep.set_weights, **full)
    sliced = dict(W, gate_up=np.ascontiguousarray(W["gate_up"][f:f + El]),
                  down=np.ascontiguousarray(W["down"][f:f + El]))
    expect_raises(TypeError, ep.set_weights, **dict(sliced, router=W["router"].astype(np.float16)))
    # a weight the config needs is missing: the library says so
    no_bias = dict(sliced)
    del no_bias["correction_bias"]
    expect_moelink_error(Status.ERR_INVALID_ARGUMENT, "correction_bias", ep.set_weights,
                         **no_bias)
    ep.set_weights(**sliced)
    expect_raises(TypeError, ep.forward, x.astype(np.float16))
    expect_raises(ValueError, ep.forward, np.ones((3, cfg["hidden"] + 1), np.float32))
    expect_raises(ValueError, ep.forward, x, out=np.zeros((4, cfg["hidden"]), np.float32))
    y = ep.forward(x)  # still works after the refusals
    assert y.shape == x.shape and np.all(np.isfinite(y))
    assert ep.forward(np.zeros((0, cfg["hidden"]), np.float32)).shape == (0, cfg["hidden"])
    ep.close()
    expect_raises(ValueError, ep.forward, x)


# ---------------------------------------------------------------------------
# A second communicator from an id passed by hand; closing closes its objects
# ---------------------------------------------------------------------------

@test
def test_second_comm_from_unique_id():
    uid = moelink.unique_id(CTX) if R == 0 else "0" * 256
    assert len(uid) == 256
    # The id travels as bf16 "bits" (a bitwise copy): two hex characters per element.
    raw = np.frombuffer(uid.encode(), np.uint16).copy()
    got = COMM.allgather(raw)
    uid0 = got[:128].tobytes().decode()
    with moelink.Comm(CTX, R, P, uid0) as c2:
        assert (c2.rank, c2.size) == (R, P)
        assert np.array_equal(c2.allreduce(np.full(3, R, np.float32)),
                              np.full(3, P * (P - 1) / 2, np.float32))
        tp = moelink.TP(c2, "f32", 2 * P, 4, 4)
        ep = moelink.EP(c2, dtype="f32", max_tokens=4, **EP_CFG)
    assert tp._h is None and ep._h is None, "closing the comm closes its TP and EP"
    expect_raises(ValueError, tp.gemm_ar, np.ones((1, 4), np.float32), np.ones((1, 4), np.float32))
    expect_raises(ValueError, c2.allreduce, np.ones(3, np.float32))
    expect_raises(ValueError, c2.check)


def main(argv):
    global CTX, COMM, R, P
    pick = argv[1:]
    CTX = moelink.Context("cpu", threads=1)
    COMM = moelink.Comm.from_env(CTX)
    R, P = COMM.rank, COMM.size
    passed, failed, skipped = run(pick)
    # Closing the context closes the communicator (collective) first.
    CTX.close()
    assert COMM._h is None
    return summary(passed, failed, skipped)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
