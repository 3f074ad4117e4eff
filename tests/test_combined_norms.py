"""Norms of combined statistics (DiSK's two-point mixture, SRG's weighted differences) cannot lose the clip
to cancellation: one example's clipped contribution stays within the bound in every dtype."""

import math

import pytest
import torch

from dpopt.clipping import Clipping, clip_and_sum
from dpopt.grad import PerExampleEngine, captures
from dpopt.grad.captures import Combination, Outer, coalesce, sq_norms
from helpers import Zoo, zoo_batch, zoo_loss

# (a, b) of the statistic a * g(x') + b * g(x): DiSK's c, 1 - c (gamma 0.01 gives c = 43) and SRG's
# eta, -(eta - 1), at the sizes the issue asks for
COEFFICIENTS = {"disk-43": (43.0, -42.0), "disk-1e3": (1e3, 1.0 - 1e3), "srg-200": (200.0, -199.0),
                "srg-1e4": (1e4, 1.0 - 1e4)}


def released_norms(dtype: torch.dtype, coefficients: tuple[float, float], shift: float, mode: str, seed: int):
    """The clipped sum of one example's statistic (noise off) per layer group, and the bound it must meet."""
    torch.manual_seed(seed)
    model = Zoo().to(dtype)
    engine = PerExampleEngine(model, zoo_loss)
    tokens, image, y = zoo_batch(1)
    batch = (tokens, image.to(dtype), y)
    near = [p.detach() + shift * torch.randn_like(p) for p in engine.params]  # nearly equal gradients
    a, b = coefficients
    stat = a * engine.gradients(batch, at=near) + b * engine.gradients(batch)
    exact = sum(g.double().square().sum() for g in stat.materialize()).sqrt()
    bound = 1e-3 * float(exact)  # clipping active
    sums, stats = clip_and_sum(stat, Clipping(bound, mode))
    assert stats.nonfinite == 0
    groups = torch.tensor(engine.groups)
    sq = torch.stack([s.double().square().sum() for s in sums])
    per_group = torch.zeros(int(groups.max()) + 1, dtype=torch.float64).index_add_(0, groups, sq).sqrt()
    return float(sq.sum().sqrt()), per_group, bound


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(COEFFICIENTS))
def test_one_example_of_a_combined_statistic_stays_within_the_bound(name, dtype):
    worst = 0.0
    for seed in range(3):
        for shift in (1e-6, 1e-4):
            total, _, bound = released_norms(dtype, COEFFICIENTS[name], shift, "flat", seed)
            worst = max(worst, total / bound)
    assert worst <= 1 + 1e-6


@pytest.mark.parametrize("mode", ["per-layer", "automatic"])
def test_other_clipping_modes_keep_their_bounds_on_combined_statistics(mode):
    total, per_group, bound = released_norms(torch.float32, COEFFICIENTS["srg-1e4"], 1e-5, mode, 0)
    assert total <= bound * (1 + 1e-6)
    if mode == "per-layer":
        assert float(per_group.max()) <= bound / math.sqrt(len(per_group)) * (1 + 1e-6)


def test_ghost_norms_of_cancelling_steps_are_recomputed_exactly():
    """Steps whose contributions cancel (l, r then about l, -r): the float32 ghost sum comes out far below the
    true norm, negative for some examples; those are recomputed from the materialised gradients."""
    torch.manual_seed(0)
    left, right = torch.randn(64, 1, 32), torch.randn(64, 1, 48)
    capture = Outer(torch.cat([left, left * (1 + 1e-4), left], 1), torch.cat([right, -right, right * 0], 1), 32,
                    (32, 48))
    exact = capture.materialize().double().flatten(1).square().sum(1)
    got = sq_norms(capture).double()
    assert torch.allclose(got, exact, rtol=1e-6, atol=0)


@pytest.mark.parametrize("coefficients,shift,recomputed", [((0.86, 0.14), 1.0, False), ((1.0, -0.08), 1.0, False),
                                                         ((43.0, -42.0), 1e-4, True)])
def test_a_combination_normed_by_its_grams_equals_its_materialised_norm(coefficients, shift, recomputed):
    """Two-point terms of one row per example (an MLP's layer: the Gram route is far cheaper) are normed by
    sum_ab c_a c_b <L_a L_b^T, R_a R_b^T>; where the coefficients cancel on nearly equal gradients the examples
    fall under the guard and are recomputed from their materialised combination: exact either way."""
    torch.manual_seed(0)
    left, right = torch.randn(64, 1, 96), torch.randn(64, 1, 40)
    near = Outer(left + shift * torch.randn_like(left), right + shift * torch.randn_like(right), 96, (96, 40))
    combination = Combination([(coefficients[0], near), (coefficients[1], Outer(left, right, 96, (96, 40)))])
    assert combination.by_ghost()
    exact = combination.materialize().double().flatten(1).square().sum(1)
    assert torch.allclose(sq_norms(combination).double(), exact, rtol=1e-5 if not recomputed else 1e-6, atol=0)
    _, cancelled = captures._combination_sq_norms(combination)
    assert bool(cancelled.all()) == recomputed and (recomputed or not bool(cancelled.any()))


