"""Data-parallel DP: W local gloo processes against one process at the same seeds (and secret seed: the
comparison needs replayable noise), per recipe.

Each configuration is trained once in this process and once split over ``--nproc`` processes
(``dpopt.distributed.launch``, as ``dpopt train --nproc``). Reported: the largest parameter difference
(absolute, and relative to the parameter's largest entry), whether epsilon and the ledger are identical,
and both runs' test accuracy. Only the summation order differs between the two, so the differences are
floating-point rounding, carried through training.

Then a crash check through the CLI: ``dpopt train --nproc 2 --checkpoint-every 2`` is started, one of its
worker processes is SIGKILLed once a checkpoint at step >= 8 exists, the run is resumed with
``dpopt train --resume DIR --nproc 2``, and the result is compared with the same run in one process.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from dpopt.algorithms import SGD, Adam, DiSKAdam, Projection
from dpopt.checkpoint import load_checkpoint
from dpopt.distributed import DataParallel, launch
from dpopt.run import TrainConfig, train

ROOT = Path(__file__).resolve().parents[1]
RECIPES = {
    "dp-sgd": dict(algorithm="dp-sgd", hyperparameters=SGD(lr=0.5, momentum=0.9)),
    "dp-adam": dict(algorithm="dp-adam", hyperparameters=Adam(lr=0.01)),
    "disk-adam": dict(algorithm="disk-adam", hyperparameters=DiSKAdam(lr=0.01)),
    "dp-grape": dict(algorithm="dp-grape", hyperparameters=Projection(lr=0.01, rank=16)),
    "dp-galore": dict(algorithm="dp-galore", hyperparameters=Projection(lr=0.01, rank=16, subspace_every=10)),
    "dp-adam-shuffle": dict(algorithm="dp-adam", sampling="shuffle", hyperparameters=Adam(lr=0.01)),
}


def _silent(_: str) -> None:
    pass


def _all(parallel: DataParallel, configs: dict[str, TrainConfig], work: Path) -> None:
    for name, config in configs.items():
        train(config, work / f"{name}-parallel", progress=False, log=_silent, parallel=parallel)


def crash_check(work: Path, nproc: int) -> dict:
    """Kill one worker of a CLI data-parallel run, resume it in parallel, compare with one process."""
    flags = ["--model", "logreg", "--epochs", "2", "--noise-multiplier", "1", "--algorithm", "dp-adam", "--lr",
             "0.01", "--checkpoint-every", "2", "--secret-seed", "0", "--no-progress"]
    cli = [sys.executable, "-m", "dpopt.cli", "train"]
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    single, folder = work / "crash-single", work / "crash-parallel"
    subprocess.run(cli + flags + ["--out", str(single)], env=env, cwd=ROOT, check=True, capture_output=True)
    run = subprocess.Popen(cli + flags + ["--nproc", str(nproc), "--out", str(folder)], env=env, cwd=ROOT,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while not (folder / "checkpoint.pt").exists() or load_checkpoint(folder)["step"] < 8:
        time.sleep(0.01)
    children = subprocess.run(["ps", "-o", "pid=,args=", "--ppid", str(run.pid)], capture_output=True,
                              text=True).stdout.splitlines()
    workers = [int(line.split()[0]) for line in children if "spawn_main" in line]
    os.kill(workers[0], signal.SIGKILL)
    code = run.wait(timeout=300)
    step = load_checkpoint(folder)["step"]
    resumed = subprocess.run(cli + ["--resume", str(folder), "--nproc", str(nproc), "--no-progress"], env=env,
                             cwd=ROOT, capture_output=True)
    x, y = load_checkpoint(single), load_checkpoint(folder)
    ex, ey = (json.loads((f / "metrics.json").read_text())["epsilon"] for f in (single, folder))
    return {"killed_worker_exit_code": code, "checkpoint_step_after_kill": step,
            "resume_exit_code": resumed.returncode,
            "max_abs_parameter_difference": max(float((x["model"][k] - y["model"][k]).abs().max()) for k in x["model"]),
            "epsilon_single": ex, "epsilon_parallel_resumed": ey, "ledger_identical": x["ledger"] == y["ledger"],
            "steps": y["step"]}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="dpopt reproduce data_parallel", description=__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=list(RECIPES))
    p.add_argument("--work", default="runs/data_parallel")
    p.add_argument("--out", default=str(ROOT / "experiments/results/reliability/data_parallel.json"))
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    work = Path(a.work).resolve()
    configs = {n: TrainConfig(dataset="digits", model="mlp", epochs=a.epochs, epsilon=2.0, seed=0, secret_seed=0,
                           **RECIPES[n])
               for n in a.recipes}
    launch(a.nproc, _all, configs, work)
    rows = []
    for name, config in configs.items():
        single = train(config, work / f"{name}-single", progress=False, log=_silent)
        parallel = json.loads((work / f"{name}-parallel" / "metrics.json").read_text())
        x, y = (load_checkpoint(work / f"{name}-{k}")["model"] for k in ("single", "parallel"))
        rows.append({
            "recipe": name, "nproc": a.nproc, "steps": single["steps"],
            "max_abs_parameter_difference": max(float((x[k] - y[k]).abs().max()) for k in x),
            "max_relative_parameter_difference": max(float((x[k] - y[k]).abs().max() / x[k].abs().max()) for k in x),
            "epsilon_single": single["epsilon"], "epsilon_parallel": parallel["epsilon"],
            "epsilon_identical": single["epsilon"] == parallel["epsilon"],
            "ledger_identical": single["ledger"] == parallel["ledger"],
            "test_accuracy_single": single["test_accuracy"], "test_accuracy_parallel": parallel["test_accuracy"],
        })
        print(json.dumps(rows[-1]))
    crash = crash_check(work, a.nproc)
    print(json.dumps(crash))
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"argv": argv, "rows": rows, "crash_check": crash}, indent=1))
    return 0 if all(r["epsilon_identical"] and r["ledger_identical"] for r in rows) and crash["ledger_identical"] else 1
