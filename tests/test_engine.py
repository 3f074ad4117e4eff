"""The per-example engine: the hook path agrees with torch.func, combinations are exact, misuse is refused."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpopt.clipping import Clipping
from dpopt.grad import ExampleMixingError, PerExampleEngine, captures, check_per_example
from dpopt.grad import gradients as gradients_module
from dpopt.data.datasets import Dataset
from dpopt.models import build_model, freeze_batchnorm, replace_batchnorm
from helpers import Zoo, mlp_loss, zoo_batch, zoo_loss


def rel(a, b):
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


@pytest.mark.parametrize("strategy", ["auto", "materialize", "ghost"])
def test_hooks_agree_with_vmap(strategy):
    model, batch = Zoo(), zoo_batch()
    hooks = PerExampleEngine(model, zoo_loss, "hooks", strategy).gradients(batch)
    ref = PerExampleEngine(model, zoo_loss, "vmap").gradients(batch)
    for name, a, b in zip(hooks.engine.names, hooks.materialize(), ref.materialize()):
        assert rel(a, b) <= 1e-5, name
    assert rel(hooks.sq_norms(), ref.sq_norms()) <= 1e-5
    w = torch.rand(5)
    for a, b in zip(hooks.weighted_sum(w), ref.weighted_sum(w)):
        assert rel(a, b) <= 1e-5
    assert torch.allclose(hooks.losses, ref.losses)


@pytest.mark.parametrize("strategy", ["auto", "materialize", "ghost"])
def test_weighted_sum_with_release_is_the_same_sum_and_spends_the_gradients(strategy):
    """release=True (the private step's use) frees each parameter's captures once summed: same sums, then
    any further use of the object is refused instead of silently seeing no gradients."""
    model, batch = Zoo(), zoo_batch()
    engine = PerExampleEngine(model, zoo_loss, "hooks", strategy)
    w = torch.rand(5)
    kept = engine.gradients(batch).weighted_sum(w)
    spent = engine.gradients(batch)
    for a, b in zip(kept, spent.weighted_sum(w, release=True)):
        assert torch.equal(a, b)
    assert all(ts == [] for ts in spent.terms)
    for use in (spent.sq_norms, spent.materialize, lambda: spent.weighted_sum(w), lambda: spent + spent):
        with pytest.raises(RuntimeError, match="released"):
            use()


@pytest.mark.parametrize("mode", ["flat", "per-layer", "automatic"])
def test_clipped_sum_weighs_chunks_of_examples_to_the_two_pass_sum(mode, monkeypatch):
    """The clip stage's one pass (convolution gradients materialised a chunk of examples at a time, weighed
    and summed at once) gives the sums of the two-pass route (all norms, then one weighted sum), for one
    point and for a two-point combination."""
    monkeypatch.setattr(gradients_module, "chunks", lambda batch, per_example, device, at_least=1: [
        slice(i, i + 1) for i in range(batch)])
    model, batch = Zoo(), zoo_batch(7)
    engine = PerExampleEngine(model, zoo_loss)
    clipping = Clipping(1e-2, mode)
    shifted = [p.detach() + 0.1 * torch.randn_like(p) for p in engine.params]
    for make in (lambda: engine.gradients(batch),
                 lambda: 0.7 * engine.gradients(batch, at=shifted) + 0.3 * engine.gradients(batch)):
        two_pass = make()
        expected = two_pass.weighted_sum(clipping.weights(two_pass.sq_norms(), engine.groups)[0])
        rows = []

        def weigh(sq_norms):
            rows.append(sq_norms.shape[0])
            return clipping.weights(sq_norms, engine.groups)[0]

        spent = make()
        got = spent.clipped_sum(weigh, release=True)
        assert rows == [1] * 7
        assert all(ts == [] for ts in spent.terms)
        with pytest.raises(RuntimeError, match="released by weighted_sum or clipped_sum"):
            spent.sq_norms()
        for name, a, b in zip(engine.names, got, expected):
            assert a.shape == b.shape and rel(a, b) <= 1e-5, name


def test_an_accelerator_forms_the_clip_stage_in_larger_chunks_than_a_cpu():
    """A CPU's chunks are cache-sized; an accelerator's hold 16x more, so a batch the CPU splits is one chunk
    there (fewer kernel launches per step; the sums do not depend on the split: the test above). Both cover
    every example once, in order."""
    cpu, gpu = torch.device("cpu"), torch.device("cuda")  # a device name needs no device
    assert captures.chunk_elements(cpu) == captures.CHUNK_ELEMENTS
    assert captures.chunk_elements(gpu) == 16 * captures.CHUNK_ELEMENTS
    per_example = 16384  # what the clip stage asks per example of the bench's Tanh CNN (dpopt bench --workload cnn)
    split, whole = captures.chunks(1024, per_example, cpu), captures.chunks(1024, per_example, gpu)
    assert len(split) > 1 and len(whole) == 1
    # the one-pass clip of materialised parameters takes at least DIRECT_ROWS examples a chunk (vit-tiny's
    # two-point step asks 2^19 elements an example: 2 examples a chunk without the floor)
    floored = captures.chunks(1024, 1 << 19, cpu, gradients_module.DIRECT_ROWS)
    assert len(captures.chunks(1024, 1 << 19, cpu)) == 512 and len(floored) == 1024 // gradients_module.DIRECT_ROWS
    for parts in (split, whole, floored):
        assert [i for s in parts for i in range(s.start, s.stop)] == list(range(1024))


@pytest.mark.parametrize("cin, kernel, stride, padding, dilation, groups, hw, by_phase", [
    (1, (8, 8), (2, 2), (3, 3), (1, 1), 1, (28, 28), True),  # the Tanh CNN's first layer
    (1, (6, 4), (3, 2), (1, 2), (1, 1), 1, (17, 18), True),  # odd padded sizes: padded to whole phases
    (3, (3, 3), (1, 1), (1, 1), (1, 1), 1, (12, 13), True),
    (2, (2, 2), (2, 2), (0, 1), (1, 1), 2, (9, 20), True),
    (2, (1, 4), (1, 2), (0, 1), (1, 1), 1, (1, 30), True),  # a Conv1d, as the rule sees it
    (16, (4, 4), (2, 2), (0, 0), (1, 1), 1, (13, 13), False),  # the second layer: channels-last
    (1, (3, 3), (2, 2), (1, 1), (1, 1), 1, (16, 16), False),  # the stride does not divide the kernel
    (2, (3, 3), (1, 1), (2, 2), (2, 2), 1, (9, 9), False),
])
def test_conv_gradients_in_either_patch_layout(cin, kernel, stride, padding, dilation, groups, hw, by_phase):
    """Materialised convolution gradients, from patches copied by phase or channels-last, are each
    example's weight gradient, and a weighted sum in ``flat``'s order maps back with ``unflat``."""
    x = torch.randn(3, cin, *hw)
    conv = nn.Conv2d(cin, 4, kernel, stride, padding, dilation, groups)
    g = torch.randn_like(conv(x))
    cap = captures.ConvOuter(x, g, kernel, stride, dilation, padding, groups, conv.weight.shape)
    assert cap.by_phase == by_phase
    each = torch.stack([torch.nn.grad.conv2d_weight(x[i:i + 1], conv.weight.shape, g[i:i + 1], stride, padding,
                                                    dilation, groups) for i in range(3)])
    assert rel(cap.materialize(), each) <= 1e-5
    w = torch.rand(3)
    assert rel(cap.unflat(torch.tensordot(w, cap.flat(), dims=1)), torch.tensordot(w, each, dims=1)) <= 1e-5


class _ConvTwice(nn.Module):
    """One convolution on two image sizes: wide rows take the phase layout, narrow ones channels-last."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.head = nn.Conv2d(4, 4, 2, stride=2), nn.Linear(8, 3)

    def forward(self, images):
        return self.head(torch.cat([self.conv(x).mean((2, 3)) for x in images], 1))


