#!/usr/bin/env bash
# On a GPU machine (through the device tool): configure with CUDA, build, run the gpu tests,
# then the benchmarks. Logs and JSON go to $OUT (or ./out). At most 8 files come back from the
# device tool, so everything is gathered into a few.
#   scripts/gpu-check.sh [PART...]   (default all)
# PARTs: gpu (ctest -L gpu), mgpu (ctest -L mgpu, 2+ GPUs), bench (MoE layer benchmarks, fp8
# included), fp8 (the layer with FP8 experts only: checked against the reference, benchmarked;
# FP8_TOKENS, FP8_AB env variants, FP8_SHARED_PRESETS with the shared expert in FP8 too,
# FP8_NCU=1 kernel times),
# comm (moelink bench comm beside NCCL, 2+ GPUs), tp (moelink bench tp and compare_tp.py,
# 2+ GPUs), ep (moelink bench ep: the expert-parallel layer, 2+ GPUs), probe (the weight-stream
# probe bench/stream_probe.cu, the router alone (bench/router_probe.c), the one-kernel layer
# alone (bench/small_probe.c) and the decode GEMMs'
# own benchmark, gpu_test_decode --bench; not in all), tpprobe (the one-kernel gemm_ar GEMMs
# alone on one GPU beside cuBLAS, bench/gemm_ar_probe.cu, with ncu; not in all), prefill (the
# layer at 512-8192 tokens with PREFILL_AB variants, ncu of the sm_90a GEMMs; not in all),
# fp8probe (the FP8 GEMMs with parts left out, moelink_probeN; not in all), mgpu1 (the EP mgpu
# tests with one rank on one GPU; not in all), profile (nsys + ncu kernel times at decode
# sizes; not in all), ncudecode (Nsight Compute's sections and per-instruction stall samples of
# the decode GEMMs; not in all), trace (bench/trace_layer.py: the kernels of back-to-back calls
# at 8192 tokens with the clocks; not in all), decode (graph replays at decode sizes, bf16 and fp8,
# AB_ENV variants after each default run, DECODE_REPS rounds, DECODE_DTYPES (bf16 fp8); not
# in all); test = gpu mgpu;
# TP_AB: extra `bench tp` runs, one per VAR=value[,VAR=value] word (default MOELINK_TP_GEMM=1);
# GPU_TESTS: a ctest -R regex for the gpu part; all = every part. Parts that need 2 GPUs are
# skipped on one; RANKS (default: every GPU of the machine) is their rank count, the mgpu tests'
# too (issue 7: 4 and 8).
# BUILD_TARGETS="t1 t2": build only these targets (e.g. moelink_cli for a bench-only run).
# AB_PATCH="a.patch [b.patch...]": the decode part also runs, right after each default run, the
# moelink of one more build per patch: a copy of the tree with that patch applied (AB_PATCH_R=1:
# reversed, e.g. the parent of a wip patch already applied with git am): same-call A/Bs.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT/json"
PARTS=" ${*:-all} "
want() { case "$PARTS" in *" all "*|*" $1 "*) return 0;; esac
         [ "$1" = gpu ] || [ "$1" = mgpu ] && case "$PARTS" in *" test "*) return 0;; esac
         return 1; }
NGPU=$(nvidia-smi -L | wc -l)
# RANKS: the ranks (one GPU each) of the multi-GPU parts, mgpu tests included (default every GPU)
RANKS=${RANKS:-$NGPU}
export NCCL_NVLS_ENABLE=0
BUILD=${BUILD:-build-gpu}
JOBS=$(nproc)
log() { echo "== $(date +%T) $*" | tee -a "$OUT/summary.txt"; }
# Nsight Compute and Systems, where the machine has them (empty: the parts that need them skip)
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute*/ncu 2>/dev/null | head -1)
NSYS=$(command -v nsys || ls /usr/local/cuda*/bin/nsys /opt/nvidia/nsight-systems*/bin/nsys 2>/dev/null | head -1)

