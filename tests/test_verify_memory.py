"""The attribution check before the first release holds one group of one example's reference gradients and one
parameter's per-example gradients at a time, not every example's gradients of the whole model at once (which took
OPT-1.3B past its 14 GB memory cap before any DP method's first step), and decides as the check taking a whole
reference gradient at once does."""

import gc

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpopt import bench
from dpopt.grad import PerExampleEngine
from dpopt.grad.verify import _mismatches, check_attribution, reference_groups


def stack(d: int, layers: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(layer for _ in range(layers) for layer in (nn.Linear(d, d), nn.Tanh())))


def extra_peak(engine: PerExampleEngine, x: torch.Tensor, group_bytes: int | None) -> int:
    """Peak bytes the check allocates above what is alive before it."""
    gc.collect()  # as ``peak_tensor_mb`` does before it counts: garbage left by an earlier check is not alive
    start = bench._live_tensor_bytes()
    return bench.peak_tensor_mb(lambda: check_attribution(engine, x, group_bytes=group_bytes)) * 2**20 - start


def test_the_check_holds_one_group_of_reference_gradients_not_a_whole_gradient():
    model = stack(256, 8)
    engine = PerExampleEngine(model, lambda m, x: m(x).square().mean(1))
    x = torch.randn(3, 256)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    layer = params // 8  # one weight and its bias
    grouped, whole = extra_peak(engine, x, layer), extra_peak(engine, x, None)  # a model this small: one group
    # one group (a layer) of references, and that layer's per-example row as it is formed (two copies), besides
    # small captures: about 3 layers
    assert grouped < 4 * layer, f"the grouped check allocated {grouped / layer:.2f} layers' bytes"
    # one whole reference gradient, and one layer's row as it is formed: about 1.25x the parameters (three
    # per-example gradients, the reference and its concatenation, before: 5x)
    assert params < whole < 2.2 * params, f"the whole reference took {whole / params:.2f} times the parameters' bytes"


def test_groups_are_consecutive_bounded_and_a_large_parameter_stands_alone():
    params = [torch.zeros(n) for n in (3, 3, 10, 2, 2, 2)]  # 4 bytes an element
    assert reference_groups(params, 24) == [[0, 1], [2], [3, 4, 5]]
    assert reference_groups(params, 1) == [[j] for j in range(6)]
    assert reference_groups(params, 10**9) == [list(range(6))]


class SequenceFirstInside(nn.Module):
    """A Linear applied on [T, B, d] between two batch-first ones: hooks regroup its rows (T a multiple of B)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.inp, self.seq, self.out = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, 2)

    def forward(self, x):
        h = torch.tanh(self.inp(x)).transpose(0, 1)
        return self.out(torch.tanh(self.seq(h)).transpose(0, 1)).mean(1)


def seq_loss(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y, reduction="none")


@pytest.mark.parametrize("group_bytes", [1, 100])
def test_grouped_references_decide_as_one_whole_reference(group_bytes):
    torch.manual_seed(0)
    batch = (torch.randn(3, 6, 4), torch.randint(0, 2, (3,)))
    pick = lambda s: (batch[0][s], batch[1][s])  # noqa: E731
    decisions = []
    for grouped in (True, False):
        torch.manual_seed(1)
        engine = PerExampleEngine(SequenceFirstInside(4), seq_loss)
        whole = [list(range(len(engine.params)))]
        groups = reference_groups(engine.params, group_bytes) if grouped else whole
        decisions.append(_mismatches(engine, pick, 3, 1e-3, groups))
    assert len(reference_groups(list(SequenceFirstInside(4).parameters()), group_bytes)) > 1
    assert decisions[0] is not None and "'seq'" in decisions[0][1]
    assert decisions[0] == decisions[1]
    routes = []
    for size in (group_bytes, 10**9):
        torch.manual_seed(1)
        engine = PerExampleEngine(SequenceFirstInside(4), seq_loss)
        check_attribution(engine, batch, group_bytes=size)
        routes.append(engine.routes)
    assert routes[0] == routes[1] and routes[0]
