#!/usr/bin/env bash
# The one command a GPU machine runs: benchmarks/gpu_check.sh OUTDIR
#
# Installs ddpkit onto that machine's torch without dependencies (nothing is downloaded), then writes into OUTDIR:
#   env.txt          nvidia-smi, torch, CUDA and NCCL versions, cores
#   gloo_cuda.json   which of gloo's collectives accept CUDA tensors in this torch (benchmarks/gloo_cuda_probe.py)
#   cuda_tests.log   pytest -m cuda (tests/cuda, on CUDA tensors; junit XML in cuda_tests.xml)
#   gpu.json/.png    benchmarks/bench_gpu.py: DDP, torch ZeRO, FSDP2, ddpkit OSS+DDP and OSS+SDP on the GPU(s)
#   sharding.json/.png, sharding.log   the CPU scaling table (bench_sharding at 2, 4 and 8 ranks)
#   summary.txt      each stage's exit status and seconds
#   all.tar.gz       all of the above in one file
# Each stage has its own time limit, so the whole check ends within 9 minutes, whatever hangs.
# To check the script itself on a machine without a GPU: GPU_CHECK_SKIP_INSTALL=1 GPU_CHECK_QUICK=1 (no install into
# the running Python; the benchmarks at smoke size).
set -u
OUT=${1:?usage: benchmarks/gpu_check.sh OUTDIR}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
QUICK=()
[ "${GPU_CHECK_QUICK:-0}" = 1 ] && QUICK=(--quick)
: >"$OUT/summary.txt"

stage() { # stage NAME SECONDS COMMAND...: runs COMMAND with a time limit, logs its status and duration
    local name=$1 limit=$2 start=$SECONDS status
    shift 2
    timeout --kill-after=10 "$limit" "$@"
    status=$?
    echo "$name: exit $status after $((SECONDS - start)) s (limit $limit s)" | tee -a "$OUT/summary.txt"
}

{
    nvidia-smi || echo "nvidia-smi: not available"
    nproc
    $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count(),
[torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())], 'nccl',
torch.cuda.nccl.version() if torch.cuda.is_available() else None)"
} >"$OUT/env.txt" 2>&1

if [ "${GPU_CHECK_SKIP_INSTALL:-0}" != 1 ]; then
    stage install 45 $PY -m pip install --no-deps --no-build-isolation -e . >"$OUT/pip.log" 2>&1
fi
stage gloo_probe 60 $PY -m benchmarks.gloo_cuda_probe "$OUT/gloo_cuda.json" >"$OUT/gloo_probe.log" 2>&1
PARALLEL=()  # the test files in parallel, each in one worker (its own pools of ranks), where pytest-xdist is there
$PY -c "import xdist" 2>/dev/null && PARALLEL=(-n 4 --dist loadfile)
stage cuda_tests 170 $PY -m pytest -m cuda tests "${PARALLEL[@]}" -q -ra -p no:cacheprovider --timeout 150 \
    --junitxml "$OUT/cuda_tests.xml" >"$OUT/cuda_tests.log" 2>&1
stage bench_gpu 150 $PY -m benchmarks gpu "${QUICK[@]}" --out "$OUT" >"$OUT/bench_gpu.log" 2>&1
stage cpu_scaling 100 $PY -m benchmarks sharding --world-size 2,4,8 --strategies ddp,zero,oss_ddp,oss_sdp,oss_sdp_sockets \
    --rounds 1 --steps 8 --warmup 2 --reuse-processes "${QUICK[@]}" --out "$OUT" >"$OUT/sharding.log" 2>&1
grep -E "passed|failed|error|skipped" "$OUT/cuda_tests.log" | tail -1 | sed 's/^/cuda tests: /' >>"$OUT/summary.txt"
cat "$OUT/summary.txt"
tar czf /tmp/gpu_check_all.tar.gz -C "$OUT" . && mv /tmp/gpu_check_all.tar.gz "$OUT/all.tar.gz"
