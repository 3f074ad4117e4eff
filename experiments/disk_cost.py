"""DiSK's cost per step and peak memory against its base (paper L43, L199; spec §2.9): at most 2x the
compute of the base (one extra per-example pass at x + gamma d; none when gamma = (1-kappa)/kappa, c = 1)
and two extra model-size buffers (g~ and d).

Time: CPU seconds per step (``time.process_time``, one thread), the systems stepping in turn in one
process, so load from other processes slows every system alike; median over ``--steps`` rounds, after
two warm-up steps each (DiSK's step 0 has one point only). Memory: ``dpopt.bench.peak_tensor_mb`` of one
more step, each system built alone (the others deleted), plus the bytes of the persistent state
(parameters, base-optimizer state, DiSK's g~ and d). Every system: fixed batches of the whole toy set,
noise multiplier 1, flat clipping C = 1.
"""

from __future__ import annotations

import argparse
import gc
from typing import Any

import torch
import torch.nn.functional as F

from dpopt.algorithms import CONFIGS, PrivateStep, Privatizer, build_algorithm
from dpopt.bench import cpu_medians_in_turn, peak_tensor_mb
from dpopt.clipping import Clipping
from dpopt.data.datasets import Dataset
from dpopt.data.samplers import FixedOrderSampler
from dpopt.grad import PerExampleEngine
from dpopt.models import cnn, minilm_random
from dpopt.noise.gaussian import GaussianNoise
from dpopt.noise.rng import SecretStream
from dpopt.privacy import PrivacyLedger
from dpopt.transforms import KalmanFilter
from experiments._report import write_table

KAPPA = 0.7
SYSTEMS = {"base": ("dp", {}), "disk": ("disk", {"kappa": KAPPA, "gamma": 0.5}),
           "disk c=1": ("disk", {"kappa": KAPPA, "gamma": (1 - KAPPA) / KAPPA})}
WORKLOADS = {"cnn": 512, "bert": 16}  # batch sizes: the image grid's; MiniLM's shape at sequence length 64


def workload(name: str, batch: int) -> tuple[torch.nn.Module, Any, Any]:
    torch.manual_seed(0)
    if name == "cnn":
        data = (torch.randn(batch, 1, 28, 28), torch.randint(0, 10, (batch,)))
        return cnn((1, 28, 28), 10), data, lambda m, b: F.cross_entropy(m(b[0]), b[1], reduction="none")
    data = {"input_ids": torch.randint(0, 30522, (batch, 64)), "attention_mask": torch.ones(batch, 64, dtype=torch.long),
            "labels": torch.randint(0, 2, (batch,))}

    def loss(m, b):
        return F.cross_entropy(m(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits, b["labels"],
                               reduction="none")

    return minilm_random(Dataset("cost", {"labels": torch.zeros(1)}, None, 2)), data, loss


def build(name: str, batch: int, base: str, system: str) -> tuple[PrivateStep, Any]:
    model, data, loss = workload(name, batch)
    prefix, extra = SYSTEMS[system]
    privatizer = Privatizer(Clipping(1.0), GaussianNoise(1.0, 1.0, SecretStream(0, "noise")),
                            FixedOrderSampler(batch, batch, SecretStream(0, "sampling")), PrivacyLedger())
    hp = CONFIGS[f"{prefix}-{base}"](lr=0.01 if base == "sgd" else 1e-4, **extra)
    opt = build_algorithm(f"{prefix}-{base}", PerExampleEngine(model, loss), privatizer, hp)
    opt.verified = True  # the one-time self-check is not part of a step
    for _ in range(2):
        opt.step(data)
    return opt, data


def state_mb(opt: PrivateStep) -> dict[str, float]:
    size = lambda ts: sum(t.numel() * t.element_size() for t in ts) / 2**20  # noqa: E731
    base = [v for s in opt.base.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    kf = [t for f in opt.transforms if isinstance(f, KalmanFilter) for t in (f.filtered or []) + (f.delta or [])]
    return {"params_mb": size(opt.params), "base_state_mb": size(base), "disk_state_mb": size(kf)}


def measure(name: str, batch: int, base: str, steps: int) -> dict[str, dict[str, float]]:
    opts = {s: build(name, batch, base, s) for s in SYSTEMS}
    cpu = cpu_medians_in_turn({s: lambda o=o, d=d: o.step(d) for s, (o, d) in opts.items()}, steps)
    del opts
    out: dict[str, dict[str, float]] = {}
    for s in SYSTEMS:
        gc.collect()
        opt, data = build(name, batch, base, s)
        out[s] = {"cpu_s_per_step": cpu[s], "peak_tensor_mb": peak_tensor_mb(lambda: opt.step(data)),
                  **state_mb(opt)}
        del opt, data
    for s in SYSTEMS:
        out[s]["time_ratio"] = out[s]["cpu_s_per_step"] / out["base"]["cpu_s_per_step"]
        out[s]["peak_ratio"] = out[s]["peak_tensor_mb"] / out["base"]["peak_tensor_mb"]
    return out


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="dpopt reproduce disk_cost")
    p.add_argument("--workloads", nargs="+", choices=sorted(WORKLOADS), default=sorted(WORKLOADS))
    p.add_argument("--bases", nargs="+", choices=["sgd", "adam"], default=["sgd", "adam"])
    p.add_argument("--steps", type=int, default=7)
    p.add_argument("--out", default="runs/disk_cost")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    results = {f"{w} b{WORKLOADS[w]} {b}": measure(w, WORKLOADS[w], b, a.steps) for w in a.workloads for b in a.bases}
    lines = ["| workload | system | CPU s/step | time / base | peak tensor MB | peak / base | params MB | "
             "base-optimizer state MB | DiSK state MB |", "|---" * 9 + "|"]
    for case, rows in results.items():
        for s, r in rows.items():
            lines.append(f"| {case} | {s} | {r['cpu_s_per_step']:.3f} | {r['time_ratio']:.2f} | {r['peak_tensor_mb']:.1f} "
                         f"| {r['peak_ratio']:.2f} | {r['params_mb']:.1f} | {r['base_state_mb']:.1f} | "
                         f"{r['disk_state_mb']:.1f} |")
    write_table(a.out, "cost", results, lines)
    return 0
