"""Crash safety: SIGKILL training runs at random instants, resume each, compare with uninterrupted runs.

For each configuration (algorithm, N) an uninterrupted reference run is made (``dpopt train ... --out
REF``). Then each trial starts the same run (``--checkpoint-every N``, N cycling through ``--every``), waits
for its first checkpoint, kills it with SIGKILL and resumes it (``dpopt train --resume DIR``) to the end.
``--kills`` trials kill after a delay drawn uniformly from the time the reference of the same configuration
took from its first to its last checkpoint (so kills land anywhere in training); ``--write-kills`` further
trials kill the moment the run's temporary checkpoint file appears, after a random number of checkpoints
(kills aimed at a write).
While any run is alive its checkpoint file is read whenever it changes (a concurrent reader sees each
atomic replace). Checked:

* every checkpoint ever read, and the one a kill leaves, loads and is consistent: the ledger's steps equal
  the checkpoint's step and the optimizer's step count (a step is never lost or counted twice);
* each resumed run ends with the reference's epsilon, ledger, per-epoch history and (bitwise) parameters;
* a kill that cut a checkpoint write (its temporary file is left behind) never damaged the checkpoint.

Every process runs with one thread (bitwise equality assumes the same thread count and the same machine).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

from dpopt.checkpoint import CHECKPOINT
from dpopt.privacy import PrivacyLedger

ROOT = Path(__file__).resolve().parents[1]
ALGORITHMS = {  # name -> extra flags; chosen to cover optimizer, transform and projection state
    "dp-sgd": ["--lr", "0.5", "--momentum", "0.9"],
    "dp-adam": ["--lr", "0.01"],
    "disk-adam": ["--lr", "0.01"],
    "dp-grape": ["--lr", "0.01", "--rank", "16", "--subspace-every", "7"],
}


def consistency_problem(state: dict[str, Any]) -> str | None:
    """Why a checkpoint is inconsistent (ledger vs step counts), or None."""
    ledger_steps = PrivacyLedger.from_dict(state["ledger"]).steps
    if not ledger_steps == state["step"] == state["optimizer"]["steps"]:
        return (f"ledger {ledger_steps} releases, checkpoint step {state['step']}, "
                f"optimizer step {state['optimizer']['steps']}")
    return None


class CheckpointWatch:
    """Reads a run folder's checkpoint every time it is replaced and records any problem."""

    def __init__(self, folder: Path) -> None:
        self.path, self.seen, self.problems = folder / CHECKPOINT, 0, []
        self.key: tuple[int, int] | None = None

    def poll(self) -> None:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return
        if (st.st_ino, st.st_mtime_ns) == self.key:
            return
        self.key = (st.st_ino, st.st_mtime_ns)
        try:
            state = torch.load(self.path, map_location="cpu", weights_only=True)
        except FileNotFoundError:  # replaced between stat and open: the next poll reads the new one
            self.key = None
            return
        except Exception as e:
            self.problems.append(f"unreadable checkpoint: {type(e).__name__}: {e}")
            return
        self.seen += 1
        if problem := consistency_problem(state):
            self.problems.append(problem)


def alive(proc: Any) -> bool:
    return proc.poll() is None if hasattr(proc, "poll") else proc.is_alive()


def reap(proc: Any) -> int:
    return proc.wait() if hasattr(proc, "wait") else (proc.join(), proc.exitcode)[1]


def watch(proc: Any, folder: Path, kill_after_first: float | None = None,
          kill_in_write_after: int | None = None) -> dict[str, Any]:
    """Follow ``proc`` until it ends; or SIGKILL it ``kill_after_first`` seconds after its first checkpoint
    was read, or the moment its temporary checkpoint file is seen once ``kill_in_write_after`` checkpoints
    were read (a kill aimed at a write). Returns what was seen."""
    w = CheckpointWatch(folder)
    temp = folder / f".{CHECKPOINT}.{proc.pid}.tmp"
    started, first, last, killed = time.perf_counter(), None, None, False
    while alive(proc):
        seen = w.seen
        w.poll()
        now = time.perf_counter()
        if w.seen > seen:
            first, last = first or now, now
        if (kill_after_first is not None and first is not None and now - first >= kill_after_first) or (
                kill_in_write_after is not None and w.seen >= kill_in_write_after and temp.exists()):
            os.kill(proc.pid, signal.SIGKILL)
            killed = True
            break
        if kill_in_write_after is None or w.seen < kill_in_write_after:
            time.sleep(0.005)  # aiming at a write: poll without pause
    code = reap(proc)
    w.poll()
    return {"returncode": code, "killed": killed, "checkpoints_read": w.seen, "problems": w.problems,
            "wall_s": time.perf_counter() - started,
            "first_to_last_checkpoint_s": None if first is None else last - first}


