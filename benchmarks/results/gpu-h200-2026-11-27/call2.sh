# Second device call: the fixes for call 1's three failures, re-run with the GPU present; and the backend string
# that init_process_group() with no backend gives on a CUDA machine.
set -u
export PYTHONUNBUFFERED=1 DPOPT_DATA=$PWD/.dev/data HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .dev/whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
python3 -c "
import tempfile, torch.distributed as d
d.init_process_group(init_method='file://' + tempfile.mktemp(), rank=0, world_size=1)
print('init_process_group() with no backend:', repr(d.get_backend()))" > $OUT/backend.txt 2>&1
timeout 150 python3 -m pytest -p no:cacheprovider -q -n 8 -rfs --tb=short --durations=8 tests/test_distributed.py \
  tests/test_crash_safety.py tests/test_own_model_data.py tests/test_device_precision.py > $OUT/suite2.log 2>&1
echo "rc=$? at ${SECONDS}s" >> $OUT/suite2.log