def test_merged_one_hot_captures_equal_their_combination():
    torch.manual_seed(0)
    one = Outer(torch.randint(0, 5, (3, 6)), torch.randn(3, 6, 4), 5, (5, 4))
    two = Outer(torch.randint(0, 5, (3, 4)), torch.randn(3, 4, 4), 5, (5, 4))
    merged = coalesce([(43.0, one), (-42.0, two)])
    assert torch.allclose(merged.materialize(), 43.0 * one.materialize() - 42.0 * two.materialize(), atol=1e-4)
    rows = merged.left
    for i in range(3):  # distinct rows within each example, but for the zero padding
        real = rows[i][merged.right[i].abs().sum(1) > 0]
        assert real.unique().numel() == real.numel()


def test_a_negative_squared_norm_is_refused_not_turned_into_a_weight():
    with pytest.raises(FloatingPointError, match="negative"):
        Clipping(1.0).weights(torch.tensor([[1.0, 2.0], [-1e-9, 0.5]]), [0, 1])


@pytest.mark.parametrize("coefficients,benign", [((1e3, 1.0 - 1e3), None), ((0.86, 0.14), True)])
def test_large_combined_parameters_sum_exactly_or_by_book_keeping_as_their_terms_allow(coefficients, benign):
    """A combination too large to hold per chunk is normed in one pass and summed in another: from the
    difference form (``difference``) by book-keeping when the coefficients differ in sign (c = 1000: the
    parameter is then one capture), by book-keeping per term when the terms do not cancel (DiSK's default
    c = 0.86); one example's released share stays within the bound either way."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 600), torch.nn.Tanh(), torch.nn.Flatten(), torch.nn.Linear(2400, 3))
    engine = PerExampleEngine(model, lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1], reduction="none"))
    batch = (torch.randn(1, 4, 1024), torch.tensor([1]))
    near = [p.detach() + 1e-5 * torch.randn_like(p) for p in engine.params]
    a, b = coefficients
    stat = a * engine.gradients(batch, at=near) + b * engine.gradients(batch)
    bound = 1e-3 * float(sum(g.double().square().sum() for g in stat.materialize()).sqrt())
    sums, _ = clip_and_sum(stat, Clipping(bound))
    assert stat._benign.get(0) is benign and len(stat.terms[0]) == (1 if benign is None else 2)
    assert float(sum(s.double().square().sum() for s in sums).sqrt()) <= bound * (1 + 1e-6)


@pytest.mark.parametrize("coefficients", [(200.0, -199.0), (1e4, 1.0 - 1e4), (1.0, -0.08), (43.0, -42.0)])
def test_a_difference_form_equals_its_combination_and_its_ghost_norm_needs_no_recompute(coefficients):
    """c_a A + c_b B = (c_a + c_b) A + c_b (B - A) as one capture of 3T steps: on nearly equal gradients, where
    the two-term Gram route cancels and every example is recomputed, it is closer to the float64 combination
    of the same factors than the float32 combination of the materialised terms (3e-4 off at c_a = 200), and its
    own ghost norm is within 1e-5 of the float64 value with no example under the guard."""
    torch.manual_seed(0)
    left, right = torch.randn(64, 2, 96), torch.randn(64, 2, 40)
    near = Outer(left + 1e-4 * torch.randn_like(left), right + 1e-4 * torch.randn_like(right), 96, (96, 40))
    there = Outer(left, right, 96, (96, 40))
    (ca, cb), terms = coefficients, [(coefficients[0], near), (coefficients[1], there)]
    merged = captures.difference(terms)
    assert merged is not None and merged.steps == 6
    exact = sum(c * torch.einsum("bti,btj->bij", t.left.double(), t.right.double()) for c, t in terms)
    assert torch.allclose(merged.materialize().double(), exact, rtol=0, atol=1e-5)
    (sq,), (cancelled,) = captures._ghost_sq_norms([merged])
    assert not bool(cancelled.any())
    assert torch.allclose(sq.double(), exact.flatten(1).square().sum(1), rtol=1e-5, atol=0)
    assert captures.difference([(ca, near), (-cb, there)]) is None  # same signs: nothing cancels
    long = Outer(torch.randn(4, 65, 40), torch.randn(4, 65, 40), 40, (40, 40))  # a ViT-long sequence of small rows
    assert captures.by_materializing(Outer(torch.randn(4, 195, 40), torch.randn(4, 195, 40), 40, (40, 40)))
    assert captures.difference([(ca, long), (cb, long)]) is None  # its 3T steps would be materialised: not formed
