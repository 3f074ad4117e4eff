# Second device call (about 90 s): `dpopt audit --device cuda` for every recipe whose canary setup runs on the
# device (DiracRows, ProjectedDirac: the noise drawn by CUDA's generator), default flags (fresh OS-entropy keys),
# one core each, all at once. Carry: .dev (.dev/whl: wheels the image lacks).
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .dev/whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
i=0
for a in dp-sgd dp-adam dp-adamw disk-sgd disk-adam disk-adamw dp-grape dp-galore disk-grape; do
  { r=$(taskset -c $i timeout 200 python3 -m dpopt.cli audit --algorithm $a --device cuda --json 2>$OUT/$a.err)
    echo "{\"algorithm\": \"$a\", \"device\": \"cuda\", \"result\": ${r:-null}}" > $OUT/$a.line; } &
  i=$((i + 1))
done
wait
cat $OUT/*.line > $OUT/audit_cuda.jsonl; tail -n 3 $OUT/*.err > $OUT/audit_cuda.err.txt; rm -f $OUT/*.line $OUT/*.err
echo "done at ${SECONDS}s"; cat $OUT/audit_cuda.jsonl