@pytest.mark.parametrize("mode", ["flat", "per-layer"])
def test_one_convolution_in_both_patch_layouts_sums_in_one_order(mode):
    """A parameter whose captures flatten in different element orders is combined in its own shape: norms
    and clipped sums match torch.func (they were wrong when the two layouts' flat gradients were added)."""
    def loss(m, b):
        return F.cross_entropy(m(b[:2]), b[2], reduction="none")

    model, batch = _ConvTwice(), (torch.randn(5, 4, 32, 32), torch.randn(5, 4, 6, 6), torch.randint(0, 3, (5,)))
    hooks = PerExampleEngine(model, loss, "hooks", "ghost").gradients(batch)
    assert sorted(t.by_phase for _, t in hooks.terms[0]) == [False, True]
    ref = PerExampleEngine(model, loss, "vmap").gradients(batch)
    assert rel(hooks.sq_norms(), ref.sq_norms()) <= 1e-5
    clipping = Clipping(1e-2, mode)
    got = hooks.clipped_sum(lambda sq: clipping.weights(sq, hooks.groups)[0])
    expected = ref.weighted_sum(clipping.weights(ref.sq_norms(), ref.groups)[0])
    for name, a, b in zip(hooks.engine.names, got, expected):
        assert rel(a, b) <= 1e-5, name


