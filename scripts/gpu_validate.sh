#!/usr/bin/env bash
# Everything that needs GPUs, in one go, logs under $OUT (or ./out):
#   bash scripts/gpu_validate.sh [ranks]      (default: one rank per GPU; ONLY, GPU_TESTS: below)
# Build the code objects first (python -m pyhipa2a.build) or carry pyhipa2a/_code.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
# The host's helpers (the C executor of repeated calls, XLA's handler) built for this machine's Python and
# jaxlib: code objects copied in over a build replace them, and host figures would be the Python executor's.
python3 -m pyhipa2a.build --only host > "$OUT/build_host.txt" 2>&1 || { cat "$OUT/build_host.txt"; exit 1; }
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
N=${1:-$(nvidia-smi -L 2>/dev/null | wc -l)}
# More ranks than GPUs (8 ranks on one GPU, say): ranks then share a GPU, and since the blocks of
# each rank's kernels wait on the other ranks' kernels, these must run at once. MPS=1 starts
# NVIDIA's MPS daemon for this run and stops it at the end; the default grid then leaves half the GPU free.
if [ "${MPS:-0}" = 1 ]; then
  export CUDA_MPS_PIPE_DIRECTORY=${CUDA_MPS_PIPE_DIRECTORY:-/tmp/pyhipa2a-mps} CUDA_MPS_LOG_DIRECTORY=${CUDA_MPS_LOG_DIRECTORY:-/tmp/pyhipa2a-mps-log}
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  nvidia-cuda-mps-control -d || exit 1
  trap 'echo quit | nvidia-cuda-mps-control' EXIT
fi
MPIRUN=${MPIRUN:-"mpirun --allow-run-as-root --bind-to none --mca pml ob1 --mca btl self,vader --mca btl_vader_single_copy_mechanism none"}
declare -A RESULT
# The whole run outlasts a lent machine's call (600 s) at 2 ranks; a run in parts names its steps in ONLY
# (e.g. ONLY="check check_fused pytest_gpu_2ranks") and the pytest steps' tests in GPU_TESTS (default: tests).
ONLY=${ONLY:-}; GPU_TESTS=${GPU_TESTS:-tests}
# GPU cases run in a pool of jobs (tests/mpi_harness.py): each rank pays its GPU context and imports once, not
# once a case (two H200s: the suite in about 10 minutes, pooled). A case that fails there runs again alone for
# its output; it fails either way, saying so where it passed alone (it depends on what an earlier case left).
# PYHIPA2A_TEST_POOL=0 runs every case in a job of its own.
export PYHIPA2A_TEST_POOL=${PYHIPA2A_TEST_POOL:-gpu}
step() {
  local name=$1; shift
  if [ -n "$ONLY" ] && [[ " $ONLY " != *" $name "* ]]; then return; fi
  echo "== $name: $*"; timeout 900 "$@" >"$OUT/$name.log" 2>&1; RESULT[$name]=$?; tail -n 25 "$OUT/$name.log"
}
step heap_check $MPIRUN -n "$N" python3 scripts/heap_check.py
step check $MPIRUN -n "$N" python3 scripts/check.py
step check_fused $MPIRUN -n "$N" python3 scripts/check.py --fused-expert
step check_fp8_quantize $MPIRUN -n "$N" python3 scripts/check.py --dispatch-dtype float8_e4m3 --fp8-input quantize
step check_fp8_given $MPIRUN -n "$N" python3 scripts/check.py --dispatch-dtype float8_e4m3 --fp8-input given --dtype bfloat16
# Across nodes (issue 21): the ranks as 2 simulated nodes, NCCL between them (one GPU per rank; ranks
# that share a GPU need PYHIPA2A_INTERNODE=mpi, as NCCL refuses two ranks on one GPU).
if [ "$N" -ge 2 ] && [ $((N % 2)) = 0 ]; then
  step check_nodes $MPIRUN -n "$N" python3 scripts/check.py --ranks-per-node $((N / 2))
  step check_nodes_fused $MPIRUN -n "$N" python3 scripts/check.py --ranks-per-node $((N / 2)) --fused-expert --weights-at dispatch
fi
step check_contiguous $MPIRUN -n "$N" python3 scripts/check.py --row-layout contiguous
python3 -c "import cupy" 2>/dev/null && step cupy_moe $MPIRUN -n "$N" python3 scripts/cupy_moe.py
# JAX's way to run a node: one process driving the GPUs, its ranks the devices (one rank a GPU: not under MPS)
if [ "${MPS:-0}" != 1 ] && [ "$N" -ge 2 ] && python3 -c "import jax" 2>/dev/null; then
  step jax_moe_devices env XLA_PYTHON_CLIENT_PREALLOCATE=false python3 scripts/jax_moe.py --devices "$N"
fi
step pytest_gpu_${N}ranks env PYHIPA2A_TEST_GPU_RANKS="$N" python3 -m pytest -q -m gpu $GPU_TESTS
# Stream waits (groups, the collective matmul) with every stream of a rank in one hardware queue: work queued
# behind a wait that never passes then waits too, whatever its stream, as it may where streams share queues.
step one_queue env CUDA_DEVICE_MAX_CONNECTIONS=1 PYHIPA2A_TEST_GPU_RANKS="$N" python3 -m pytest -q -m gpu \
  tests/test_groups.py tests/test_collective.py
[ "$N" -gt 1 ] && step pytest_gpu_1rank env PYHIPA2A_TEST_GPU_RANKS=1 python3 -m pytest -q -m gpu $GPU_TESTS
echo "== summary ($N ranks)"
[ "${#RESULT[@]}" -gt 0 ] || { echo "no step ran (ONLY=\"$ONLY\" names none)"; exit 1; }
rc=0; for k in "${!RESULT[@]}"; do printf '%-22s %s\n' "$k" "$([ "${RESULT[$k]}" = 0 ] && echo PASS || echo "FAIL (${RESULT[$k]})")"; [ "${RESULT[$k]}" = 0 ] || rc=1; done
exit $rc
