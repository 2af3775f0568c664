#!/usr/bin/env bash
# Every GPU figure for one world size in one go (issue-style report): the
# validation of scripts/gpu_validate.sh, then the benchmark shapes, the sweep
# and the stress run; logs and JSON under $OUT (or ./out), tables last.
#   bash scripts/gpu_all.sh [ranks]      (default: one rank per GPU)
# Build the code objects first (python -m pyhipa2a.build) or carry pyhipa2a/_code (the host's helpers
# are built here).
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-out}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
N=${1:-$(nvidia-smi -L 2>/dev/null | wc -l)}
MPIRUN=${MPIRUN:-"mpirun --allow-run-as-root --bind-to none --mca pml ob1 --mca btl self,vader --mca btl_vader_single_copy_mechanism none"}
# In parts (a lent machine's call lasts 600 s): gpu_validate.sh's own parts first, then VALIDATE=0 here.
if [ "${VALIDATE:-1}" = 0 ]; then
  rm -f "$OUT/validate.txt"  # (an earlier part's: its steps are in its own table)
  python3 -m pyhipa2a.build --only host > "$OUT/build_host.txt" 2>&1; validate=$?
else
  bash scripts/gpu_validate.sh "$N" > "$OUT/validate.txt" 2>&1; validate=$?
fi
timeout 600 $MPIRUN -n "$N" python3 scripts/bench.py --json "$OUT/bench.json" > "$OUT/bench.txt" 2>&1; bench=$?
timeout 600 $MPIRUN -n "$N" python3 scripts/bench.py --fused-expert --json "$OUT/bench_fused.json" > "$OUT/bench_fused.txt" 2>&1
fused=$?
timeout 600 $MPIRUN -n "$N" python3 scripts/bench.py --sweep --json "$OUT/sweep.json" > "$OUT/sweep.txt" 2>&1; sweep=$?
timeout 600 $MPIRUN -n "$N" python3 scripts/stress.py --calls 2000 > "$OUT/stress.txt" 2>&1; stress=$?
nodes=0  # across nodes (issue 21): 2 simulated nodes, each call beside a bare NCCL exchange of its bytes
if [ "$N" -ge 2 ] && [ $((N % 2)) = 0 ]; then
  PYHIPA2A_RANKS_PER_NODE=$((N / 2)) timeout 600 $MPIRUN -n "$N" python3 scripts/bench.py --fused-expert \
    --json "$OUT/bench_nodes.json" > "$OUT/bench_nodes.txt" 2>&1; nodes=$?
fi
# The MoE layer at prefill sizes (issue 57): DeepSeek-V3's E = 256, k = 8, H = 7168, in sequence and
# overlapped by groups, at 1024 and 4096 tokens a rank (and at 128, where overlap must cost nothing);
# and the exchange alone in both layouts.
layer=0
if [ $((256 % N)) = 0 ]; then
  timeout 600 $MPIRUN -n "$N" python3 scripts/moe_layer.py --tokens 128 --experts-per-rank $((256 / N)) \
    --json "$OUT/moe_layer_128.json" > "$OUT/moe_layer_128.txt" 2>&1 || layer=1
  for T in 1024 4096; do
    timeout 600 $MPIRUN -n "$N" python3 scripts/moe_layer.py --tokens "$T" --experts-per-rank $((256 / N)) \
      --json "$OUT/moe_layer_$T.json" > "$OUT/moe_layer_$T.txt" 2>&1 || layer=1
    for rows in packed contiguous; do
      timeout 600 $MPIRUN -n "$N" python3 scripts/bench.py --fused-expert --shape "256,8,7168,$T" --iters 20 \
        --row-layout "$rows" --json "$OUT/prefill_${rows}_$T.json" > "$OUT/prefill_${rows}_$T.txt" 2>&1 || layer=1
    done
    # fp8 dispatch (the fake expert as a kernel: a fused one reads expert_x as 16-bit expert_y)
    timeout 600 $MPIRUN -n "$N" python3 scripts/bench.py --dispatch-dtype float8_e4m3 --shape "256,8,7168,$T" \
      --iters 20 --json "$OUT/prefill_fp8_$T.json" > "$OUT/prefill_fp8_$T.txt" 2>&1 || layer=1
  done
  # What bounds those calls (docs/PREFILL.md, "Bandwidth at prefill sizes"): each stage's time, waiting
  # against moving data, summed over warps, at 4096 tokens a rank (the profiling build's timelines)
  timeout 300 $MPIRUN -n "$N" python3 scripts/trace.py --shape 256,8,7168,4096 --tokens 4096 --iters 1 \
    --out "$OUT/trace_prefill_4096.json" > "$OUT/trace_prefill_4096.txt" 2>&1 || layer=1
fi
# What one NVLink pair moves by peer loads and by peer stores, by grid and item size, and what a release
# flag a chunk costs (docs/PREFILL.md, "Bandwidth at prefill sizes"): CUDA, two GPUs or more
link=0
if [ "$N" -ge 2 ] && command -v nvcc > /dev/null; then
  { nvcc -O3 -arch=native -o "$OUT/link_probe" scripts/link_probe.cu && timeout 300 "$OUT/link_probe"; } \
    > "$OUT/link_probe.txt" 2>&1 || link=1
fi
sed -n '/^== summary/,$p' "$OUT/validate.txt" 2>/dev/null
tail -n 3 "$OUT/stress.txt"
sed -n '/^pyhipa2a bench/,$p' "$OUT/bench.txt"
sed -n '/^shape /,$p' "$OUT/bench_fused.txt"
sed -n '/^sweep /,$p' "$OUT/sweep.txt"
sed -n '/^shape /,$p' "$OUT/bench_nodes.txt" 2>/dev/null
grep -h "^moe_layer: .* ranks" "$OUT"/moe_layer_*.txt 2>/dev/null
for f in "$OUT"/prefill_*.txt; do [ -e "$f" ] && echo "$(basename "$f" .txt): $(grep -E "^E=256" "$f")"; done
sed -n '/^per stage, summed/,/^combine.warp/p' "$OUT/trace_prefill_4096.txt" 2>/dev/null
cat "$OUT/link_probe.txt" 2>/dev/null
printf '%-12s %s\n' validate "$validate" bench "$bench" bench_fused "$fused" sweep "$sweep" stress "$stress" \
  bench_nodes "$nodes" prefill "$layer" link_probe "$link"
[ "$validate$bench$fused$sweep$stress$nodes$layer$link" = 00000000 ]