log "host: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | head -4 | tr '\n' ';')"
# The device copy of the tree has no .git: the caller passes MOELINK_COMMIT.
export MOELINK_COMMIT=${MOELINK_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
log "commit: $MOELINK_COMMIT"
# The CPU backend (the GPU tests' reference) needs OpenBLAS. The GPU image has no package
# registry: unpack the Debian packages carried in .debs/ (see docs/PERF.md, "how to run").
if ! pkg-config --exists openblas 2>/dev/null && [ -d .debs ]; then
  DEPS=/tmp/mldeps
  for f in .debs/*.deb; do dpkg -x "$f" "$DEPS"; done
  ML_CMAKE_FLAGS="${ML_CMAKE_FLAGS:-} -DML_CBLAS_INCLUDE=$DEPS/usr/include/x86_64-linux-gnu/openblas-openmp -DML_OPENBLAS_LIB=$DEPS/usr/lib/x86_64-linux-gnu/openblas-openmp/libopenblas.so"
  export LD_LIBRARY_PATH=$DEPS/usr/lib/x86_64-linux-gnu/openblas-openmp:$DEPS/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  log "OpenBLAS from .debs unpacked into $DEPS"
fi
log "configure + build ($BUILD, -j$JOBS)"
if ! { cmake -S . -B "$BUILD" -DMOELINK_CUDA=ON -DCMAKE_BUILD_TYPE=Release \
         -DMOELINK_MGPU_RANKS=$((RANKS >= 2 ? RANKS : 2)) \
         -DMOELINK_PROBES=$(case "$PARTS" in *" fp8probe "*) echo ON;; *) echo OFF;; esac) ${ML_CMAKE_FLAGS:-} &&
       cmake --build "$BUILD" -j "$JOBS" ${BUILD_TARGETS:+--target $BUILD_TARGETS}; } >"$OUT/build.log" 2>&1; then
  tail -40 "$OUT/build.log"
  log "BUILD FAILED"
  exit 1
fi
log "build ok"

rc=0

# AB_PATCH: one more build (moelink_cli only) per patch, each from a patched copy of the tree
# (only for the decode part, the one that runs them)
ABBINS=() ABNAMES=()
i=0
case "$PARTS" in *" decode "*) AB_LIST=${AB_PATCH:-};; *) AB_LIST="";; esac
for abp in $AB_LIST; do
  i=$((i + 1))
  WIP=/tmp/mlwip$i ABP=$(realpath "$abp")
  log "A/B build $i: $abp${AB_PATCH_R:+ reversed} in $WIP"
  rm -rf "$WIP" && mkdir -p "$WIP"
  tar --exclude='./build*' --exclude=./out -cf - . | tar -xf - -C "$WIP"
  if (cd "$WIP" && patch -p1 --quiet ${AB_PATCH_R:+-R} <"$ABP") >>"$OUT/build.log" 2>&1 &&
     { cmake -S "$WIP" -B "$WIP/build-ab" -DMOELINK_CUDA=ON -DCMAKE_BUILD_TYPE=Release ${ML_CMAKE_FLAGS:-} &&
       cmake --build "$WIP/build-ab" -j "$JOBS" --target moelink_cli; } >>"$OUT/build.log" 2>&1; then
    ABBINS+=("$WIP/build-ab/moelink") ABNAMES+=("$abp")
    log "A/B build $i ok"
  else
    tail -20 "$OUT/build.log"
    log "A/B BUILD $i FAILED (the decode part runs without it)"
    rc=1
  fi
done
if want gpu; then
  log "ctest -L gpu"
  # GPU_TESTS: a ctest -R regex (only those tests)
  (cd "$BUILD" && ctest -L '^gpu$' ${GPU_TESTS:+-R "$GPU_TESTS"} -V --timeout ${TEST_TIMEOUT:-300}) >"$OUT/test.log" 2>&1 || rc=1
  # ctest -V prefixes each test's lines with "N: "; show failures and per-test counts.
  grep -E ': not ok |: [0-9]+ passed, [0-9]+ failed|: FAIL|Test +#|tests passed' "$OUT/test.log" | tail -60
  log "gpu tests: $(grep -E 'tests passed' "$OUT/test.log" | tail -1)"
  log "TAP checks: $(grep -cE '^[0-9]+: ok ' "$OUT/test.log") ok, $(grep -cE '^[0-9]+: not ok ' "$OUT/test.log") not ok"
fi

if want mgpu && [ "$RANKS" -ge 2 ]; then
  log "ctest -L mgpu ($RANKS ranks under moelink launch)"
  (cd "$BUILD" && ctest -L '^mgpu$' -V --timeout ${TEST_TIMEOUT:-300}) >"$OUT/mgpu.log" 2>&1 || rc=1
  grep -E ': \[rank [0-9]+\] ([0-9]+ passed|not ok)|Test +#|tests passed' "$OUT/mgpu.log" | tail -20
fi
# mgpu1 (not in all): the expert-parallel tests with ONE rank, for a machine with one GPU (the
# exchanges then move rows within the GPU; what needs two ranks is skipped by the tests)
if case "$PARTS" in *" mgpu1 "*) true;; *) false;; esac; then
  # as ctest runs it, then as mgpu_test_ep_two_kernel does (two kernels an exchange, the
  # return fused into the down GEMM at every size)
  for v in "" "MOELINK_EP_LL=0 MOELINK_EP_FUSED_RETURN=1"; do
    log "mgpu_test_ep with one rank${v:+ ($v)}"
    env $v ./"$BUILD"/moelink launch -n 1 --timeout ${TEST_TIMEOUT:-300} -- \
      ./"$BUILD"/tests/mgpu_test_ep >>"$OUT/mgpu1.log" 2>&1 || rc=1
    log "  $(grep -E '\] [0-9]+ passed, [0-9]+ failed' "$OUT/mgpu1.log" | tail -1)"
  done
  grep -E 'not ok' "$OUT/mgpu1.log" | head -20
fi

if want bench; then
  TOKENS=${TOKENS:-1,16,128,512,2048,8192}
  for p in ${PRESETS:-mixtral-8x7b qwen3-30b-a3b deepseek-v3}; do
    log "bench $p"
    ./"$BUILD"/moelink bench --backend cuda --preset "$p" --tokens "$TOKENS" \
      --json "$OUT/json/bench_$p.json" 2>&1 | tee -a "$OUT/bench.log" || rc=1
  done
  # Decode sizes again as CUDA-graph replays (no host launch work in the time).
  for p in ${PRESETS:-mixtral-8x7b qwen3-30b-a3b deepseek-v3}; do
    log "bench $p (graph replay)"
    ./"$BUILD"/moelink bench --backend cuda --preset "$p" --tokens 1,16,128 --graph \
      --json "$OUT/json/bench_graph_$p.json" 2>&1 | tee -a "$OUT/bench.log" || rc=1
  done
  if python3 -c 'import torch' 2>/dev/null; then
    for p in ${PRESETS:-mixtral-8x7b qwen3-30b-a3b deepseek-v3}; do
      log "compare_torch $p"
      MOELINK_LIBRARY=$PWD/$BUILD/libmoelink.so PYTHONPATH=$PWD/python PYTHONUNBUFFERED=1 \
        python3 bench/compare_torch.py --preset "$p" --tokens "$TOKENS" \
        --json "$OUT/json/torch_$p.json" 2>&1 | tee -a "$OUT/bench.log" || rc=1
    done
  fi
fi
# FP8 experts (DeepSeek-V3's e4m3 + 128x128 block scales): a check of the output against the
# reference, then the benchmarks (weights made on the host, 16 cores: ~10 s for deepseek-v3).
if want fp8 || want bench; then
  log "run --fp8-experts --verify (small shape, then deepseek-v3 with 32 experts)"
  ./"$BUILD"/moelink run --backend cuda --fp8-experts --tokens 77 --verify 2>&1 |
    tee -a "$OUT/bench.log" || rc=1
  ./"$BUILD"/moelink run --backend cuda --fp8-experts --preset deepseek-v3 --experts 32 \
    --tokens 64 --verify --verify-tokens 16 2>&1 | tee -a "$OUT/bench.log" || rc=1
  # the shared expert in FP8 too: decode-size (its decode GEMMs) and prefill-size batches
  for t in 16 600; do
    ./"$BUILD"/moelink run --backend cuda --fp8-experts --fp8-shared --preset deepseek-v3 \
      --experts 32 --tokens $t --verify --verify-tokens 16 2>&1 | tee -a "$OUT/bench.log" || rc=1
  done
  # FP8_AB="VAR=v[,VAR=v] ...": each preset again under each word (e.g. MOELINK_GEMM_FP8_QUANT=1)
  for p in ${PRESETS:-mixtral-8x7b qwen3-30b-a3b deepseek-v3}; do
    for v in "" ${FP8_AB:-}; do
      log "bench $p (fp8 experts)${v:+ with $v}"
      env ${v//,/ } ./"$BUILD"/moelink bench --backend cuda --fp8-experts --preset "$p" \
        --tokens "${FP8_TOKENS:-1,16,128,8192}" \
        --json "$OUT/json/bench_fp8_$p${v:+_${v//[^A-Za-z0-9]/_}}.json" 2>&1 |
        tee -a "$OUT/bench.log" || rc=1
    done
  done
  # FP8_SHARED_PRESETS (default deepseek-v3): those presets again with the shared expert in FP8
  for p in ${FP8_SHARED_PRESETS-deepseek-v3}; do
    log "bench $p (fp8 experts and shared expert)"
    ./"$BUILD"/moelink bench --backend cuda --fp8-experts --fp8-shared --preset "$p" \
      --tokens "${FP8_TOKENS:-1,16,128,8192}" --json "$OUT/json/bench_fp8_shared_$p.json" 2>&1 |
      tee -a "$OUT/bench.log" || rc=1
  done
  # FP8_NCU=1: each FP8 layer's kernels at 8192 tokens under Nsight Compute (speed of light:
  # time, SM clock, L2 use), default and each FP8_AB word, into fp8_ncu.log
  if [ -n "$NCU" ] && [ -n "${FP8_NCU:-}" ]; then
    for p in ${PRESETS:-mixtral-8x7b qwen3-30b-a3b deepseek-v3}; do
      for v in "" ${FP8_AB:-}; do
        log "ncu $p 8192 fp8 kernels${v:+ with $v}"
        echo "== $p ${v:-(default)}" >>"$OUT/fp8_ncu.log"
        env ${v//,/ } "$NCU" --clock-control none --section SpeedOfLight \
          -k 'regex:^(ml_|mld_)' ./"$BUILD"/moelink bench --backend cuda --fp8-experts \
          --preset "$p" --tokens 8192 --iters 1 --warmup 0 >>"$OUT/fp8_ncu.log" 2>&1 || rc=1
      done
    done
  fi
fi
# Collectives beside NCCL's on RANKS GPUs: the default SM engines, then the copy-engine
# all-gather.
if want comm && [ "$RANKS" -ge 2 ]; then
  log "bench comm ($RANKS ranks)"
  ./"$BUILD"/moelink launch -n "$RANKS" --timeout 600 -- ./"$BUILD"/moelink bench comm --backend cuda \
    --json "$OUT/json/bench_comm.json" 2>&1 | tee -a "$OUT/comm.log" || rc=1
  log "bench comm, copy-engine all-gather ($RANKS ranks)"
  ./"$BUILD"/moelink launch -n "$RANKS" --timeout 300 -- ./"$BUILD"/moelink bench comm --backend cuda \
    --ops allgather --allgather ce --json "$OUT/json/bench_comm_ce.json" 2>&1 |
    tee -a "$OUT/comm.log" || rc=1
fi
# The expert-parallel layer (issue 6) on RANKS GPUs: beside the single-GPU layer and NCCL
# moving the same rows; dispatch and combine timed on their own; the sequential pieces.
if want ep && [ "$RANKS" -ge 2 ]; then
  log "bench ep ($RANKS ranks)"
  # EP_ARGS: options of this run (e.g. --tokens 128,4096 --steps 8); EP_QUANT: the dispatch
  # formats of the runs after it (default fp8 mxfp8; "" for none); EP_AB="VAR=v[,VAR=v] ...":
  # the first run again under each word (e.g. MOELINK_EP_FUSED_RETURN=0).
  ./"$BUILD"/moelink launch -n "$RANKS" --timeout 600 -- ./"$BUILD"/moelink bench ep ${EP_ARGS:-} \
    --json "$OUT/json/bench_ep.json" 2>&1 | tee -a "$OUT/ep.log" || rc=1
  for v in ${EP_AB:-}; do
    log "bench ep with $v"
    env ${v//,/ } ./"$BUILD"/moelink launch -n "$RANKS" --timeout 600 -- ./"$BUILD"/moelink \
      bench ep ${EP_ARGS:-} --json "$OUT/json/bench_ep_${v//[^A-Za-z0-9]/_}.json" 2>&1 |
      tee -a "$OUT/ep.log" || rc=1
  done
  for q in ${EP_QUANT-fp8 mxfp8}; do
    log "bench ep, rows dispatched as $q"
    ./"$BUILD"/moelink launch -n "$RANKS" --timeout 600 -- ./"$BUILD"/moelink bench ep \
      --tokens 128,4096 --dispatch-quant $q --json "$OUT/json/bench_ep_$q.json" 2>&1 |
      tee -a "$OUT/ep.log" || rc=1
  done
fi
# Tensor-parallel fused GEMMs (issue 8) on RANKS GPUs: moelink's ops beside cuBLAS and NCCL
# (moelink's GEMM choice, then its own engines only), then PyTorch's symm_mem fused ops.
if want tp && [ "$RANKS" -ge 2 ]; then
  log "bench tp ($RANKS ranks)"
  ./"$BUILD"/moelink launch -n "$RANKS" --timeout 300 -- ./"$BUILD"/moelink bench tp \
    --json "$OUT/json/bench_tp.json" 2>&1 | tee -a "$OUT/tp.log" || rc=1
  # TP_AB: one more run per word, under that VAR=value (commas join several: A=1,B=2;
  # MOELINK_TP_GEMM=1: moelink's GEMM engines; =2: cublasGemmEx instead of cuBLASLt;
  # MOELINK_TP_LT_ALGO=i: Lt's i-th algorithm). TP_OPS: --ops of those runs (default all).
  for v in ${TP_AB-MOELINK_TP_GEMM=1}; do
    log "bench tp, $v"
    env ${v//,/ } ./"$BUILD"/moelink launch -n "$RANKS" --timeout 300 -- ./"$BUILD"/moelink bench tp ${TP_OPS:+--ops $TP_OPS} \
      --json "$OUT/json/bench_tp_${v//[^A-Za-z0-9]/_}.json" 2>&1 | tee -a "$OUT/tp.log" || rc=1
  done
  if python3 -c 'import torch' 2>/dev/null; then
    log "compare_tp ($RANKS ranks)"
    PYTHONUNBUFFERED=1 ./"$BUILD"/moelink launch -n "$RANKS" --timeout 300 -- \
      python3 bench/compare_tp.py --json "$OUT/json/torch_tp.json" 2>&1 | tee -a "$OUT/tp.log" || rc=1
  fi
fi
# Where the decode GEMMs' weight stream loses time: read patterns alone, then the kernels.
if case "$PARTS" in *" probe "*) true;; *) false;; esac; then
  log "stream probe"
  nvcc -O3 -arch=sm_90a -o "$BUILD/stream_probe" bench/stream_probe.cu >>"$OUT/build.log" 2>&1 &&
    ./"$BUILD"/stream_probe 2>&1 | tee -a "$OUT/probe.log" || rc=1
  # bench/NAME.c, a C probe that drives internal launchers: linked with the static library
  c_probe() {
    gcc -std=c11 -O2 -Isrc -Iinclude -I"${CUDA_HOME:-/usr/local/cuda}/include" "bench/$1.c" \
      "$BUILD/libmoelink.a" -L"${CUDA_HOME:-/usr/local/cuda}/lib64" -lcudart -lstdc++ -lm \
      -lpthread -ldl -o "$BUILD/$1" >>"$OUT/build.log" 2>&1 &&
      ./"$BUILD/$1" 2>&1 | tee -a "$OUT/probe.log"
  }
  log "router probe"
  c_probe router_probe || rc=1
  log "one-kernel layer probe"
  c_probe small_probe || rc=1
  log "one-kernel layer probe, FP8 experts"
  ./"$BUILD"/small_probe --fp8 2>&1 | tee -a "$OUT/probe.log" || rc=1
  # SMALL_PROBE_ENV: both again once per VAR=v[,VAR=v] word
  for v in ${SMALL_PROBE_ENV:-}; do
    log "one-kernel layer probe with $v"
    env ${v//,/ } ./"$BUILD"/small_probe 2>&1 | tee -a "$OUT/probe.log" || rc=1
    env ${v//,/ } ./"$BUILD"/small_probe --fp8 2>&1 | tee -a "$OUT/probe.log" || rc=1
  done
  log "gpu_test_decode --bench ${PROBE_PRESETS:-mixtral-8x7b}"
  ./"$BUILD"/tests/gpu_test_decode --bench ${PROBE_PRESETS:-mixtral-8x7b} 2>&1 |
    tee -a "$OUT/probe.log" || rc=1
fi
# The one-kernel gemm_ar GEMMs on one GPU without their exchange, beside cuBLAS
# (bench/gemm_ar_probe.cu), once per PROBE_AB word (VAR=v[,VAR=v]) more, then Nsight Compute
# on the 128-row kernel and cuBLAS at 128 rows and on the 16-row kernel at 16. Not in all.
if case "$PARTS" in *" tpprobe "*) true;; *) false;; esac; then
  log "gemm_ar probe"
  nvcc -O3 -arch=sm_90a -std=c++17 -Isrc -Iinclude bench/gemm_ar_probe.cu "$BUILD/libmoelink.a" \
    -L"${CUDA_HOME:-/usr/local/cuda}/lib64" -lcublasLt -lcublas -o "$BUILD/gemm_ar_probe" \
    >>"$OUT/build.log" 2>&1 && ./"$BUILD"/gemm_ar_probe 2>&1 | tee -a "$OUT/tpprobe.log" || rc=1
  for v in ${PROBE_AB:-}; do
    log "gemm_ar probe, $v"
    env ${v//,/ } ./"$BUILD"/gemm_ar_probe 2>&1 | tee -a "$OUT/tpprobe.log" || rc=1
  done
  if [ -n "$NCU" ] && [ -x "$BUILD/gemm_ar_probe" ]; then
    # the 128-row kernel and cuBLAS at 128 rows, and the 16-row kernel (which streams at
    # cuBLAS's rate) at 16 rows; warp stall reasons included (--print-details all)
    for kr in "ml_gaw 128" "nvjet|cutlass|gemm|xmma 128" "ml_gar 16"; do
      set -- $kr
      log "ncu gemm_ar_probe m $2, kernels $1"
      "$NCU" --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis \
        --section WarpStateStats --section SchedulerStats --section LaunchStats \
        --print-details all -k "regex:$1" --launch-skip 2 --launch-count 1 \
        ./"$BUILD"/gemm_ar_probe 8192 4096 "$2" >>"$OUT/tpprobe.log" 2>&1 || rc=1
    done
  fi
fi
# Decode sizes as CUDA-graph replays, bf16 and FP8 experts; each AB_ENV setting (VAR=VALUE,
# space-separated) runs the bf16 case again under it, in the same process order. Not in all.
# `python3 bench/decode_ab.py $OUT` prints the runs side by side, one column a variant.
if case "$PARTS" in *" decode "*) true;; *) false;; esac; then
  for p in ${PRESETS:-mixtral-8x7b qwen3-30b-a3b deepseek-v3}; do
    for q in ${DECODE_DTYPES:-bf16 fp8}; do
      f=""; [ $q = fp8 ] && f=--fp8-experts
      # each AB_ENV word (VAR=v[,VAR=v]) right after the default, DECODE_REPS times over
      for r in $(seq "${DECODE_REPS:-1}"); do
        for ab in "" ${AB_ENV:-}; do
          log "decode $p $q (graph replay)${ab:+ with $ab}"
          env ${ab//,/ } ./"$BUILD"/moelink bench --backend cuda --preset "$p" $f --graph \
            --tokens "${DECODE_TOKENS:-1,16,128}" \
            --json "$OUT/json/decode_${p}_$q${ab:+_${ab//[^A-Za-z0-9]/_}}_$r.json" 2>&1 |
            tee -a "$OUT/decode.log" || rc=1
        done
        for j in "${!ABBINS[@]}"; do
          log "decode $p $q (graph replay) with ${ABNAMES[$j]}${AB_PATCH_R:+ reversed}"
          "${ABBINS[$j]}" bench --backend cuda --preset "$p" $f --graph \
            --tokens "${DECODE_TOKENS:-1,16,128}" \
            --json "$OUT/json/decode_${p}_${q}_abpatch$((j + 1))_$r.json" 2>&1 |
            tee -a "$OUT/decode.log" || rc=1
        done
      done
    done
  done
fi
# Prefill sizes (issue 4's T = 8192 targets): each preset eager at PREFILL_TOKENS, again under
# each PREFILL_AB word (VAR=v[,VAR=v]) in the same order, then Nsight Compute on the sm_90a
# GEMM kernels of one deepseek-v3 call at 8192 tokens (time, DRAM bytes, pipe use), once per
# PREFILL_AB word too; PREFILL_FP8=1 adds the warp stall reasons of the FP8 and bf16 gate/up
# GEMMs (mixtral-8x7b, 8192 tokens), PREFILL_SRC=1 stall samples per SASS instruction of the
# FP8 gate/up and qwen3-30b-a3b GEMMs, PREFILL_NO_DS=1 skips the deepseek-v3 ncu. Not in all.
if case "$PARTS" in *" prefill "*) true;; *) false;; esac; then
  for p in ${PRESETS:-deepseek-v3 qwen3-30b-a3b mixtral-8x7b}; do
    for v in "" ${PREFILL_AB:-}; do
      log "prefill $p${v:+ with $v}"
      env ${v//,/ } ./"$BUILD"/moelink bench --backend cuda --preset "$p" \
        --tokens "${PREFILL_TOKENS:-512,2048,8192}" \
        --json "$OUT/json/prefill_$p${v:+_${v//[^A-Za-z0-9]/_}}.json" 2>&1 |
        tee -a "$OUT/prefill.log" || rc=1
    done
  done
  if [ -n "$NCU" ] && [ -n "${PREFILL_FP8:-}" ]; then
    # PREFILL_FP8=1: the FP8 experts' gate/up GEMM of one mixtral-8x7b call at 8192 tokens,
    # every warp stall reason (where its time goes), pipe use and the memory tables (shared
    # memory wavefronts, bank conflicts, L1 and L2 traffic), beside the bf16 kernel of the same
    # call
    MWA_TABLES=""
    "$NCU" --list-sections 2>/dev/null | grep -q MemoryWorkloadAnalysis_Tables &&
      MWA_TABLES="--section MemoryWorkloadAnalysis_Tables"
    for f in --fp8-experts ""; do
      log "ncu mixtral-8x7b 8192 gate/up GEMM, stall reasons ${f:-(bf16)}"
      "$NCU" --clock-control none --section SpeedOfLight --section WarpStateStats \
        --section SchedulerStats --section InstructionStats --section ComputeWorkloadAnalysis \
        --section MemoryWorkloadAnalysis $MWA_TABLES --print-details all \
        -k 'regex:ml_sm90_kernel' --launch-count 1 \
        ./"$BUILD"/moelink bench --backend cuda --preset mixtral-8x7b $f --tokens 8192 \
        --iters 1 --warmup 0 >>"$OUT/prefill_ncu.log" 2>&1 || rc=1
    done
  fi
  if [ -n "$NCU" ] && [ -n "${PREFILL_SRC:-}" ]; then
    # PREFILL_SRC=1: warp stall samples per SASS instruction (where in the code each kernel
    # waits) of the FP8 gate/up GEMM (mixtral-8x7b) and of qwen3-30b-a3b's GEMMs, 8192 tokens;
    # the reports' source pages as CSV, packed with the JSON
    mkdir -p "$OUT/json/src"
    for c in "mixtral-8x7b --fp8-experts:1:fp8_gateup" "qwen3-30b-a3b:3:qwen3"; do
      args=${c%%:*}; rest=${c#*:}; n=${rest%%:*}; tag=${rest#*:}
      log "ncu source-level $tag"
      "$NCU" --clock-control none --section SourceCounters --section WarpStateStats \
        --section SpeedOfLight -k 'regex:ml_sm90_kernel' --launch-count "$n" -f \
        -o "$OUT/json/src/$tag" ./"$BUILD"/moelink bench --backend cuda --preset $args \
        --tokens 8192 --iters 1 --warmup 0 >>"$OUT/prefill_ncu.log" 2>&1 || rc=1
      "$NCU" -i "$OUT/json/src/$tag.ncu-rep" --page source --csv --print-source sass \
        >"$OUT/json/src/$tag.csv" 2>>"$OUT/prefill_ncu.log" &&
        "$NCU" -i "$OUT/json/src/$tag.ncu-rep" --page details >>"$OUT/prefill_ncu.log" 2>&1 ||
        "$NCU" -i "$OUT/json/src/$tag.ncu-rep" --page source --csv \
          >"$OUT/json/src/$tag.csv" 2>>"$OUT/prefill_ncu.log" &&
        "$NCU" -i "$OUT/json/src/$tag.ncu-rep" --page details >>"$OUT/prefill_ncu.log" 2>&1 || rc=1
    done
  fi
  if [ -n "$NCU" ] && [ -z "${PREFILL_NO_DS:-}" ]; then
    for v in "" ${PREFILL_AB:-}; do
      log "ncu deepseek-v3 8192 sm_90a GEMMs ${v:-(default)}"
      env ${v//,/ } "$NCU" --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis \
        --section WarpStateStats --metrics dram__bytes_read.sum,lts__t_sector_hit_rate.pct \
        -k 'regex:ml_sm90_kernel' --launch-count 4 \
        ./"$BUILD"/moelink bench --backend cuda --preset deepseek-v3 --tokens 8192 --iters 1 \
        --warmup 0 >>"$OUT/prefill_ncu.log" 2>&1 || rc=1
    done
  fi
fi
# What each part of the FP8 GEMM costs (issue 4's FP8 prefill target): the FP8 layer's sm_90a
# GEMMs (8192 tokens, PROBE_PRESETS, default mixtral-8x7b) under Nsight Compute, built as they are
# and as the moelink_probeN builds (CMake MOELINK_PROBES; gemm/sm90.cuh ML_SM90_PROBE: 1 no
# loads, 2 no promotion, 3 neither, 4 no proxy fence, 8 no epilogue stores, 16 no MMAs or
# stores of partial tiles (bf16); PROBES picks some),
# into fp8probe.log; PROBE_DTYPES (default fp8): "fp8 bf16" also the bf16 layers;
# PROBE_SECTIONS (default SpeedOfLight): the ncu sections, e.g. "SpeedOfLight MemoryWorkloadAnalysis".
# Not in all.
if case "$PARTS" in *" fp8probe "*) true;; *) false;; esac; then
  [ -n "$NCU" ] || { log "fp8probe: no Nsight Compute on this machine"; rc=1; }
  [ -n "$NCU" ] && for b in moelink ${PROBES:-moelink_probe1 moelink_probe2 moelink_probe3 moelink_probe4}; do
    [ -x "$BUILD/$b" ] || { log "fp8probe: $b not built"; rc=1; continue; }
    for p in ${PROBE_PRESETS:-mixtral-8x7b}; do
      for dt in ${PROBE_DTYPES:-fp8}; do
        log "fp8probe $b $p $dt"
        echo "== $b $p $dt" >>"$OUT/fp8probe.log"
        "$NCU" --clock-control none $(for x in ${PROBE_SECTIONS:-SpeedOfLight}; do echo --section $x; done) -k 'regex:ml_sm90_kernel' \
          ./"$BUILD"/$b bench --backend cuda $([ "$dt" = fp8 ] && echo --fp8-experts) \
          --preset "$p" --tokens 8192 --iters 1 --warmup 0 >>"$OUT/fp8probe.log" 2>&1 || rc=1
      done
    done
  done
fi
# Where a decode-size layer call spends its time, kernel by kernel: Nsight Systems over CUDA-graph
# replays (the kernels as they overlap under PDL), then Nsight Compute's duration of each kernel
# run alone. Not in all. PROFILE_PRESETS / PROFILE_TOKENS choose the cases.
if case "$PARTS" in *" profile "*) true;; *) false;; esac; then
  log "profile: nsys=${NSYS:-none} ncu=${NCU:-none}"
  mkdir -p "$OUT/json/prof"
  for p in ${PROFILE_PRESETS:-qwen3-30b-a3b mixtral-8x7b deepseek-v3}; do
    for q in bf16 fp8; do
      f=""; [ $q = fp8 ] && f=--fp8-experts
      tag=${p}_$q
      if [ -n "$NSYS" ]; then
        "$NSYS" profile -q -o "$OUT/prof_$tag" --force-overwrite true --cuda-graph-trace=node \
          ./"$BUILD"/moelink bench --backend cuda --preset "$p" $f --graph --iters 10 --warmup 2 \
          --tokens "${PROFILE_TOKENS:-1,16}" >>"$OUT/profile.log" 2>&1 &&
        "$NSYS" stats -q --report cuda_gpu_trace --format csv -o "$OUT/json/prof/nsys_$tag" \
          "$OUT/prof_$tag.nsys-rep" >>"$OUT/profile.log" 2>&1 || rc=1
        rm -f "$OUT/prof_$tag.nsys-rep" "$OUT/prof_$tag.sqlite"
      fi
      if [ -n "$NCU" ]; then
        "$NCU" --clock-control none --metrics gpu__time_duration.sum -k 'regex:^(ml_|mld_)' --csv \
          ./"$BUILD"/moelink bench --backend cuda --preset "$p" $f --iters 2 --warmup 1 \
          --tokens "${PROFILE_TOKENS:-1,16}" >"$OUT/json/prof/ncu_$tag.csv" 2>>"$OUT/profile.log" || rc=1
      fi
      log "profiled $tag"
    done
  done
fi
# Where the decode GEMMs' warps wait, instruction by instruction: Nsight Compute's sections
# (speed of light, warp states, memory, schedulers, occupancy, source counters) of the first
# NCU_DECODE_COUNT (2: gate/up, down) launches matching NCU_DECODE_KERNELS (mld_kernel) of one
# eager layer call per preset (NCU_DECODE_PRESETS, qwen3-30b-a3b) and dtype (fp8 bf16) at
# NCU_DECODE_TOKENS (16). Each report (.ncu-rep), its details page and its SASS source page
# (per-instruction stall samples, CSV, and their summary by bench/ncu_stalls.py) go into
# json/ncudecode/. Not in all.
if case "$PARTS" in *" ncudecode "*) true;; *) false;; esac; then
  if [ -z "$NCU" ]; then
    log "ncudecode: no ncu on this machine"; rc=1
  else
    mkdir -p "$OUT/json/ncudecode"
    for p in ${NCU_DECODE_PRESETS:-qwen3-30b-a3b}; do
      for q in fp8 bf16; do
        f=""; [ $q = fp8 ] && f=--fp8-experts
        rep="$OUT/json/ncudecode/${p}_$q"
        "$NCU" --clock-control none -k "regex:${NCU_DECODE_KERNELS:-mld_kernel}" \
          --launch-count "${NCU_DECODE_COUNT:-2}" --section SpeedOfLight --section WarpStateStats \
          --section MemoryWorkloadAnalysis --section SchedulerStats --section Occupancy \
          --section LaunchStats --section SourceCounters -f -o "$rep" \
          ./"$BUILD"/moelink bench --backend cuda --preset "$p" $f --iters 1 --warmup 0 \
          --tokens "${NCU_DECODE_TOKENS:-16}" >>"$OUT/ncudecode.log" 2>&1 || rc=1
        "$NCU" --import "$rep.ncu-rep" --page details >"$rep.txt" 2>>"$OUT/ncudecode.log" || rc=1
        "$NCU" --import "$rep.ncu-rep" --page source --print-source sass --csv >"$rep.sass.csv" \
          2>>"$OUT/ncudecode.log" || rc=1
        # the stall samples by reason and instruction (bench/ncu_stalls.py), readable at once
        python3 bench/ncu_stalls.py "$rep.sass.csv" --top 30 >"$rep.stalls.txt" \
          2>>"$OUT/ncudecode.log" || rc=1
        log "ncudecode $p $q: $(grep -c . "$rep.sass.csv" 2>/dev/null || echo 0) SASS lines"
      done
    done
  fi
fi
# The layer's kernels as they run back to back (bench/trace_layer.py: the PyTorch profiler's
# CUPTI trace of flush + call pairs, nvidia-smi clocks beside it). Not in all. TRACE_PRESETS,
# TRACE_TOKENS (default 8192); TRACE_AB="VAR=v[,VAR=v] ...": again under each word.
if case "$PARTS" in *" trace "*) true;; *) false;; esac; then
  python3 -c 'import torch' 2>/dev/null || { log "trace: no torch on this machine"; rc=1; TRACE_SKIP=1; }
  [ -z "${TRACE_SKIP:-}" ] && for v in "" ${TRACE_AB:-}; do
    log "trace ${TRACE_PRESETS:-deepseek-v3,qwen3-30b-a3b,mixtral-8x7b} at ${TRACE_TOKENS:-8192}${v:+ with $v}"
    env ${v//,/ } MOELINK_LIBRARY=$PWD/$BUILD/libmoelink.so PYTHONPATH=$PWD/python PYTHONUNBUFFERED=1 \
      python3 bench/trace_layer.py --preset "${TRACE_PRESETS:-deepseek-v3,qwen3-30b-a3b,mixtral-8x7b}" \
      --tokens "${TRACE_TOKENS:-8192}" --iters 10 --warmup 3 \
      --json "$OUT/json/trace${v:+_${v//[^A-Za-z0-9]/_}}.json" 2>&1 | tee -a "$OUT/trace.log" || rc=1
  done
fi
# The device tool brings back at most 8 files: pack the JSON into one, and past 7 files (a
# slot left for the caller's own) everything but summary.txt into logs.tgz.
(cd "$OUT" && tar czf json.tgz json && rm -rf json)
nfiles=$(find "$OUT" -type f | wc -l)
if [ "$nfiles" -gt 7 ]; then
  list=$(mktemp)
  (cd "$OUT" && find . -type f ! -name summary.txt ! -name logs.tgz -printf '%P\n' >"$list" &&
    tar czf logs.tgz -T "$list" && xargs -d '\n' rm -f <"$list") || rc=1
  rm -f "$list"
  log "$nfiles files: all but summary.txt packed into logs.tgz"
fi
log "done rc=$rc"
exit $rc
