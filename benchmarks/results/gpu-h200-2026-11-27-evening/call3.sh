# Third device call, run inline as one command (this text is that command, line-broken): dp-grape's audit on
# CUDA again, after call2's fresh-key run gave a lower bound of 0.0. Four fresh-key runs and secret seeds 0-3.
# The trailing wait loop matched its own command line (pgrep -f), so the call ran to its 120 s limit after the
# audits had ended; every result came back.
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .dev/whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
for s in 0 1 2 3; do
  (taskset -c $s python3 -m dpopt.cli audit --algorithm dp-grape --device cuda --json > $OUT/grape_fresh_$s.json 2>/dev/null &)
  (taskset -c $((s+4)) python3 -m dpopt.cli audit --algorithm dp-grape --device cuda --secret-seed $s --json \
    > $OUT/grape_seed_$s.json 2>/dev/null &)
done
sleep 2; wait; while pgrep -f "dpopt.cli audit" >/dev/null; do sleep 1; done
for f in $OUT/*.json; do echo "$(basename $f) $(cat $f)"; done
