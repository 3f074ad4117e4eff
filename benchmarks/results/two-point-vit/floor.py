"""CPU-s a step of one-pass two-point clipping at several DIRECT_ROWS, in one process (one thread, a random batch
of 128, mean of 3 steps after one): `python benchmarks/results/two-point-vit/floor.py`."""
import time

import torch
import torch.nn.functional as F

import dpopt.grad.gradients as engine
from dpopt.algorithms import CONFIGS, Privatizer, build_algorithm
from dpopt.clipping import Clipping
from dpopt.data.datasets import Dataset
from dpopt.data.samplers import FixedOrderSampler
from dpopt.grad import PerExampleEngine
from dpopt.models import cnn, mlp, vit_tiny
from dpopt.noise.gaussian import GaussianNoise
from dpopt.noise.rng import SecretStream
from dpopt.privacy import PrivacyLedger

torch.set_num_threads(1)
B = 128
x, y = torch.randn(B, 1, 28, 28), torch.randint(0, 10, (B,))
MODELS = {"vit": (lambda: vit_tiny(Dataset("m", (x, y), None, 10)), lambda out: out.logits),
          "mlp": (lambda: mlp((1, 28, 28), 10), lambda out: out), "cnn": (lambda: cnn((1, 28, 28), 10), lambda out: out)}


def cpu_per_step(model_name: str, algorithm: str, steps: int = 3) -> float:
    build, logits = MODELS[model_name]
    torch.manual_seed(0)
    privatizer = Privatizer(Clipping(1.0), GaussianNoise(1.0, 1.0, SecretStream(0, "noise")),
                            FixedOrderSampler(B, B, SecretStream(0, "sampling")), PrivacyLedger())
    loss = lambda m, b: F.cross_entropy(logits(m(b[0])), b[1], reduction="none")  # noqa: E731
    opt = build_algorithm(algorithm, PerExampleEngine(build(), loss), privatizer, CONFIGS[algorithm](lr=0.01))
    opt.step((x, y))
    start = time.process_time()
    for _ in range(steps):
        opt.step((x, y))
    return (time.process_time() - start) / steps


for name in MODELS:
    for algorithm in ("dp-sgd", "disk-sgd", "dp-srg-memf"):
        row = []
        for rows in (1, 8, 16, 32):
            engine.DIRECT_ROWS = rows
            row.append(f"{cpu_per_step(name, algorithm):.3f}")
        print(f"{name} {algorithm}: DIRECT_ROWS 1 / 8 / 16 / 32: {' / '.join(row)} CPU-s a step", flush=True)
