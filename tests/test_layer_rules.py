"""A user's own layer gets a hook rule through ``register_rule``; the attribution check covers it."""

import pytest
import torch
from torch import nn

from dpopt.grad import Dense, ExampleMixingError, PerExampleEngine, register_rule
from dpopt.grad.rules import RULES, TOKENWISE
from helpers import mlp_loss


class Gate(nn.Module):
    """y = x * w, elementwise over the last dimension."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(dim))

    def forward(self, x):
        return x * self.weight


def model_and_batch():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), Gate(6), nn.Tanh(), nn.Flatten(), nn.Linear(18, 3))
    return model, (torch.randn(5, 3, 4), torch.randint(0, 3, (5,)))


@pytest.fixture
def registered():
    """Registers ``rule`` for Gate for one test, and removes it afterwards."""
    rules = []

    def register(rule):
        rules.append(register_rule(Gate, tokenwise=True)(rule))

    yield register
    RULES.pop(Gate, None)
    TOKENWISE.difference_update(rules)


def test_a_registered_rule_is_used_and_matches_torch_func(registered):
    registered(lambda module, x, g, wanted: {"weight": Dense((x * g).sum(1), module.weight.shape)})
    model, batch = model_and_batch()
    engine = PerExampleEngine(model, mlp_loss)
    assert [u.rule is not None for u in engine.units] == [True, True, True]
    hooks = engine.gradients(batch).materialize()
    reference = PerExampleEngine(model, mlp_loss, mode="vmap").gradients(batch).materialize()
    for a, b in zip(hooks, reference):
        assert torch.allclose(a, b, atol=1e-6)
    engine.verify(batch)


def test_a_wrong_registered_rule_is_refused_by_the_attribution_check(registered):
    """A rule that hands each example its neighbour's gradient (rolled by one) never reaches a release."""
    registered(lambda module, x, g, wanted: {"weight": Dense((x * g).sum(1).roll(1, 0), module.weight.shape)})
    model, batch = model_and_batch()
    with pytest.raises(ExampleMixingError, match="'1'"):
        PerExampleEngine(model, mlp_loss).verify(batch)