def test_vmap_agrees_with_one_example_at_a_time():
    model, batch = Zoo(), zoo_batch(3)
    per_example = PerExampleEngine(model, zoo_loss, "vmap").gradients(batch).materialize()
    for i in range(3):
        model.zero_grad()
        zoo_loss(model, tuple(t[i:i + 1] for t in batch)).sum().backward()
        for p, g in zip([p for p in model.parameters() if p.requires_grad], per_example):
            assert rel(g[i], p.grad) <= 1e-5


def test_every_strategy_captures_the_expected_forms():
    model, batch = Zoo(), zoo_batch()
    kinds = lambda s: {n: type(t[0][1]).__name__.replace("ConvOuter", "Outer") for n, t in  # noqa: E731
                       zip(PerExampleEngine(model, zoo_loss, "hooks", s).names,
                           PerExampleEngine(model, zoo_loss, "hooks", s).gradients(batch).terms)}
    assert kinds("ghost")["conv2d.weight"] == "Outer" and kinds("materialize")["conv2d.weight"] == "Dense"
    assert kinds("auto")["emb.weight"] == "Outer"  # never materialise an embedding table per example


def test_linear_combination_at_two_points():
    """c*g(x + delta) + (1 - c)*g(x): norms (cross terms included) and sums without materialising."""
    model, batch = Zoo(), zoo_batch()
    engine = PerExampleEngine(model, zoo_loss, "hooks", "ghost")
    ref = PerExampleEngine(model, zoo_loss, "vmap")
    shifted = [p.detach() + 0.1 * torch.randn_like(p) for p in engine.params]
    before = [p.detach().clone() for p in engine.params]
    c = 2.5
    combo = c * engine.gradients(batch, at=shifted) + (1 - c) * engine.gradients(batch)
    expected = [c * a + (1 - c) * b for a, b in zip(ref.gradients(batch, at=shifted).materialize(),
                                                     ref.gradients(batch).materialize())]
    norms = torch.stack([e.flatten(1).square().sum(1) for e in expected], 1)
    assert rel(combo.sq_norms(), norms) <= 1e-5
    w = torch.rand(5)
    for got, e in zip(combo.weighted_sum(w), expected):
        assert rel(got, torch.tensordot(w, e, dims=1)) <= 1e-5
    assert all(torch.equal(p, q) for p, q in zip(engine.params, before)), "evaluating at a point must not move it"


def test_difference_is_zero_at_the_same_point():
    model, batch = Zoo(), zoo_batch()
    engine = PerExampleEngine(model, zoo_loss)
    diff = engine.gradients(batch) - engine.gradients(batch)
    assert diff.sq_norms().abs().max() <= 1e-8


def test_tied_weights():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(11, 6)
            self.out = nn.Linear(6, 11, bias=False)
            self.out.weight = self.emb.weight

        def forward(self, x):
            return self.out(torch.tanh(self.emb(x))).mean(1)

    model = Tied()
    batch = (torch.randint(0, 11, (4, 5)), torch.randint(0, 11, (4,)))
    hooks = PerExampleEngine(model, mlp_loss, "hooks", "ghost").gradients(batch)
    ref = PerExampleEngine(model, mlp_loss, "vmap").gradients(batch)
    assert len(hooks.engine.params) == 1 and len(hooks.terms[0]) == 2
    assert rel(hooks.sq_norms(), ref.sq_norms()) <= 1e-5
    assert rel(hooks.materialize()[0], ref.materialize()[0]) <= 1e-5


def test_frozen_parameters_are_skipped():
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    model[0].weight.requires_grad_(False)
    engine = PerExampleEngine(model, mlp_loss)
    assert engine.names == ["0.bias", "2.weight", "2.bias"]
    batch = (torch.randn(3, 4), torch.randint(0, 2, (3,)))
    ref = PerExampleEngine(model, mlp_loss, "vmap").gradients(batch)
    assert rel(engine.gradients(batch).sq_norms(), ref.sq_norms()) <= 1e-5