def after_kill(folder: Path) -> dict[str, Any]:
    """The state a kill left behind: a readable, consistent checkpoint, and whether a write was cut."""
    left = sorted(p.name for p in folder.glob(f".{CHECKPOINT}.*.tmp"))
    try:
        state = torch.load(folder / CHECKPOINT, map_location="cpu", weights_only=True)
    except Exception as e:
        return {"checkpoint_ok": False, "problem": f"{type(e).__name__}: {e}", "temp_files_left": left}
    return {"checkpoint_ok": consistency_problem(state) is None, "problem": consistency_problem(state),
            "step_at_kill": state["step"], "temp_files_left": left}


def same_run(folder: Path, reference: Path) -> dict[str, Any]:
    """Compare a finished run with the reference: parameters bitwise, epsilon, ledger, history."""
    a = torch.load(folder / CHECKPOINT, map_location="cpu", weights_only=True)
    b = torch.load(reference / CHECKPOINT, map_location="cpu", weights_only=True)
    ma, mb = (json.loads((f / "metrics.json").read_text()) for f in (folder, reference))
    max_diff = max(float((a["model"][k].double() - b["model"][k].double()).abs().max()) for k in b["model"])
    return {
        "parameters_bitwise_equal": all(torch.equal(a["model"][k], b["model"][k]) for k in b["model"])
        and a["model"].keys() == b["model"].keys(),
        "max_abs_parameter_difference": max_diff,
        "epsilon": ma["epsilon"], "epsilon_equal": ma["epsilon"] == mb["epsilon"],
        "ledger_equal": ma["ledger"] == mb["ledger"], "history_equal": ma["history"] == mb["history"],
        "steps": ma["steps"], "ledger_steps_final": PrivacyLedger.from_dict(ma["ledger"]).steps,
        "final_consistent": consistency_problem(a) is None and ma["steps"] == mb["steps"],
    }


def run_trial(start: Callable[[bool], Any], folder: Path, reference: Path, delay: float | None = None,
              in_write_after: int | None = None) -> dict[str, Any]:
    """One kill and one resume; ``start(resume)`` launches the run (or its resumption) on ``folder``."""
    killed = watch(start(False), folder, kill_after_first=delay, kill_in_write_after=in_write_after)
    row = {"kill_delay_s": delay, "kill_in_write_after": in_write_after, "kill_landed": killed["killed"],
           "kill_watch": killed}
    if not killed["killed"]:
        return row
    row |= after_kill(folder)
    resumed = watch(start(True), folder)
    row["resume_watch"] = resumed
    if resumed["returncode"] == 0:
        row |= same_run(folder, reference)
    return row


def cli_starter(folder: Path, flags: list[str]) -> Callable[[bool], subprocess.Popen]:
    env = os.environ | {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}

    def start(resume: bool) -> subprocess.Popen:
        args = ["--resume", str(folder)] if resume else [*flags, "--out", str(folder)]
        log = open(folder.parent / f"{folder.name}.{'resume' if resume else 'run'}.log", "w")
        return subprocess.Popen([sys.executable, "-m", "dpopt.cli", "train", "--no-progress", *args], cwd=ROOT,
                                env=env, stdout=log, stderr=subprocess.STDOUT)

    return start


