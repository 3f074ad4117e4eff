"""One public vocabulary: the names users call are exported from the top level, a recipe is chosen by
``algorithm=`` with a typed config of its family, a setting that does not apply is refused naming where it
applies, old names get a one-line error naming the new one, and how the target is given (an epsilon or a noise
multiplier) never changes the mechanism."""

import importlib.metadata
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dpopt
from dpopt.algorithms import ALGORITHMS, CONFIGS, applies_to, hyperparameters_for
from dpopt.cli import main
from dpopt.data.samplers import CyclicPoissonSampler
from dpopt.noise.correlated import CorrelatedNoise
from dpopt.plan import PrivacyPlan

N = 60


def problem():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))
    data = (torch.randn(N, 4), torch.randint(0, 2, (N,)))
    loss = lambda m, b: F.cross_entropy(m(b[0]), b[1], reduction="none")  # noqa: E731
    return model, data, loss


def test_the_top_level_exports_what_users_call():
    assert dpopt.__version__ == importlib.metadata.version("dpopt")
    for name in dpopt.__all__:
        assert getattr(dpopt, name) is not None
    assert dpopt.make_private is dpopt.loop.make_private and dpopt.ALGORITHMS is ALGORITHMS


def test_every_recipe_has_a_typed_config_and_refuses_the_settings_of_others():
    assert set(CONFIGS) == set(ALGORITHMS)
    assert applies_to("kappa") == ["disk-adam", "disk-adamw", "disk-grape", "disk-sgd"]
    assert type(hyperparameters_for("disk-grape", rank=4)).__name__ == "DiSKProjection"
    with pytest.raises(ValueError, match=r"^kappa does not apply to dp-sgd \(it applies to disk-adam, disk-adamw, "
                                         r"disk-grape, disk-sgd\); dp-sgd takes lr, momentum, weight_decay$"):
        hyperparameters_for("dp-sgd", kappa=0.5)
    model, data, loss = problem()
    with pytest.raises(ValueError, match="rank does not apply to dp-adam"):
        dpopt.make_private(model, None, data, loss, algorithm="dp-adam", batch_size=10, noise_multiplier=1.0,
                           hyperparameters={"rank": 4})
    with pytest.raises(TypeError, match="dp-sgd takes SGD hyper-parameters"):
        dpopt.make_private(model, None, data, loss, algorithm="dp-sgd", batch_size=10, noise_multiplier=1.0,
                           hyperparameters=hyperparameters_for("dp-adam", lr=0.1))


@pytest.mark.parametrize("argv,message", [
    (["--kappa", "0.5"], "--kappa does not apply to dp-sgd (it applies to disk-adam, disk-adamw, disk-grape, "
                         "disk-sgd); dp-sgd takes --lr, --momentum, --weight-decay"),
    (["--algorithm", "dp-adam", "--momentum", "0.9"], "--momentum does not apply to dp-adam"),
    (["--bands", "4"], "bands applies to banded, sqrt and mf noise and to cyclic sampling, not to gaussian noise"),
    (["--tree-decoder", "least-squares"], "tree_decoder applies to tree noise, not to gaussian noise"),
    (["--workload", "true"], "workload applies to optimised correlated noise"),
])
def test_the_cli_refuses_an_inapplicable_flag_in_one_line(argv, message, capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        main(["train", "--out", str(tmp_path), *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and err.count("\n") == 1


def test_old_names_get_one_line_naming_the_new_one():
    model, data, loss = problem()
    with pytest.raises(TypeError, match=r"algorithm='dp-memf'"):
        dpopt.make_private(model, "dp-memf", data, loss, batch_size=10, noise_multiplier=1.0)
    with pytest.raises(TypeError, match=r"^make_private\(hp=\.\.\.\) is now hyperparameters=$"):
        dpopt.make_private(model, None, data, loss, algorithm="dp-sgd", batch_size=10, noise_multiplier=1.0,
                           hp=hyperparameters_for("dp-sgd"))
    with pytest.raises(ImportError, match=r"^dpopt.algorithms.DPOptimizer is now PrivateStep$"):
        from dpopt.algorithms import DPOptimizer  # noqa: F401
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="not both"):
        dpopt.make_private(model, sgd, data, loss, algorithm="dp-sgd", batch_size=10, noise_multiplier=1.0)
    with pytest.raises(ValueError, match="a torch optimizer holds its own"):
        dpopt.make_private(model, sgd, data, loss, batch_size=10, noise_multiplier=1.0,
                           hyperparameters={"lr": 0.1})


def test_the_private_optimizer_is_a_torch_optimizer_that_schedulers_drive():
    """A torch scheduler sets the learning rate of a recipe's own update (DP-GRAPE's projected Adam) as of a torch
    optimizer's groups; ``epsilon()`` is at the run's delta."""
    model, data, loss = problem()
    _, optimizer, batches = dpopt.make_private(model, None, data, loss, algorithm="dp-grape", batch_size=20,
                                               noise_multiplier=1.0, delta=1e-4, secret_seed=0,
                                               hyperparameters={"lr": 0.1, "rank": 2})
    assert isinstance(optimizer, torch.optim.Optimizer)
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    for batch in batches:
        optimizer.zero_grad()
        loss(model, batch).mean().backward()
        optimizer.step()
        schedule.step()
    assert optimizer.dp.base.lr == pytest.approx(0.1 * 0.5 ** (len(batches) - 1))  # set before each update
    assert optimizer.epsilon() == optimizer.epsilon(1e-4) > 0


def test_how_the_target_is_given_never_changes_the_mechanism():
    """dp-memf's own mechanism, amplified BandMF on cyclic Poisson batches, at an epsilon and at a noise
    multiplier alike; only its scale differs."""
    plans = [PrivacyPlan("dp-memf", 600, 60, epochs=2, accountant="rdp", **target) for target in
             ({"epsilon": 2.0}, {"noise_multiplier": 1.0})]
    privatizers = [plan.make(0, log=lambda _: None) for plan in plans]
    for p in privatizers:  # the period is chosen for the target: 2 at epsilon 2, 4 at DP-SGD's 4.2 for z = 1
        assert isinstance(p.sampler, CyclicPoissonSampler) and p.sampler.participation.period > 1
        assert isinstance(p.noise, CorrelatedNoise) and p.noise.horizon == 20
    assert privatizers[1].noise.noise_multiplier == 1.0


def test_no_library_module_loads_the_clis_training_loop_nor_the_accounting_before_epsilon():
    """The audit and federated runs take the plan, the task and the export from the library, not from dpopt.run;
    dp-accounting (seconds to import) loads when epsilon is first asked for, not with ``import dpopt`` or the CLI."""
    probe = ("import sys, dpopt, dpopt.audit, dpopt.federated.simulator, dpopt.federated.cli; "
             "print(sorted(m for m in sys.modules if m.startswith('dpopt.run'))); "
             "import dpopt.cli; print('dp_accounting' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out == "[]\nFalse\n"
