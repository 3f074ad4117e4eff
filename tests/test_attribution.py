"""Issue 20: model layouts whose gradients hooks would attribute to the wrong example are computed
correctly or refused naming the layer, and no private release happens before attribution is verified on 3
distinct examples, whatever the size of the first sampled batch."""

import pytest
import torch
from torch import nn

from dpopt.algorithms import SGD, Privatizer, build_algorithm
from dpopt.clipping import Clipping
from dpopt.data.samplers import PoissonSampler, distinct_examples
from dpopt.grad import PerExampleEngine, check_per_example
from dpopt.noise.gaussian import GaussianNoise
from dpopt.noise.rng import SecretStream
from dpopt.privacy import PrivacyLedger
from helpers import mlp_loss
from test_shared_layouts import D, V, HandTied, Positions, SequenceFirst, SharedBuffer


class Scaled(nn.Module):
    """No layer rule (torch.func fallback), calling a Linear that is registered at the root as well."""

    def __init__(self, lin: nn.Linear) -> None:
        super().__init__()
        self.lin, self.scale = lin, nn.Parameter(torch.randn(D))

    def forward(self, x):
        return torch.tanh(self.lin(x) * self.scale)


class RegisteredTwice(nn.Module):
    def __init__(self, t: int) -> None:
        super().__init__()
        lin = nn.Linear(D, D)
        self.inner, self.lin, self.head = Scaled(lin), lin, nn.Linear(D, 2)

    def forward(self, x):
        return self.head(self.inner(x) + self.lin(x)).mean(1)


def data(model: nn.Module, n: int, t: int):
    x = torch.randint(0, V, (n, t)) if isinstance(model, (Positions, HandTied)) else torch.randn(n, t, D)
    return x, torch.randint(0, 2, (n,))


# (model, T, the layer hooks cannot attribute); T is a multiple of 3 where a multiple of the batch size would let
# hooks regroup the rows silently. Each is now routed to torch.func over the model (tests/test_shared_layouts.py).
LAYOUTS = {
    "wpe(arange(T))": (lambda: Positions(6), 6, "wpe"),
    "Linear on [T, B, d]": (lambda: SequenceFirst("linear"), 6, "seq"),
    "Linear on [T*B, d] rows": (lambda: SequenceFirst("rows"), 6, "seq"),
    "MultiheadAttention on [T, B, d]": (lambda: SequenceFirst("attention"), 6, "seq"),
    "LSTM on [T, B, d]": (lambda: SequenceFirst("lstm"), 5, "seq"),
    "MultiheadAttention on [T, B, d], T = B": (lambda: SequenceFirst("attention"), 3, "seq"),
    "LSTM on [T, B, d], T = B": (lambda: SequenceFirst("lstm"), 3, "seq"),
    "[1, T, d] buffer, output[0]": (lambda: SharedBuffer(6), 6, "pos"),
    "F.linear(h, self.emb.weight)": (lambda: HandTied(6), 6, "emb"),
}


def routed(engine: PerExampleEngine) -> set[str]:
    """The top-level layers whose parameters the engine takes with torch.func over a module around them."""
    return {engine.names[i].split(".")[0] for held in engine.routes.values() for i in held}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_layout_hooks_cannot_attribute_is_routed_to_torch_func_not_refused(layout):
    build, t, layer = LAYOUTS[layout]
    torch.manual_seed(0)
    model = build()
    engine = PerExampleEngine(model, mlp_loss)
    engine.verify(data(model, 3, t))
    assert routed(engine) == {layer}


def test_a_torch_func_module_whose_output_is_not_batch_first_is_refused_on_every_call():
    model = SequenceFirst("lstm")
    with pytest.raises(ValueError, match=r"layer 'seq' \(LSTM\) .* output 0 has shape \(5, 2, 4\)"):
        PerExampleEngine(model, mlp_loss).gradients(data(model, 2, 5))


@pytest.mark.parametrize("mode", ["hooks", "vmap"])
def test_a_linear_inside_a_torch_func_module_and_at_the_root_is_counted_once_and_left_trainable(mode):
    torch.manual_seed(0)
    model, batch = RegisteredTwice(5), data(RegisteredTwice(5), 4, 5)
    got = PerExampleEngine(model, mlp_loss, mode).gradients(batch).materialize()
    assert all(p.requires_grad and isinstance(p, nn.Parameter) for p in model.parameters())
    assert model.lin.weight is model.inner.lin.weight
    params = list(model.parameters())
    ref = [torch.stack(g) for g in zip(*(torch.autograd.grad(mlp_loss(model, (batch[0][k:k + 1], batch[1][k:k + 1]))
                                                            .sum(), params) for k in range(4)))]
    for name, a, b in zip(PerExampleEngine(model, mlp_loss).names, got, ref):
        assert torch.allclose(a, b, atol=1e-6), name
    PerExampleEngine(model, mlp_loss).verify(data(model, 3, 5))


def privately_trained(model: nn.Module, t: int, seed: int):
    """A DP-SGD optimizer on 12 examples whose first Poisson batch (seed 0: 1 example, 1: 2) is too small for
    the old first-batch check."""
    sampler = PoissonSampler(12, 0.1, SecretStream(seed, "sampling"))
    assert 0 < len(sampler.batch(0)) < 3
    privatizer = Privatizer(Clipping(1.0), GaussianNoise(1.0, 1.0, SecretStream(0, "noise")), sampler,
                            PrivacyLedger())
    return build_algorithm("dp-sgd", PerExampleEngine(model, mlp_loss), privatizer, SGD(lr=0.1)), \
        data(model, 12, t)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_attribution_is_verified_before_the_first_release_whatever_the_first_batch(layout, seed):
    """The probe: each layout trained through a PrivateStep with a first Poisson batch of 1 or 2 examples is found on
    3 examples of the verifier's choosing, routed to torch.func, then released (refusals: test_shared_layouts)."""
    build, t, layer = LAYOUTS[layout]
    torch.manual_seed(0)
    model = build()
    opt, dataset = privately_trained(model, t, seed)
    opt.step(dataset)
    assert opt.verified and opt.privatizer.ledger.steps == 1 and routed(opt.engine) == {layer}


def test_a_correct_model_is_verified_on_three_examples_of_its_own_choosing_then_trains():
    model = nn.Sequential(nn.Linear(D, D), nn.Tanh(), nn.Linear(D, 2))
    opt, (x, y) = privately_trained(model, 1, 0)
    x = x.squeeze(1)
    x[1:4], y[1:4] = x[0], y[0]  # duplicates are skipped: verified on examples 0, 4, 5
    assert torch.equal(distinct_examples((x, y), 12)[0], x[[0, 4, 5]])
    opt.step((x, y))
    assert opt.verified and opt.privatizer.ledger.steps == 1


def test_fewer_than_three_distinct_examples_are_refused_before_any_release():
    model = nn.Sequential(nn.Linear(D, 2))
    opt, (x, y) = privately_trained(model, 1, 0)
    x, y = x.squeeze(1), torch.zeros_like(y)
    x[2:] = x[1]
    with pytest.raises(ValueError, match="the first 12 examples of the dataset hold 2 distinct examples"):
        opt.step((x, y))
    assert opt.privatizer.ledger.steps == 0


def test_checks_on_fewer_than_three_examples_refuse_instead_of_passing():
    model, batch = nn.Linear(D, 2), (torch.randn(2, D), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="needs at least 3 examples, got 2"):
        check_per_example(model, mlp_loss, batch)
    with pytest.raises(ValueError, match="at least 3 examples, and the batch holds 2"):
        PerExampleEngine(model, mlp_loss).verify(batch)
