"""No host synchronisation per layer in the hot path (issue 21, "Devices").

On a GPU every ``.item()``, ``float(t)``, ``int(t)``, ``bool(t)``, ``.tolist()``, ``.cpu()``, ``.numpy()``,
``nonzero`` / ``torch.unique`` and boolean-mask indexing makes the host wait for the device. No GPU is needed to
count them: the tensor methods are wrapped with counters (on CPU they are the same calls), one private step is
run, and the count must be the same for a model of 2 layers as for one of 8 (and at most one device wait per step:
the clip stage's one read, docs/performance.md "Host synchronisations per step")."""

import contextlib
from collections import Counter

import pytest
import torch
from torch import nn

from dpopt.algorithms import CONFIGS, Privatizer, build_algorithm
from dpopt.clipping import Clipping
from dpopt.data.samplers import PoissonSampler
from dpopt.grad.engine import PerExampleEngine
from dpopt.noise.gaussian import GaussianNoise
from dpopt.noise.rng import SecretStream
from dpopt.privacy import PrivacyLedger
from helpers import mlp_loss

N = 64
# Syncs per step, whatever the depth: per physical batch the clip stage's one read (one ``tolist``: the lowest
# squared norm for the negative-norm check, the non-finite and clipped counts, the losses for display, and where the
# statistic has them the ghost norms' cancellation flags and the combined parameters' flags; non-finite rows are
# summed as zeros, not found and dropped); and the Poisson sampler's indices (a ``nonzero`` of a CPU tensor: no
# device wait).
MOST = 2


def _bool_mask(index) -> bool:
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in parts)


@contextlib.contextmanager
def counting_syncs():
    """Counts, by name, the calls that would make the host wait for a CUDA device; restores torch after."""
    counts: Counter = Counter()
    saved = {}

    def wrap(owner, name, sync=lambda *a, **k: True):
        original = getattr(owner, name)
        saved[(owner, name)] = original

        def counted(*args, **kwargs):
            if sync(*args, **kwargs):
                counts[name] += 1
            return original(*args, **kwargs)

        setattr(owner, name, counted)

    for name in ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "cpu", "numpy", "nonzero"):
        wrap(torch.Tensor, name)
    wrap(torch.Tensor, "__getitem__", lambda self, index: _bool_mask(index))
    for name in ("nonzero", "unique", "masked_select"):
        wrap(torch, name)
    try:
        yield counts
    finally:
        for (owner, name), original in saved.items():
            setattr(owner, name, original)


def mlp(depth: int) -> nn.Module:
    layers = [nn.Linear(6, 16), nn.Tanh()]
    for _ in range(depth - 2):
        layers += [nn.Linear(16, 16), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(16, 3))


def cnn(depth: int) -> nn.Module:
    """Convolutions kept factored (``ConvOuter``: normed from gradients materialised a chunk of examples at a
    time, in the clip stage) under a Linear head."""
    layers = [nn.Unflatten(1, (1, 4, 4)), nn.Conv2d(1, 16, 3, padding=1), nn.Tanh()]
    for _ in range(depth - 2):
        layers += [nn.Conv2d(16, 16, 3, padding=1), nn.Tanh()]
    return nn.Sequential(*layers, nn.Flatten(), nn.Linear(256, 3))


def syncs_per_step(build, depth: int, algorithm: str, clipping: str) -> Counter:
    torch.manual_seed(0)
    model = build(depth)
    data = (torch.randn(N, 6 if build is mlp else 16), torch.randint(0, 3, (N,)))
    data[0][5, 2] = float("nan")  # one non-finite example: the rows to drop are found too
    sampler = PoissonSampler(N, 0.5, SecretStream(1, "sampling"))
    privatizer = Privatizer(Clipping(0.1, clipping), GaussianNoise(1.0, 0.1, SecretStream(2, "noise")), sampler,
                            PrivacyLedger())
    hp = CONFIGS[algorithm](lr=0.1, gamma=0.1) if algorithm.startswith("disk") else CONFIGS[algorithm](lr=0.1)
    opt = build_algorithm(algorithm, PerExampleEngine(model, mlp_loss), privatizer, hp)
    for _ in range(2):  # the first step verifies attribution (once per run); DiSK's statistic is two-point from step 1
        opt.step(data)
    with counting_syncs() as counts:
        result = opt.step(data)
    assert result.nonfinite == 1 and result.loss is not None  # the row of weight 0 is summed as zeros
    return counts


@pytest.mark.parametrize("build", [mlp, cnn])
@pytest.mark.parametrize("algorithm,clipping", [("dp-sgd", "flat"), ("dp-sgd", "automatic"),
                                                ("dp-sgd", "per-layer"), ("disk-sgd", "flat")])
def test_host_syncs_per_step_do_not_grow_with_depth(build, algorithm, clipping):
    shallow = syncs_per_step(build, 2, algorithm, clipping)
    deep = syncs_per_step(build, 8, algorithm, clipping)
    assert deep == shallow, f"syncs per step grow with depth: {dict(shallow)} at depth 2, {dict(deep)} at 8"
    assert sum(deep.values()) <= MOST, dict(deep)


def test_the_counter_sees_syncs_and_restores_torch():
    item = torch.Tensor.item
    with counting_syncs() as counts:
        t = torch.tensor([1.0, -1.0])
        t.item() if t.numel() == 1 else float(t[0])
        bool((t > 0).any())
        t[t > 0]
        t.nonzero()
    assert counts == Counter({"__float__": 1, "__bool__": 1, "__getitem__": 1, "nonzero": 1})
    assert torch.Tensor.item is item
