"""Learning-rate schedules: the factors, the rate each update uses in every entry point, DiSK's parameter change
under a schedule, exact resume, the Trainer's own schedulers, and bad input."""

import math

import pytest
import torch
from torch import nn

from dpopt import make_private
from dpopt.algorithms import DiSKSGD, Privatizer, build_algorithm
from dpopt.cli import main
from dpopt.clipping import Clipping
from dpopt.data.samplers import FixedOrderSampler
from dpopt.grad.engine import PerExampleEngine
from dpopt.noise.gaussian import GaussianNoise
from dpopt.noise.rng import SecretStream
from dpopt.privacy import PrivacyLedger
from dpopt.run import TrainConfig, resume
from dpopt.schedules import Schedule
from helpers import mlp_loss, train_keeping_epoch_one


def problem(n: int = 40):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)), (torch.randn(n, 6), torch.randint(0, 3, (n,)))


def test_the_factors():
    steps = 20
    warm = [Schedule("cosine", 0.2).factor(t, steps) for t in range(steps)]
    assert warm[:4] == pytest.approx([0.2, 0.4, 0.6, 0.8]) and warm[4] == 1.0  # 4 warm-up steps, then the peak
    assert warm[12] == pytest.approx(0.5 * (1 + math.cos(math.pi * 8 / 16)))
    assert Schedule("linear", 3).factor(19, steps) == pytest.approx(1 / 17)  # decays towards 0 at the end
    assert all(Schedule().factor(t, steps) == 1.0 for t in range(steps)) and Schedule().is_constant


def test_each_update_uses_the_scheduled_rate_in_make_private():
    """A recipe chosen by name follows its schedule; a torch optimizer takes a torch scheduler instead."""
    model, data = problem()
    _, optimizer, batches = make_private(model, None, data, mlp_loss, algorithm="dp-sgd", batch_size=10,
                                         noise_multiplier=1.0, epochs=2, lr_schedule="cosine", warmup=0.25,
                                         hyperparameters={"lr": 0.4}, secret_seed=0)
    schedule, seen = Schedule("cosine", 0.25), []
    for _ in range(2):
        for batch in batches:
            optimizer.zero_grad()
            mlp_loss(model, batch).mean().backward()
            optimizer.step()
            seen.append(optimizer.dp.base.param_groups[0]["lr"])
    assert seen == pytest.approx([0.4 * schedule.factor(t, len(seen)) for t in range(len(seen))])
    with pytest.raises(ValueError, match="attach a torch.optim.lr_scheduler"):
        make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), data, mlp_loss, batch_size=10,
                     noise_multiplier=1.0, lr_schedule="cosine")


def test_a_torch_scheduler_on_the_users_optimizer_drives_the_private_update():
    model, data = problem()
    sgd = torch.optim.SGD(model.parameters(), lr=0.4)
    schedule = torch.optim.lr_scheduler.StepLR(sgd, step_size=1, gamma=0.5)
    _, optimizer, batches = make_private(model, sgd, data, mlp_loss, batch_size=10, noise_multiplier=1.0,
                                         secret_seed=0)
    seen = []
    for batch in batches:
        before = [p.detach().clone() for p in model.parameters()]
        optimizer.zero_grad()
        mlp_loss(model, batch).mean().backward()
        optimizer.step()
        seen.append(sgd.param_groups[0]["lr"])
        assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
        schedule.step()
    assert seen == pytest.approx([0.4 * 0.5 ** t for t in range(len(seen))])
    assert optimizer.param_groups is sgd.param_groups


def test_disk_filters_with_the_actual_parameter_change_under_a_schedule():
    """DiSK's d_t is x_t+1 - x_t as the scheduled update made it (the spec's pitfall 3), not lr * g~."""
    model, data = problem()
    sampler = FixedOrderSampler(40, 10, SecretStream(0, "sampling"))
    privatizer = Privatizer(Clipping(1.0), GaussianNoise(1.0, 1.0, SecretStream(0, "noise")), sampler,
                            PrivacyLedger())
    opt = build_algorithm("disk-sgd", PerExampleEngine(model, mlp_loss), privatizer, DiSKSGD(lr=0.3))
    opt.schedule = lambda t: 0.5 ** t
    for _ in range(3):
        before = [p.detach().clone() for p in model.parameters()]
        opt.step(data)
        kalman = opt.transforms[0]
        for d, p, b in zip(kalman.delta, model.parameters(), before):
            torch.testing.assert_close(d, p.detach() - b, rtol=0, atol=1e-7)
    assert opt.base.param_groups[0]["lr"] == pytest.approx(0.3 * 0.25)


def test_a_scheduled_run_resumes_exactly_and_is_not_extended(tmp_path):
    config = TrainConfig(algorithm="dp-adam", model="logreg", epochs=2, batch_size=256, noise_multiplier=1.0,
                         lr_schedule="cosine", warmup=0.1, secret_seed=0)
    full = train_keeping_epoch_one(config, tmp_path / "full", tmp_path / "cut")
    resumed = resume(tmp_path / "cut", progress=False, log=lambda _: None)
    assert resumed["history"][-1] == full["history"][-1] and resumed["ledger"] == full["ledger"]
    with pytest.raises(ValueError, match="learning-rate schedule .* cannot be extended"):
        resume(tmp_path / "cut", progress=False, log=lambda _: None, epochs=3)


@pytest.mark.parametrize("argv,message", [
    (["--lr-schedule", "step"], "argument --lr-schedule: invalid choice 'step'"),
    (["--warmup", "-1"], "the warm-up must be a fraction of the run in [0, 1) or a number of steps >= 1"),
    (["--warmup", "5000"], "the warm-up (5000 steps) must be shorter than the run"),
])
def test_bad_schedules_are_one_line(argv, message, capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        main(["train", "--epochs", "1", "--no-progress", "--out", str(tmp_path), *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and len(err.strip().splitlines()) <= 2


def test_the_trainers_own_scheduler_drives_the_private_update(tmp_path, monkeypatch):
    """PrivateTrainer keeps the Trainer's schedulers: its linear decay reaches a recipe's own update (DP-GRAPE)."""
    pytest.importorskip("transformers")
    from test_hf_trainer import arguments, as_list, examples, tiny_bert

    from dpopt.algorithms import PrivateStep
    from dpopt.hf import PrivacyArguments, PrivateTrainer
    seen, apply = [], PrivateStep.apply
    monkeypatch.setattr(PrivateStep, "apply", lambda self, g: (seen.append(self.base.lr), apply(self, g)))
    PrivateTrainer(tiny_bert(), arguments(tmp_path, max_steps=3, lr_scheduler_type="linear"),
                   train_dataset=as_list(examples()),
                   privacy=PrivacyArguments(algorithm="dp-grape", noise_multiplier=1.0, batch_size=8, secret_seed=0,
                                            hyperparameters={"rank": 4})).train()
    assert len(seen) == 3 and seen[0] > seen[1] > seen[2] > 0
