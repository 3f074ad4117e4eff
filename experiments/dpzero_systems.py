"""DPZero's memory and time on the pretrained MiniLM (all-MiniLM-L6-v2, 22.7M parameters), sequence 64.

Claim (DPZero Table 3, L272-279): DPZero uses MeZO's memory (2668 MiB on RoBERTa-355M), i.e. inference
memory, and MeZO's time. Targets of issue 6: peak memory <= 1.1x an inference-only forward at the same
batch, step time <= 2.3x one forward.

Measured in one process with one thread, the systems taking turns:
* ``inference``: per-example losses under ``torch.no_grad`` in eval mode (the forward every step makes);
* ``dpzero`` / ``mezo``: one step of ``dpopt``'s recipe (two forwards, four regenerations of u in chunks);
* ``sgd`` / ``dp-adam``: a non-private backward step and dpopt's DP-Adam, for scale (memory only).
Memory is ``dpopt.bench.peak_tensor_mb`` (live tensors at the start plus the profiler's allocation peak: the
model, the data and everything the step allocates); time is CPU seconds (``time.process_time``) per call,
the median over ``--repeats`` rounds, so other processes on the machine do not inflate it.
It also measures the parameter drift of perturb/restore cycles in float32, float16 and bfloat16.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from dpopt.algorithms import CONFIGS, Privatizer, build_algorithm
from dpopt.bench import cpu_medians_in_turn, peak_tensor_mb
from dpopt.clipping import Clipping
from dpopt.data.datasets import Dataset
from dpopt.data.samplers import FixedOrderSampler
from dpopt.grad import PerExampleEngine
from dpopt.grad.zeroth_order import Direction
from dpopt.models import minilm_cls
from dpopt.noise.gaussian import GaussianNoise
from dpopt.noise.rng import SecretStream
from dpopt.privacy import PrivacyLedger

SEQ = 64
TIMED = ("inference", "dpzero", "mezo")


def loss(model, batch):
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    return F.cross_entropy(model(**inputs).logits, batch["labels"], reduction="none")


def text_batch(b: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(b)
    return {"input_ids": torch.randint(0, 30522, (b, SEQ), generator=g),
            "attention_mask": torch.ones(b, SEQ, dtype=torch.long), "labels": torch.randint(0, 2, (b,), generator=g)}


def systems(b: int, names: tuple[str, ...]) -> dict[str, Callable[[], object]]:
    model = minilm_cls(Dataset("bench", {"labels": torch.zeros(1)}, None, 2)).eval()
    batch = text_batch(b)
    engine = PerExampleEngine(model, loss)

    def step(algorithm: str, z: float):
        privatizer = Privatizer(Clipping(1.0), GaussianNoise(z, 1.0, SecretStream(0, "noise")),
                                FixedOrderSampler(b, b, SecretStream(0, "sampling")), PrivacyLedger())
        opt = build_algorithm(algorithm, engine, privatizer, CONFIGS[algorithm](lr=1e-6))
        opt.verified = True  # the first-order self-check is not part of a step
        return lambda: opt.step(batch)

    def inference():
        with torch.no_grad():
            return loss(model, batch)

    sgd = torch.optim.SGD(model.parameters(), lr=1e-6)

    def backward_step():
        loss(model, batch).mean().backward()
        sgd.step()
        sgd.zero_grad(set_to_none=True)

    makers = {"inference": lambda: inference, "dpzero": lambda: step("dpzero", 1.0), "mezo": lambda: step("mezo", 0.0),
              "sgd": lambda: backward_step, "dp-adam": lambda: step("dp-adam", 1.0)}
    return {name: makers[name]() for name in names}


def peak_in_own_process(system: str, b: int) -> float:
    """peak_tensor_mb of one step of ``system`` in a fresh process (live tensors of other systems, such as an
    optimizer's state, would otherwise count)."""
    cmd = [sys.executable, "-m", "experiments.dpzero_systems", "--worker", system, "--batches", str(b)]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1], check=True)
    return float(done.stdout.strip().splitlines()[-1])


