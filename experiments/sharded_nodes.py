"""Sharded training across nodes: two torchrun nodes on loopback against one node and one process, and a killed
rank resumed from its last checkpoint.

Every run is ``dpopt train`` of one small recipe (digits, MLP, DP-Adam, ``--secret-seed``: the comparison needs
replayable noise) as a subprocess:

1. one process, unsharded, and ``--shard --nproc 2`` on one node (the reference);
2. two nodes on the loopback address: two ``torchrun --nnodes 2 --node-rank K --nproc-per-node 2 --master-addr
   127.0.0.1`` launches started together, per rendezvous backend (static, c10d). Each node gets its own
   ``--out`` (two machines' disks); only rank 0's may be written. Reported: the largest parameter
   difference of the exported models (absolute, and relative to the parameter's largest entry) and whether the
   ledger and epsilon are identical, against the one-node and the one-process run;
3. a killed rank: the one-node run again, its later-started worker process SIGKILLed once a checkpoint at step >= 8
   exists. The run must stop (non-zero exit) with its checkpoint's ledger holding exactly its step's releases
   and no exported model; ``dpopt train --resume DIR --nproc 2 --shard``, and the same checkpoint resumed on two
   nodes (on node 0's disk alone: rank 0 reads it and sends it to the other ranks), must end at the uninterrupted
   run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from dpopt.checkpoint import CHECKPOINT, load_checkpoint
from dpopt.privacy import PrivacyLedger

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "dpopt.cli", "train"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]  # the torchrun command
ENV = os.environ | {"OMP_NUM_THREADS": "1"}
NPROC = 2


def _flags(epochs: int) -> list[str]:
    return ["--dataset", "digits", "--model", "mlp", "--algorithm", "dp-adam", "--epochs", str(epochs), "--epsilon",
            "2", "--seed", "0", "--secret-seed", "0", "--checkpoint-every", "1", "--no-progress"]


def _run(command: list[str], timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run(command, check=False, env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def _checked(done: subprocess.CompletedProcess, what: str) -> None:
    if done.returncode != 0:
        raise RuntimeError(f"{what} exited with {done.returncode}:\n{done.stderr[-3000:]}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model(folder: Path) -> dict[str, torch.Tensor]:
    """The exported model of a run folder (``model/model.pt``: its state_dict)."""
    return torch.load(folder / "model" / "model.pt", map_location="cpu", weights_only=True)


def _metrics(folder: Path) -> dict[str, Any]:
    return json.loads((folder / "metrics.json").read_text())


def compare(x: Path, y: Path) -> dict[str, Any]:
    """Two finished runs: the largest parameter difference of their exported models (absolute, and relative to the
    parameter's largest entry in ``x``), and whether their ledgers and epsilons are identical."""
    a, b = _model(x), _model(y)
    if a.keys() != b.keys():
        raise RuntimeError(f"{x} and {y} exported different parameters")
    mx, my = _metrics(x), _metrics(y)
    return {"max_abs_parameter_difference": max(float((a[k] - b[k]).abs().max()) for k in a),
            "max_relative_parameter_difference": max(float((a[k] - b[k]).abs().max() / a[k].abs().max()) for k in a),
            "ledger_identical": mx["ledger"] == my["ledger"], "epsilon_identical": mx["epsilon"] == my["epsilon"]}


def _summary(folder: Path) -> dict[str, Any]:
    m = _metrics(folder)
    return {"steps": m["steps"], "epsilon": m["epsilon"], "test_accuracy": m["test_accuracy"]}


def _on_two_nodes(node_args: list[list[str]], backend: str) -> None:
    """Two torchrun nodes of NPROC processes each on 127.0.0.1, started together, node K running ``dpopt train``
    with ``node_args[K]``, joined by the ``backend`` rendezvous (static: --master-addr/--master-port; c10d:
    --rdzv-endpoint)."""
    port = _free_port()
    rendezvous = (["--master-addr", "127.0.0.1", "--master-port", str(port)] if backend == "static" else
                  ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "sharded-nodes"])
    nodes = [subprocess.Popen(TORCHRUN + ["--nnodes", "2", "--node-rank", str(k), "--nproc-per-node", str(NPROC),
                                          *rendezvous, "-m", "dpopt.cli", "train", *args],
                              env=ENV, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for k, args in enumerate(node_args)]
    finished = [node.communicate(timeout=900) for node in nodes]
    for k, (node, (_, err)) in enumerate(zip(nodes, finished)):
        if node.returncode != 0:
            raise RuntimeError(f"two-node run ({backend}), node {k}, exited with {node.returncode}:\n{err[-3000:]}")


def two_nodes(flags: list[str], work: Path, backend: str) -> dict[str, Any]:
    """The run on two nodes; node K's ``--out`` is ``two-nodes-BACKEND-nodeK`` (two machines' disks: only rank 0
    writes; it is on node 0 under static rendezvous, and on the node c10d numbers first under c10d)."""
    outs = [work / f"two-nodes-{backend}-node{k}" for k in range(2)]
    _on_two_nodes([flags + ["--out", str(out)] for out in outs], backend)
    written = [k for k, out in enumerate(outs) if (out / "metrics.json").exists()]
    if len(written) != 1:
        raise RuntimeError(f"two-node run ({backend}): {len(written)} nodes wrote a run folder, not 1")
    lead, other = outs[written[0]], outs[1 - written[0]]
    left = sorted(p.name for p in other.iterdir()) if other.exists() else []
    return {"rendezvous": backend, "nodes": 2, "processes_per_node": NPROC, "rank0_node": written[0],
            "other_node_out_files": left, **_summary(lead), "against_one_node": compare(work / "one-node", lead),
            "against_one_process": compare(work / "one-process", lead)}


def killed_rank(flags: list[str], work: Path, after_step: int) -> dict[str, Any]:
    """Start the one-node sharded run, SIGKILL its later-started worker once a checkpoint at step >= ``after_step``
    exists, check what the kill left, resume it sharded on one node and on two, and compare both with the
    uninterrupted run (``one-node``)."""
    folder = work / "killed"
    shutil.rmtree(folder, ignore_errors=True)  # an earlier run's checkpoint would end the wait below at once
    run = subprocess.Popen(CLI + flags + ["--nproc", str(NPROC), "--shard", "--out", str(folder)], env=ENV, cwd=ROOT,
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    while not (folder / CHECKPOINT).exists() or load_checkpoint(folder)["step"] < after_step:
        if run.poll() is not None:
            raise RuntimeError(f"the run ended (exit {run.returncode}) before its step-{after_step} checkpoint")
        time.sleep(0.01)
    children = subprocess.run(["ps", "-o", "pid=,args=", "--ppid", str(run.pid)], check=False, capture_output=True,
                              text=True).stdout.splitlines()
    workers = sorted(int(line.split()[0]) for line in children if "spawn_main" in line)
    os.kill(workers[-1], signal.SIGKILL)
    _, err = run.communicate(timeout=300)
    state = load_checkpoint(folder)
    ledger_steps = PrivacyLedger.from_dict(state["ledger"]).steps
    stopped = {"exit_code": run.returncode, "workers": len(workers), "checkpoint_step": state["step"],
               "checkpoint_ledger_steps": ledger_steps, "checkpoint_optimizer_steps": state["optimizer"]["steps"],
               "model_exported": (folder / "model").exists(),
               "launcher_says": [line for line in err.splitlines() if "terminated with signal" in line][-1:]}
    copies = [work / f"killed-two-nodes-node{k}" for k in range(2)]  # two machines' disks: the run on node 0's
    for copy in copies:
        shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(folder, copies[0])
    copies[1].mkdir()  # empty: only rank 0 reads the checkpoint
    resumed = _run(CLI + ["--resume", str(folder), "--nproc", str(NPROC), "--shard", "--no-progress"])
    _checked(resumed, "the resumed run")
    _on_two_nodes([["--resume", str(copy), "--no-progress"] for copy in copies], "static")
    if any(copies[1].iterdir()):
        raise RuntimeError(f"node 1's folder {copies[1]} was written to: only rank 0 may write")
    return {"kill_after_step": after_step, "stopped": stopped,
            "resumed_one_node": {**_summary(folder), "against_uninterrupted": compare(work / "one-node", folder)},
            "resumed_two_nodes": {**_summary(copies[0]),
                                  "against_uninterrupted": compare(work / "one-node", copies[0])}}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="dpopt reproduce sharded_nodes", description=__doc__.split("\n")[0])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--rendezvous", nargs="+", default=["static", "c10d"], choices=["static", "c10d"],
                   help="torchrun rendezvous backends to launch the two nodes with")
    p.add_argument("--kill-after-step", type=int, default=8)
    p.add_argument("--work", default="/tmp/dpopt_sharded_nodes", help="the runs' folders (replaced)")
    p.add_argument("--out", default=str(ROOT / "experiments/results/reliability/sharded_nodes.json"))
    a = p.parse_args(argv)
    flags, work = _flags(a.epochs), Path(a.work).resolve()
    flags_overwrite = flags + ["--overwrite"]
    _checked(_run(CLI + flags_overwrite + ["--out", str(work / "one-process")]), "the one-process run")
    _checked(_run(CLI + flags_overwrite + ["--nproc", str(NPROC), "--shard", "--out", str(work / "one-node")]),
             "the one-node run")
    results: dict[str, Any] = {"argv": argv, "flags": flags, "one_process": _summary(work / "one-process"),
                               "one_node": {"processes": NPROC, **_summary(work / "one-node"),
                                            "against_one_process": compare(work / "one-process", work / "one-node")}}
    print(json.dumps(results))
    results["two_nodes"] = []
    for backend in a.rendezvous:
        results["two_nodes"].append(two_nodes(flags_overwrite, work, backend))
        print(json.dumps(results["two_nodes"][-1]))
    results["killed_rank"] = killed_rank(flags_overwrite, work, a.kill_after_step)
    print(json.dumps(results["killed_rank"]))
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1) + "\n")
    killed = results["killed_rank"]
    same = [results["one_node"]["against_one_process"], killed["resumed_one_node"]["against_uninterrupted"],
            killed["resumed_two_nodes"]["against_uninterrupted"],
            *(c for r in results["two_nodes"] for c in (r["against_one_node"], r["against_one_process"]))]
    stopped = killed["stopped"]
    held = (stopped["exit_code"] != 0 and not stopped["model_exported"]
            and stopped["checkpoint_ledger_steps"] == stopped["checkpoint_step"]
            and not any(r["other_node_out_files"] for r in results["two_nodes"]))
    return 0 if held and all(c["ledger_identical"] and c["epsilon_identical"] for c in same) else 1
