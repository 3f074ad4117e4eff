"""One privacy plan for every entry point: a recipe's name runs one mechanism in ``dpopt train``, ``make_private``
and ``PrivateTrainer`` (the same sampler, noise, calibration and ledger, and in float64 the same released step)."""

import copy

import pytest
import torch

from dpopt.algorithms import ALGORITHMS, NON_PRIVATE, applies_to
from dpopt.data.samplers import CyclicPoissonSampler
from dpopt.loop import make_private
from dpopt.noise.correlated import CorrelatedNoise
from dpopt.plan import PrivacyPlan
from dpopt.run import TrainConfig, build_run, classification_loss
from helpers import quiet

BATCH = 300  # digits: 1,437 training examples, so 5 steps an epoch


def target(algorithm: str) -> dict:
    return {} if algorithm in NON_PRIVATE else {"noise_multiplier": 2.0}


def loop_step(model, optimizer, batches) -> None:
    """One logical step of a plain loop: backward and step per physical batch, or the closure a recipe needs."""
    for batch in batches:
        if optimizer.needs_closure:
            optimizer.step(lambda batch=batch: classification_loss(model, batch))
        else:
            optimizer.zero_grad()
            classification_loss(model, batch).mean().backward()
            optimizer.step()
        if optimizer.dp.steps:
            return


def same_mechanism(a, b) -> None:
    """Two privatizers run one mechanism: the same sampler and batches, noise, multiplier and release."""
    assert type(a.sampler) is type(b.sampler) and a.sampler.participation == b.sampler.participation
    assert all(torch.equal(a.sampler.batch(t), b.sampler.batch(t)) for t in range(3))
    assert type(a.noise) is type(b.noise) and a.noise.noise_multiplier == pytest.approx(b.noise.noise_multiplier,
                                                                                       rel=1e-12)
    assert a.noise.release(a.sampler.participation) == b.noise.release(b.sampler.participation)
    assert a.clipping == b.clipping and a.ledger.to_dict() == b.ledger.to_dict()


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_the_cli_and_make_private_release_the_same_step(algorithm, float64_digits):
    config = TrainConfig(algorithm=algorithm, model="mlp", epochs=1, batch_size=BATCH, secret_seed=3,
                         **target(algorithm))
    run = build_run(config, log=quiet)
    model = copy.deepcopy(run.model)
    _, optimizer, batches = make_private(model, None, run.data.train, classification_loss, algorithm=algorithm,
                                         batch_size=BATCH, epochs=1, secret_seed=3, hyperparameters=run.config.hyperparameters,
                                         physical_batch_size=run.optimizer.physical_batch_size, **target(algorithm))
    same_mechanism(run.optimizer.privatizer, optimizer.dp.privatizer)
    torch.manual_seed(0)  # public randomness (zeroth-order directions) alike
    run.optimizer.step(run.data.train)
    torch.manual_seed(0)
    loop_step(model, optimizer, batches)
    for p, q in zip(run.model.parameters(), model.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-9)
    assert run.ledger.to_dict() == optimizer.ledger.to_dict() and run.ledger.steps == 1
    assert run.ledger.epsilon(1e-5) == pytest.approx(optimizer.epsilon(1e-5), rel=1e-9)


@pytest.mark.parametrize("algorithm", ["dp-ftrl"])
def test_at_an_epsilon_the_entry_points_choose_the_same_amplified_mechanism(algorithm):
    """The recipe's own sampling at an epsilon (cyclic Poisson, its period chosen for the epsilon, banded noise)
    in both entry points: the mechanism the CLI runs under that name."""
    config = TrainConfig(algorithm=algorithm, model="mlp", epochs=1, batch_size=700, epsilon=4.0, accountant="rdp",
                         secret_seed=3)  # RDP: a second to calibrate the candidate periods, where PLD takes ten
    run = build_run(config, log=quiet)
    _, optimizer, _ = make_private(copy.deepcopy(run.model), None, run.data.train, classification_loss,
                                   algorithm=algorithm, batch_size=700, epsilon=4.0, accountant="rdp", secret_seed=3)
    same_mechanism(run.optimizer.privatizer, optimizer.dp.privatizer)
    assert isinstance(optimizer.dp.privatizer.sampler, CyclicPoissonSampler)


def test_a_plan_overrides_the_mechanism_with_the_same_names_everywhere():
    """``noise=`` and ``sampling=`` choose another mechanism in make_private as --noise and --sampling do."""
    config = TrainConfig(algorithm="dp-sgd", model="mlp", epochs=1, batch_size=BATCH, noise_multiplier=2.0,
                         noise="tree", sampling="fixed", secret_seed=3)
    run = build_run(config, log=quiet)
    _, optimizer, _ = make_private(copy.deepcopy(run.model), None, run.data.train, classification_loss,
                                   algorithm="dp-sgd", batch_size=BATCH, noise_multiplier=2.0, noise="tree", sampling="fixed",
                                   secret_seed=3)
    same_mechanism(run.optimizer.privatizer, optimizer.dp.privatizer)
    assert isinstance(optimizer.dp.privatizer.noise, CorrelatedNoise)
    with pytest.raises(ValueError, match="exactly one of epsilon"):
        PrivacyPlan("dp-sgd", 100, 10)
    for bad, match in [(dict(sampling="poison"), "unknown sampling 'poison'"), (dict(noise="gauss"), "unknown noise")]:
        with pytest.raises(ValueError, match=match):
            make_private(copy.deepcopy(run.model), None, run.data.train, classification_loss, algorithm="dp-sgd",
                         batch_size=BATCH, noise_multiplier=2.0, **bad)


@pytest.mark.parametrize("algorithm", sorted(set(ALGORITHMS) - NON_PRIVATE))
def test_private_trainer_runs_the_plans_mechanism(algorithm, tmp_path):
    pytest.importorskip("transformers")
    from test_hf_trainer import N, arguments, as_list, examples, tiny_bert

    from dpopt.hf import PrivacyArguments, PrivateTrainer
    privacy = PrivacyArguments(algorithm=algorithm, noise_multiplier=2.0, batch_size=8, secret_seed=3,
                               hyperparameters={"rank": 4} if algorithm in applies_to("rank") else {})  # 16 wide
    trainer = PrivateTrainer(tiny_bert(), arguments(tmp_path, max_steps=-1, num_train_epochs=2),
                             train_dataset=as_list(examples()), privacy=privacy)
    trainer.get_train_dataloader()
    plan = PrivacyPlan(algorithm, N, 8, epochs=2, noise_multiplier=2.0).make(3, log=quiet)
    same_mechanism(trainer.dp.privatizer, plan)