def worker(system: str, b: int) -> float:
    torch.set_num_threads(1)
    fn = systems(b, (system,))[system]
    fn()  # warm-up: lazily created state (Adam moments) exists before the measured step, as in training
    return peak_tensor_mb(fn)


def measure(b: int, repeats: int, memory_only: tuple[str, ...]) -> dict[str, dict[str, float]]:
    """CPU time of inference, dpzero and mezo taking turns in this process; peak memory of every system
    (those in ``memory_only`` too) each in its own process."""
    cpu = cpu_medians_in_turn(systems(b, TIMED), repeats, warmup=1)
    result = {name: {"cpu_s": s} for name, s in cpu.items()}
    for name in (*TIMED, *memory_only):
        result.setdefault(name, {})["peak_mb"] = peak_in_own_process(name, b)
    base = result["inference"]
    for r in result.values():
        if "cpu_s" in r:
            r["time_vs_forward"] = r["cpu_s"] / base["cpu_s"]
        r["memory_vs_inference"] = r["peak_mb"] / base["peak_mb"]
    return result


def drift(cycles: int, smoothing: float = 1e-3) -> dict[str, dict[str, float]]:
    """||x_k - x_0|| / ||lambda u|| after k perturb (+l, -2l, +l) cycles of MiniLM's encoder weights in each
    dtype, and the share of the perturbation that survives rounding (||fl(x + lu) - x|| / ||lu||)."""
    base = minilm_cls(Dataset("bench", {"labels": torch.zeros(1)}, None, 2)).bert.encoder
    out = {}
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        params = [p.detach().to(dtype).clone() for p in base.parameters()]
        x0 = [p.clone() for p in params]
        direction = Direction(params, seed=0)
        u_norm = smoothing * sum(float(u.double().square().sum()) for u in direction.materialize(0)) ** 0.5
        direction.add_to_params(smoothing, 0)
        kept = sum(float((p.double() - x.double()).square().sum()) for p, x in zip(params, x0)) ** 0.5 / u_norm
        direction.add_to_params(-smoothing, 0)
        for k in range(cycles):
            for alpha in (smoothing, -2 * smoothing, smoothing):
                direction.add_to_params(alpha, k)
        moved = sum(float((p.double() - x.double()).square().sum()) for p, x in zip(params, x0)) ** 0.5
        out[str(dtype).removeprefix("torch.")] = {"perturbation_kept": kept, "drift_vs_perturbation": moved / u_norm}
    return out


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="dpopt reproduce dpzero_systems")
    p.add_argument("--batches", type=int, nargs="+", default=[16, 32, 64])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--first-order-at", type=int, default=64, help="also measure sgd and dp-adam memory at this batch")
    p.add_argument("--drift-cycles", type=int, default=100)
    p.add_argument("--out", default="experiments/results/dpzero")
    p.add_argument("--worker", choices=["inference", "dpzero", "mezo", "sgd", "dp-adam"], help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    if a.worker:
        print(worker(a.worker, a.batches[0]))
        return 0
    results = {"batches": {}, "drift": None, "setup": {"model": "minilm", "seq": SEQ, "threads": 1}}
    for b in a.batches:
        extra = ("sgd", "dp-adam") if b == a.first_order_at else ()
        results["batches"][str(b)] = r = measure(b, a.repeats, extra)
        print(f"batch {b}: " + json.dumps(r), flush=True)
    if a.drift_cycles:
        results["drift"] = drift(a.drift_cycles)
        results["drift_cycles"] = a.drift_cycles
        print(json.dumps(results["drift"]), flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "systems.json").write_text(json.dumps(results, indent=2))
    cell = lambda r, k, f: format(r[k], f) if k in r else "—"  # noqa: E731
    lines = ["| batch | system | CPU s / call | x one forward | peak tensor MB | x inference |", "|---|---|---|---|---|---|"]
    for b, r in results["batches"].items():
        lines += [f"| {b} | {k} | {cell(v, 'cpu_s', '.3f')} | {cell(v, 'time_vs_forward', '.2f')} | {v['peak_mb']:.1f} | "
                  f"{v['memory_vs_inference']:.3f} |" for k, v in r.items()]
    (out / "systems.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
