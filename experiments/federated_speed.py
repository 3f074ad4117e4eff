"""Speed of the in-process simulator: the vectorised client gradients (one torch.func.vmap over all clients)
against a per-client autograd loop, and the whole round (gradients, client step, noise, ledgers, server).

MNIST split iid over n clients, 32 examples per client and round, logistic regression (7,850 parameters)
and the core MLP (784-128-10, 101,770 parameters). CPU time (time.process_time) with one thread; the two
gradient paths alternate round by round in the same process, so the machine's load affects both alike.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from dpopt.federated.config import FederatedConfig, build_setup
from dpopt.federated.simulator import InProcessFederation


def loop_gradients(oracle, model, x: torch.Tensor, clients: list[int], round: int) -> torch.Tensor:
    """The same gradients, one client at a time with ordinary autograd."""
    torch.nn.utils.vector_to_parameters(x, model.parameters())
    rows = []
    for i in clients:
        b = oracle.batch(i, round)
        model.zero_grad()
        F.cross_entropy(model(oracle.inputs[b]), oracle.targets[b]).backward()
        rows.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    return torch.stack(rows)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="dpopt reproduce federated_speed")
    p.add_argument("--cases", nargs="+", default=["logreg:10", "logreg:100", "logreg:1000", "mlp:10", "mlp:100"])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--out", default="experiments/results/federated")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for case in a.cases:
        model_name, n = case.split(":")
        config = FederatedConfig(dataset="mnist", model=model_name, clients=int(n), rounds=a.rounds,
                                 noise_multiplier=1.0, clip=0.1, lr=0.1)
        setup = build_setup(config)
        fed = InProcessFederation(setup)
        oracle, clients = setup.problem.oracle, list(range(int(n)))
        model = oracle.model
        fed.step()  # warm-up
        vmap_t, loop_t, step_t = [], [], []
        for t in range(2, a.rounds + 2):
            for kind in ("vmap", "loop") if t % 2 else ("loop", "vmap"):
                start = time.process_time()
                if kind == "vmap":
                    grads = oracle(fed.server.x, clients, t)
                    vmap_t.append(time.process_time() - start)
                else:
                    ref = loop_gradients(oracle, model, fed.server.x.clone(), clients, t)
                    loop_t.append(time.process_time() - start)
            assert torch.allclose(grads, ref, atol=1e-5, rtol=1e-4)
            start = time.process_time()
            fed.step()
            step_t.append(time.process_time() - start)
        row = {"model": model_name, "clients": int(n), "params": setup.problem.x0.numel(),
               "vmap_grad_ms": 1e3 * statistics.median(vmap_t), "loop_grad_ms": 1e3 * statistics.median(loop_t),
               "round_ms": 1e3 * statistics.median(step_t)}
        row["speedup"] = row["loop_grad_ms"] / row["vmap_grad_ms"]
        rows.append(row)
        print(f"{model_name:<7} n={n:<5} gradients: vmap {row['vmap_grad_ms']:8.1f} ms, loop {row['loop_grad_ms']:8.1f} ms "
              f"(x{row['speedup']:.1f}); whole round {row['round_ms']:8.1f} ms CPU", flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "speed.json").write_text(json.dumps({"args": vars(a), "results": rows}, indent=1))
    return 0