def test_in_place_change_of_a_captured_activation_is_refused():
    class Sneaky(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

        def forward(self, x):
            h = self.a(x)
            out = self.b(h)
            h.add_(1.0)  # after b used h: the activation b's gradient needs is gone
            return out

    model = Sneaky()
    batch = (torch.randn(3, 4), torch.randint(0, 2, (3,)))
    with pytest.raises(RuntimeError, match="modified in place"):
        PerExampleEngine(model, mlp_loss, strategy="ghost").gradients(batch).sq_norms()


def test_loss_must_be_per_example():
    model = nn.Linear(4, 2)
    batch = (torch.randn(3, 4), torch.randint(0, 2, (3,)))
    with pytest.raises(ValueError, match="one loss per example"):
        PerExampleEngine(model, lambda m, b: F.cross_entropy(m(b[0]), b[1])).gradients(batch)


def test_no_trainable_parameters():
    model = nn.Linear(4, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        PerExampleEngine(model, mlp_loss)


def test_batchnorm_is_refused_with_its_name_and_fixes_work():
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4 * 6 * 6, 2))
    batch = (torch.randn(6, 1, 8, 8), torch.randint(0, 2, (6,)))
    with pytest.raises(ExampleMixingError, match=r"'1' \(BatchNorm2d\).*GroupNorm"):
        PerExampleEngine(model, mlp_loss).gradients(batch)
    grouped = replace_batchnorm(model, groups=2)
    PerExampleEngine(grouped, mlp_loss).gradients(batch)
    frozen = freeze_batchnorm(nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(144, 2)))
    PerExampleEngine(frozen, mlp_loss).gradients(batch)


def test_probe_catches_a_loss_that_mixes_examples():
    model = nn.Linear(4, 2)
    batch = (torch.randn(6, 4), torch.randint(0, 2, (6,)))

    def batch_normalised(m, b):
        losses = F.cross_entropy(m(b[0]), b[1], reduction="none")
        return losses / losses.sum()

    with pytest.raises(ExampleMixingError, match="the loss function mixes"):
        check_per_example(model, batch_normalised, batch)
    check_per_example(model, mlp_loss, batch)  # a per-example loss passes


class BatchCentred(nn.Module):
    """Subtracts the batch mean: one example moves every other example's output."""

    def forward(self, x):
        return x - x.mean(0, keepdim=True)


def test_a_module_that_mixes_examples_is_named_before_any_private_step():
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), BatchCentred(), nn.Linear(6, 2))
    batch = (torch.randn(6, 4), torch.randint(0, 2, (6,)))
    with pytest.raises(ExampleMixingError, match=r"layer '2' \(BatchCentred\).*GroupNorm"):
        check_per_example(model, mlp_loss, batch)
    with pytest.raises(ExampleMixingError, match=r"'2' \(BatchCentred\)"):  # the engine's first-batch check
        PerExampleEngine(model, mlp_loss).verify(batch)


def test_unknown_mode_and_strategy():
    with pytest.raises(ValueError, match="hooks, vmap"):
        PerExampleEngine(nn.Linear(2, 2), mlp_loss, mode="magic")
    with pytest.raises(ValueError, match="auto, materialize, ghost"):
        PerExampleEngine(nn.Linear(2, 2), mlp_loss, strategy="magic")


@pytest.mark.parametrize("strategy", ["materialize", "ghost"])
def test_the_channels_last_cnn_has_the_per_example_gradients_of_its_channels_first_copy(strategy):
    """models.cnn runs channels-last (PyTorch's faster CPU max-pool): its activations stay channels-last, and its
    per-example norms and clipped sums are those of the same weights laid out channels-first."""
    torch.manual_seed(0)
    data = Dataset("fake", (torch.zeros(2, 1, 28, 28), torch.zeros(2, dtype=torch.long)), None, 10)
    last = build_model("cnn", data)
    first = copy.deepcopy(last).to(memory_format=torch.contiguous_format)
    batch = (torch.randn(6, 1, 28, 28), torch.randint(0, 10, (6,)))
    assert last[:3](batch[0]).is_contiguous(memory_format=torch.channels_last)
    assert not first[:3](batch[0]).is_contiguous(memory_format=torch.channels_last)
    loss = lambda m, b: F.cross_entropy(m(b[0]), b[1], reduction="none")  # noqa: E731
    a = PerExampleEngine(last, loss, "hooks", strategy).gradients(batch)
    b = PerExampleEngine(first, loss, "hooks", strategy).gradients(batch)
    assert rel(a.sq_norms(), b.sq_norms()) <= 1e-5
    w = torch.rand(6)
    for x, y in zip(a.weighted_sum(w), b.weighted_sum(w)):
        assert rel(x, y) <= 1e-5
