# The second device call (the session's last 5 minutes of device time): the whole suite with a GPU present, 16 cores.
set -u
export PYTHONUNBUFFERED=1 DPOPT_DATA=$PWD/.dev/data HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .dev/whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
timeout 170 python3 -m pytest -p no:cacheprovider -q -n 16 -rfs --tb=short --durations=10 tests > $OUT/suite2.log 2>&1
echo "rc=$? at ${SECONDS}s" >> $OUT/suite2.log
