"""The one-call entry for a plain PyTorch loop: the caller's own forward, ``loss.backward()`` and
``optimizer.step()`` release exactly what ``PrivateStep.step`` releases."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import IterableDataset, TensorDataset

from dpopt.loop import make_private


def setup(physical=16, **kwargs):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    x, y = torch.randn(200, 6, dtype=torch.float64), torch.randint(0, 3, (200,))
    loss = lambda m, b: F.cross_entropy(m(b[0]), b[1], reduction="none")  # noqa: E731
    optimizer = kwargs.pop("optimizer", None) or torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.5)
    if isinstance(optimizer, str):  # a recipe's name
        optimizer, kwargs["algorithm"] = None, optimizer
    data = kwargs.pop("data", None) or (x, y)
    return make_private(model, optimizer, data, loss, batch_size=40, noise_multiplier=0.5, clip=0.1,
                        physical_batch_size=physical, secret_seed=0, **kwargs), loss


def run_loop(model, optimizer, batches, loss, epochs=2):
    for _ in range(epochs):
        for batch in batches:
            optimizer.zero_grad()
            loss(model, batch).mean().backward()
            optimizer.step()


def assert_same_run(model, optimizer, reference, reference_optimizer, steps):
    """The loop's run released what PrivateStep.step released: parameters, steps, ledger and epsilon."""
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.allclose(p, q, rtol=0, atol=1e-12)
    assert optimizer.dp.steps == reference_optimizer.dp.steps == steps
    assert optimizer.ledger.to_dict() == reference_optimizer.ledger.to_dict()
    assert optimizer.epsilon(1e-5) == reference_optimizer.epsilon(1e-5)


@pytest.mark.parametrize("physical", [16, None])
def test_the_plain_loop_equals_dpoptimizer_step(physical):
    (model, optimizer, batches), loss = setup(physical)
    run_loop(model, optimizer, batches, loss)
    (reference, dp_optimizer, reference_batches), _ = setup(physical)
    for _ in range(2 * len(reference_batches)):
        dp_optimizer.dp.step(reference_batches.data)
    assert_same_run(model, optimizer, reference, dp_optimizer, steps=10)


def test_a_map_style_dataset_and_a_recipe_name_train_the_same_way():
    (model, optimizer, batches), loss = setup(optimizer="dp-sgd")
    run_loop(model, optimizer, batches, loss, epochs=1)
    x, y = batches.data
    (other, optimizer2, batches2), _ = setup(optimizer="dp-sgd", data=TensorDataset(x, y))
    run_loop(other, optimizer2, batches2, loss, epochs=1)
    for p, q in zip(model.parameters(), other.parameters()):
        assert torch.allclose(p, q, rtol=0, atol=1e-12)


def test_bad_input_is_refused():
    model = nn.Linear(6, 3)
    loss = lambda m, b: F.cross_entropy(m(b[0]), b[1], reduction="none")  # noqa: E731
    data = (torch.randn(50, 6), torch.randint(0, 3, (50,)))
    with pytest.raises(ValueError, match="not the model's trainable parameters"):
        make_private(model, torch.optim.SGD(nn.Linear(6, 3).parameters(), lr=0.1), data, loss, batch_size=10,
                     noise_multiplier=1.0)

    class Stream(IterableDataset):
        def __iter__(self):
            yield from zip(*data)

    with pytest.raises(ValueError, match="no __len__"):
        make_private(model, None, Stream(), loss, algorithm="dp-sgd", batch_size=10, noise_multiplier=1.0)
    _, optimizer, batches = make_private(model, None, data, loss, algorithm="dp-sgd", batch_size=10,
                                         noise_multiplier=1.0)
    with pytest.raises(RuntimeError, match="without a batch"):
        optimizer.step()
    it = iter(batches)
    next(it)
    with pytest.raises(RuntimeError, match="loss.backward"):
        optimizer.step()
    next(it)
    with pytest.raises(RuntimeError, match="must follow every physical batch"):
        next(it)


