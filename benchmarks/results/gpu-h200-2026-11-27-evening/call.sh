# One device call (about 470 s): the whole suite with a GPU present (cores 0-10: the NCCL fix of 2026-11-27 and
# amplified BandMF had not run there), and five training runs on CUDA (cores 11-15, sharing the GPU): dp-ftrl on
# the ViT at batch 512 and 1024 (its fixed-order miss at batch 128), dp-srg-memf on the ViT at its amplified default,
# and the README's dp-memf and dp-sgd CNN commands. Carry: .dev (.dev/whl: wheels the image lacks; .dev/data/mnist).
set -u
export PYTHONUNBUFFERED=1 DPOPT_DATA=$PWD/.dev/data HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .dev/whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
W=$OUT/work; mkdir -p $W
{ date; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc
  python3 -c "import torch,transformers,peft,opacus,dp_accounting;print(torch.__version__,transformers.__version__,
peft.__version__,opacus.__version__,torch.cuda.is_available(),torch.cuda.nccl.version())"; } > $OUT/env.txt 2>&1
END=${END:-450}  # seconds after start at which everything stops
taskset -c 0-10 timeout $((END - 15)) python3 -m pytest -p no:cacheprovider -q -n 11 -rfs --tb=short \
  --durations=15 tests > $OUT/suite.log 2>&1 &
SUITE=$!
T="python3 -m dpopt.cli train --epsilon 2 --device cuda --no-progress --secret-seed 0 --dataset mnist"
run() { local core=$1 name=$2; shift 2
  taskset -c $core timeout $((END - SECONDS)) $T "$@" --out $W/$name > $W/$name.out 2>&1 & }
run 11 vit-dp-ftrl-b512 --algorithm dp-ftrl --model vit-tiny --batch-size 512
run 12 vit-dp-ftrl-b1024 --algorithm dp-ftrl --model vit-tiny --batch-size 1024
run 13 vit-dp-srg-memf --algorithm dp-srg-memf --model vit-tiny
run 14 cnn-dp-memf --algorithm dp-memf --model cnn
run 15 cnn-dp-sgd --algorithm dp-sgd --model cnn
wait $SUITE; echo "rc=$? at ${SECONDS}s" >> $OUT/suite.log
wait
nvidia-smi > $W/nvidia-smi.txt 2>&1
tar czf $OUT/work.tgz --exclude='*.pt' --exclude=model --exclude=tensorboard -C $W .
rm -rf $W
ls -la $OUT
