# One device call: CUDA tests, the suite with a GPU present, mnist/cnn default runs on cuda, dpopt bench on cuda.
set -u
PY=${PY:-python3}; DEV=${DEV:-cuda}; T=${T:-1}
export PYTHONUNBUFFERED=1 DPOPT_DATA=$PWD/.dev/data HF_HUB_OFFLINE=1
if [ "$DEV" = cuda ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .dev/whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
{ date; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc
  $PY -c "import torch,transformers,peft,opacus,dp_accounting;print(torch.__version__,transformers.__version__,peft.__version__,opacus.__version__,torch.cuda.is_available())"; } > $OUT/env.txt 2>&1
mkdir -p $OUT/m
for r in ${RECIPES:-disk-sgd disk-adamw accel-dp-srgd dp-sgd}; do
  timeout $((240*T)) $PY -m dpopt.cli reproduce defaults_matrix --recipes $r --pairs ${PAIR:-mnist/cnn} --device $DEV --out $OUT/m >> $OUT/train.log 2>&1 &
done
timeout $((100*T)) $PY -m pytest -p no:cacheprovider -q -rs tests/test_device_precision.py > $OUT/tests_device.log 2>&1
echo "rc=$? $(date)" >> $OUT/tests_device.log
timeout $((110*T)) $PY -m pytest -p no:cacheprovider -v --tb=line -n 10 -rf --ignore=tests/test_device_precision.py ${SUITE:-tests} > $OUT/suite.log 2>&1
echo "rc=$? $(date)" >> $OUT/suite.log
wait; echo "training done $(date)" >> $OUT/train.log
B="$PY -m dpopt.cli bench --device $DEV --no-interleave --threads 1"
{ date; timeout $((200*T)) $B --suite ${BSTEPS:-}
  date; timeout $((45*T)) $B --precision bf16 --workload bert --batch 64 --systems pytorch dpopt ${BSTEPS:-}
  date; timeout $((40*T)) $B --workload bert --batch 256 --systems pytorch dpopt ${BSTEPS:-}
  date; timeout $((30*T)) $B --workload bert --batch 256 --physical-batch-size 32 --systems dpopt ${BSTEPS:-}
  date; } > $OUT/bench.log 2>&1
ls -R $OUT