@pytest.mark.parametrize("recipe", ["disk-sgd", "dp-srg-memf", "dpzero", "dp-sgd"])
def test_a_closure_loop_equals_dpoptimizer_step(recipe):
    """DiSK, SRG and zeroth-order evaluate the loss several times per step: ``optimizer.step(closure)`` lets
    their statistic call the caller's closure on each physical batch, and releases what ``PrivateStep.step``
    releases (a first-order recipe takes a closure too)."""
    (model, optimizer, batches), loss = setup(optimizer=recipe)
    start = [p.detach().clone() for p in model.parameters()]
    for batch in batches:
        losses = optimizer.step(lambda: loss(model, batch))
        assert losses.shape == (batch[0].shape[0],)
    (reference, dp_optimizer, reference_batches), _ = setup(optimizer=recipe)
    for _ in range(len(reference_batches)):
        dp_optimizer.dp.step(reference_batches.data)
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), start))
    assert_same_run(model, optimizer, reference, dp_optimizer, steps=5)


def test_a_recipe_that_evaluates_several_points_needs_a_closure():
    (model, optimizer, batches), loss = setup(optimizer="disk-sgd")
    batch = next(iter(batches))
    optimizer.zero_grad()
    loss(model, batch).mean().backward()
    with pytest.raises(RuntimeError, match="pass a closure"):
        optimizer.step()
    batch = next(iter(batches))
    with pytest.raises(ValueError, match="one loss per example"):
        optimizer.step(lambda: loss(model, batch).mean())


def test_every_layer_rule_and_the_fallback_record_the_callers_backward():
    """The zoo (embedding, convolutions, norms, a Linear used twice, a torch.func fallback module): one
    logical step through the plain loop releases what ``PrivateStep.step`` releases."""
    from helpers import Zoo, zoo_batch, zoo_loss

    def build():
        torch.manual_seed(0)
        model = Zoo().double()
        tokens, image, y = zoo_batch(24)
        data = (tokens, image.double(), y)
        return make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), data, zoo_loss, batch_size=12,
                            noise_multiplier=0.5, clip=0.1, physical_batch_size=5, secret_seed=1)

    model, optimizer, batches = build()
    it = iter(batches)
    while optimizer.dp.steps == 0:
        batch = next(it)
        optimizer.zero_grad()
        zoo_loss(model, batch).mean().backward()
        optimizer.step()
    reference, dp_optimizer, reference_batches = build()
    dp_optimizer.dp.step(reference_batches.data)
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.allclose(p, q, rtol=0, atol=1e-12)


def test_saving_and_resuming_take_two_lines_and_go_on_exactly(tmp_path):
    x, y = torch.randn(200, 6, dtype=torch.float64), torch.randint(0, 3, (200,))
    loss = lambda m, b: F.cross_entropy(m(b[0]), b[1], reduction="none")  # noqa: E731

    def fresh():  # the default key: OS entropy
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()
        return make_private(model, torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.5), (x, y), loss,
                            batch_size=40, noise_multiplier=0.5, clip=0.1, physical_batch_size=16)

    def train(model, optimizer, batches, save_at=None):
        for _ in range(optimizer.dp.steps // len(batches), 2):
            for batch in batches:
                optimizer.zero_grad()
                loss(model, batch).mean().backward()
                optimizer.step()
                if optimizer._sums is not None:  # between two physical batches of one logical step: refused
                    with pytest.raises(RuntimeError, match="between logical steps"):
                        optimizer.state_dict()
                elif optimizer.dp.steps == save_at and not (tmp_path / "ckpt.pt").exists():
                    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, tmp_path / "ckpt.pt")

    model, optimizer, batches = fresh()
    train(model, optimizer, batches, save_at=7)  # saved in the second epoch, then on to the end
    resumed, optimizer2, batches2 = fresh()
    checkpoint = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    resumed.load_state_dict(checkpoint["model"])
    optimizer2.load_state_dict(checkpoint["optimizer"])  # the run's own key and ledger
    assert optimizer2.dp.steps == 7 and isinstance(checkpoint["optimizer"]["secret_key"], bytes)
    train(resumed, optimizer2, batches2)
    for p, q in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(p, q)
    assert optimizer2.ledger.to_dict() == optimizer.ledger.to_dict() and optimizer2.dp.steps == 10
    assert "epsilon" in optimizer2.statement(1e-5) and "OS entropy" in optimizer2.statement(1e-5)
    with pytest.raises(RuntimeError, match="before its first step"):
        optimizer.load_state_dict(checkpoint["optimizer"])
