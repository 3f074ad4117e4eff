"""Physical batches: a logical step sent through the engine in chunks releases the same statistic, with the
same ledger, as one pass over the whole batch, for every family of algorithms and clipping mode."""

import dataclasses

import pytest
import torch

from dpopt.algorithms import CONFIGS
from dpopt.run import build as train_module
from dpopt.run import TrainConfig, build_run

FAMILIES = {  # algorithm: hyper-parameters that make its special statistic active from the first steps
    "dp-sgd": {}, "dp-adam": {}, "disk-sgd": {"gamma": 0.1}, "dp-grape": {"rank": 4}, "dpzero": {},
    "dp-memf": {}, "dp-srg-memf": {}, "accel-dp-srgd": {}, "dpgd-0th": {},
}


@pytest.fixture(autouse=True)
def _float64(float64_digits):
    """Chunking changes only the order of the sums: in float64 (model and data) they agree to 1e-9."""


def run_steps(algorithm: str, physical: int | None, clipping: str = "flat", steps: int = 3, batch: int = 96,
              sampling: str = "auto", bands: int = 0, **hp):
    config = TrainConfig(algorithm=algorithm, dataset="digits", model="mlp", noise_multiplier=0.01, epochs=1,
                         batch_size=batch, clipping=clipping, sampling=sampling, bands=bands, seed=0, secret_seed=0,
                         hyperparameters=CONFIGS[algorithm](**hp))
    run = build_run(config, log=lambda _: None)
    run.optimizer.physical_batch_size = physical
    privatizer, released = run.optimizer.privatizer, []
    release = privatizer.release
    privatizer.release = lambda sums, step: released.append([t.clone() for t in release(sums, step)]) or released[-1]
    results = [run.optimizer.step(run.data.train) for _ in range(steps)]
    return run, results, released


def assert_same_run(a, b):
    """The same releases (to float tolerance: the sums are added in another order), examples and ledger. The
    noise is small (multiplier 0.01), so one example more or less would show."""
    (run_a, res_a, out_a), (run_b, res_b, out_b) = a, b
    for step_a, step_b in zip(out_a, out_b, strict=True):
        scale = max(float(x.abs().max()) for x in step_a)
        for x, y in zip(step_a, step_b, strict=True):
            assert torch.allclose(x, y, rtol=0, atol=1e-9 * scale), float((x - y).abs().max()) / scale
    assert [r.examples for r in res_a] == [r.examples for r in res_b]
    assert run_a.ledger.to_dict() == run_b.ledger.to_dict()


@pytest.mark.parametrize("algorithm", sorted(FAMILIES))
def test_chunked_steps_release_what_the_whole_batch_releases(algorithm):
    assert_same_run(run_steps(algorithm, None, **FAMILIES[algorithm]), run_steps(algorithm, 7, **FAMILIES[algorithm]))


def test_chunking_keeps_amplified_banded_noise():
    """Cyclic Poisson batches and banded noise (dp-memf's own mechanism, here with a given period)."""
    assert_same_run(run_steps("dp-memf", None, sampling="cyclic", bands=3),
                    run_steps("dp-memf", 7, sampling="cyclic", bands=3))


@pytest.mark.parametrize("clipping", ["per-layer", "automatic"])
def test_chunking_keeps_per_layer_and_automatic_clipping(clipping):
    assert_same_run(run_steps("dp-sgd", None, clipping), run_steps("dp-sgd", 5, clipping))


def test_empty_and_oversized_poisson_batches():
    """Expected batch 2 of 1,797: some steps draw no example (noise alone), none more than a few; a physical
    batch of 1 makes every example its own chunk, and a Poisson batch above its expected size is chunked."""
    whole = run_steps("dp-sgd", None, steps=12, batch=2)
    ones = run_steps("dp-sgd", 1, steps=12, batch=2)
    sizes = [r.examples for r in whole[1]]
    assert 0 in sizes and max(sizes) > 2
    assert_same_run(whole, ones)


def test_bad_physical_batch_size_is_refused():
    run = build_run(TrainConfig(noise_multiplier=1.0, epochs=1), log=lambda _: None)
    for bad in (0, -3, 2.5):
        with pytest.raises(ValueError, match="physical batch size"):
            run.optimizer.physical_batch_size = bad


def test_the_default_physical_batch_is_256_or_the_whole_set_if_smaller(monkeypatch):
    config = TrainConfig(noise_multiplier=1.0, epochs=1, batch_size=16)
    assert build_run(config, log=lambda _: None).optimizer.physical_batch_size == 256
    load = train_module.load_dataset

    def small(*args):  # a training set of 40 examples (the tabular sets have a few dozen to a few hundred)
        data = load(*args)
        return dataclasses.replace(data, train=(data.train[0][:40], data.train[1][:40]))

    monkeypatch.setattr(train_module, "load_dataset", small)
    assert build_run(config, log=lambda _: None).optimizer.physical_batch_size == 40
    with pytest.raises(ValueError, match="exceeds the 40 training examples"):
        build_run(dataclasses.replace(config, physical_batch_size=64), log=lambda _: None)