def ok(row: dict[str, Any]) -> bool:
    return bool(row.get("kill_landed") and row.get("checkpoint_ok") and row.get("parameters_bitwise_equal")
                and row.get("epsilon_equal") and row.get("ledger_equal") and row.get("history_equal")
                and row.get("final_consistent") and not row["kill_watch"]["problems"]
                and not row["resume_watch"]["problems"])


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="dpopt reproduce crash_safety", description=__doc__.split("\n")[0])
    p.add_argument("--kills", type=int, default=20, help="kills at random instants")
    p.add_argument("--write-kills", type=int, default=5,
                   help="further kills aimed at a checkpoint write (after a random number of checkpoints)")
    p.add_argument("--algorithms", nargs="+", default=list(ALGORITHMS), choices=list(ALGORITHMS))
    p.add_argument("--every", type=int, nargs="+", default=[1, 3, 5], help="--checkpoint-every values, cycled")
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the kill instants (the runs use seed and secret seed 0)")
    p.add_argument("--work", default="runs/crash_safety", help="folder for the runs")
    p.add_argument("--out", default=str(ROOT / "experiments/results/reliability/crash_safety.json"))
    a = p.parse_args(argv)
    rng = random.Random(a.seed)
    work = Path(a.work).resolve()
    base = ["--dataset", "digits", "--model", "mlp", "--epochs", str(a.epochs), "--batch-size", "128",
            "--epsilon", "2", "--seed", "0", "--secret-seed", "0"]  # replayable: each trial is the reference run
    trials = [(a.algorithms[i % len(a.algorithms)], a.every[i % len(a.every)]) for i in range(a.kills + a.write_kills)]
    references = {}
    for alg, every in sorted(set(trials), key=trials.index):  # one per configuration: its own timing
        folder = work / f"reference-{alg}-every{every}"
        folder.mkdir(parents=True, exist_ok=True)
        flags = [*base, "--algorithm", alg, *ALGORITHMS[alg], "--checkpoint-every", str(every)]
        seen = watch(cli_starter(folder, flags)(False), folder)
        if seen["returncode"] != 0 or seen["problems"]:
            raise RuntimeError(f"reference run of {alg} failed: {seen}")
        references[alg, every] = (folder, seen["first_to_last_checkpoint_s"])
        history = json.loads((folder / "metrics.json").read_text())["history"]
        per_epoch, total = history[0]["step"], history[-1]["step"]
        print(f"reference {alg} every {every}: {seen['wall_s']:.1f} s, {seen['checkpoints_read']} checkpoints read")
    rows = []
    for i, (alg, every) in enumerate(trials):
        reference, span = references[alg, every]
        flags = [*base, "--algorithm", alg, *ALGORITHMS[alg], "--checkpoint-every", str(every)]
        aimed = i >= a.kills
        for attempt in range(5):  # a kill drawn after the run's end did not land: draw again
            folder = work / f"trial{i:02d}-{attempt}"
            folder.mkdir(parents=True, exist_ok=True)
            timing = ({"in_write_after": rng.randint(1, total // every - 1)} if aimed
                      else {"delay": rng.uniform(0.0, span)})
            row = run_trial(cli_starter(folder, flags), folder, reference, **timing)
            if row["kill_landed"]:
                break
        row |= {"trial": i, "aimed_at_a_write": aimed, "algorithm": alg, "checkpoint_every": every,
                "attempts": attempt + 1, "ok": ok(row)}
        rows.append(row)
        print(f"kill {i + 1:2d}/{a.kills + a.write_kills} {alg:9s} every {every}{' (aimed at a write)' * aimed}: "
              f"checkpoint step {row.get('step_at_kill')}, cut write {bool(row.get('temp_files_left'))}, "
              f"bitwise {row.get('parameters_bitwise_equal')}, epsilon {row.get('epsilon')}, ok {row['ok']}")
    random_rows = [r for r in rows if not r["aimed_at_a_write"]]
    summary = {
        "kills": len(rows), "random_kills": len(random_rows), "kills_aimed_at_writes": len(rows) - len(random_rows),
        "all_ok": all(r["ok"] for r in rows),
        "random_kills_ok": sum(r["ok"] for r in random_rows),
        "bitwise_equal_parameters": sum(bool(r.get("parameters_bitwise_equal")) for r in rows),
        "equal_epsilon": sum(bool(r.get("epsilon_equal")) for r in rows),
        "equal_ledger": sum(bool(r.get("ledger_equal")) for r in rows),
        "equal_history": sum(bool(r.get("history_equal")) for r in rows),
        "kills_mid_epoch": sum(1 for r in rows if r.get("step_at_kill", 0) % per_epoch),
        "kills_after_the_last_checkpoint": sum(1 for r in rows if r.get("step_at_kill") == total),
        "kills_during_a_checkpoint_write": sum(1 for r in rows if r.get("temp_files_left")),
        "checkpoints_read_while_running": sum(r["kill_watch"]["checkpoints_read"]
                                              + r.get("resume_watch", {}).get("checkpoints_read", 0) for r in rows),
        "checkpoint_problems": sum(len(r["kill_watch"]["problems"]) + len(r.get("resume_watch", {}).get("problems", []))
                                   for r in rows) + sum(1 for r in rows if not r.get("checkpoint_ok")),
        "epsilon_by_algorithm": {alg: json.loads((f / "metrics.json").read_text())["epsilon"]
                                 for (alg, _), (f, _) in references.items()},
    }
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"argv": argv, "summary": summary, "trials": rows}, indent=1))
    print(json.dumps(summary, indent=1))
    return 0 if summary["all_ok"] else 1
