"""A recipe at its defaults (or given hyper-parameters) on the saved features of saved_features.py: `python
standin.py dp-sgd accel-dp-srgd` (secret seed 0, epsilon 2); output: standin.txt."""
import sys, json, time, torch
torch.set_num_threads(1)
from dpopt.run import TrainConfig, train
from dpopt.algorithms import hyperparameters_for
def run(alg, seed=0, **hp):
    t = time.process_time()
    kw = dict(algorithm=alg, dataset="/tmp/sw/rt_mean", model="logreg", epsilon=2.0, secret_seed=seed)
    if hp: kw["hyperparameters"] = hyperparameters_for(alg, **hp)
    m = train(TrainConfig(**kw), progress=False, log=lambda _: None)
    r = dict(alg=alg, seed=seed, **hp, acc=round(100*m["test_accuracy"], 2), eps=round(m["epsilon"], 3), steps=m["steps"], cpu=round(time.process_time()-t,1))
    print(json.dumps(r), flush=True)
    return r
if __name__ == "__main__":
    for spec in sys.argv[1:]:
        alg, *kv = spec.split(",")
        hp = {k: float(v) for k, v in (x.split("=") for x in kv)}
        seed = int(hp.pop("seed", 0))
        run(alg, seed, **hp)
