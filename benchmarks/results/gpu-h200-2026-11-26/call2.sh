set -u
export PYTHONUNBUFFERED=1 DPOPT_DATA=$PWD/.dev/data HF_HUB_OFFLINE=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .dev/whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
timeout 40 python3 .dev/prof.py dpopt cnn 1024 cuda > $OUT/prof.log 2>&1
B="python3 -m dpopt.cli bench --device cuda --no-interleave --threads 1"
{ date; timeout 40 $B --workload cnn --batch 1024 --systems pytorch dpopt dpopt-materialize
  date; timeout 55 $B --workload bert --batch 64 --seq 64 --systems pytorch dpopt opacus-hooks opacus-ghost
  date; } > $OUT/bench2.log 2>&1
timeout $((185 - SECONDS)) python3 -m pytest -p no:cacheprovider -rf --tb=line -n 15 tests --ignore=tests/test_device_precision.py > $OUT/suite.log 2>&1
echo "rc=$? $SECONDS s" >> $OUT/suite.log
