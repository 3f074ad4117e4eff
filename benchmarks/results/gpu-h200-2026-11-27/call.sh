# One device call (about 520 s): the whole suite with a GPU present (12 cores), dpopt bench on CUDA after the
# accelerator chunk budget (2 other cores), then ViT-tiny runs on CUDA until the end (4 cores). Carry: .dev
# (.dev/whl: wheels the image lacks; .dev/data/mnist). Everything comes back as at most 8 files.
set -u
export PYTHONUNBUFFERED=1 DPOPT_DATA=$PWD/.dev/data HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .dev/whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
W=$OUT/work; mkdir -p $W
{ date; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc
  python3 -c "import torch,transformers,peft,opacus,dp_accounting;print(torch.__version__,transformers.__version__,
peft.__version__,opacus.__version__,torch.cuda.is_available(),torch.cuda.nccl.version())"; } > $OUT/env.txt 2>&1
END=${END:-500}  # seconds after start at which everything stops
taskset -c 0-11 timeout $((END - 20)) python3 -m pytest -p no:cacheprovider -q -n 12 -rfs --tb=short \
  --durations=20 tests > $OUT/suite.log 2>&1 &
SUITE=$!
B="taskset -c 12-13 python3 -m dpopt.cli bench --device cuda --no-interleave --threads 1"
{ for w in "cnn --batch 256" "cnn --batch 1024" "bert --batch 64"; do
    date; timeout 90 $B --workload $w --systems pytorch dpopt opacus-hooks opacus-ghost; done
  date; } > $OUT/bench.log 2>&1
i=0
for r in dp-sgd disk-adamw accel-dp-srgd dp-srg-memf; do
  taskset -c $((12 + i)) timeout $((END - SECONDS)) python3 -m dpopt.cli train --algorithm $r --dataset mnist \
    --model vit-tiny --epsilon 2 --device cuda --no-progress --out $W/vit-$r > $W/vit-$r.out 2>&1 &
  i=$((i + 1))
done
wait $SUITE; echo "rc=$? at ${SECONDS}s" >> $OUT/suite.log
wait
nvidia-smi > $W/nvidia-smi.txt 2>&1
tar czf $OUT/work.tgz --exclude='*.pt' --exclude=model --exclude=tensorboard -C $W .
rm -rf $W
ls -la $OUT
