# One prepared device call (about 8 minutes) for the GPU targets of docs/performance.md: the private step's time and
# peak memory against the non-private step and Opacus at the shapes people train on, and the largest language model
# per method. Run it from the repository root on a CUDA machine:
#
#   pip download --no-deps -d .whl dp-accounting dm-tree     # here, once: wheels a bare device image lacks
#   OUT=/some/folder bash benchmarks/gpu_check.sh            # there (carry .whl); results land in $OUT
#
# Every command has its own timeout, so one slow or failing line costs its own row only. END (seconds, default 480)
# bounds the whole call.
set -u
END=${END:-480}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
{ date; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; git log -1 --format=%h 2>/dev/null
  python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.is_available())"
} > "$OUT/env.txt" 2>&1
left() { echo $((END - SECONDS)); }
B="python3 -m dpopt.cli bench --device cuda --no-interleave --threads 1 --json"
run() {  # run NAME SECONDS ARGS...: one bench line, its JSON in $OUT/NAME.json, its log in $OUT/NAME.log
  local name=$1 limit=$2; shift 2
  [ "$(left)" -gt 20 ] || { echo "$name: no time left" >> "$OUT/skipped.txt"; return; }
  [ "$limit" -lt "$(left)" ] || limit=$(left)
  timeout "$limit" $B "$@" > "$OUT/$name.json" 2> "$OUT/$name.log"
  echo "$name rc=$? at ${SECONDS}s" >> "$OUT/done.txt"
}
# the step-time targets: BERT-base b32 s128 and GPT-2 small (tied head) b16 s512 in bf16; the Tanh CNN at b256, b1024
run bert-base-b32-s128-bf16 90 --workload bert-base --batch 32 --seq 128 --precision bf16 --systems pytorch dpopt opacus-ghost
run gpt2-b16-s512-bf16 90 --workload gpt2 --batch 16 --seq 512 --precision bf16 --systems pytorch dpopt
run cnn-b256 60 --workload cnn --batch 256 --systems pytorch dpopt opacus-hooks opacus-ghost
run cnn-b1024 60 --workload cnn --batch 1024 --systems pytorch dpopt opacus-hooks opacus-ghost
run bert-b32-s64 60 --workload bert --batch 32 --systems pytorch dpopt opacus-hooks opacus-ghost
# the captured step (--graph on): its CUDA tests first (a replay equals the eager step), then the same rows replayed
[ "$(left)" -gt 60 ] && { timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_graphs.py -k cuda \
  > "$OUT/graph_tests.log" 2>&1; echo "graph_tests rc=$? at ${SECONDS}s" >> "$OUT/done.txt"; }
run cnn-b256-graph 60 --workload cnn --batch 256 --systems pytorch dpopt --graph on
run cnn-b1024-graph 60 --workload cnn --batch 1024 --systems pytorch dpopt --graph on
run bert-base-b32-s128-bf16-graph 90 --workload bert-base --batch 32 --seq 128 --precision bf16 --systems pytorch dpopt --graph on
# the largest model per method (one process per size and method; a method that fails at one size stops there)
if [ "$(left)" -gt 60 ]; then
  timeout "$(left)" python3 -m dpopt.cli reproduce large_models --device cuda \
    --sizes opt-1.3b opt-6.7b opt-13b opt-30b --methods inference dpzero dp-grape dpopt pytorch --steps 2 \
    --out "$OUT/large_models" > "$OUT/large_models.log" 2>&1
  echo "large_models rc=$? at ${SECONDS}s" >> "$OUT/done.txt"
fi
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
