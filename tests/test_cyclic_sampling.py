"""Cyclic Poisson sampling and amplified banded noise (Choquette-Choo et al. 2023): the sampler's groups, the
accounting against dp-accounting, the structure the amplification needs, the reduction to DP-SGD, refusals."""

import json
import math

import dp_accounting as dpa
import pytest
import torch

from dpopt.algorithms import hyperparameters_for
from dpopt.cli import main
from dpopt.data.samplers import CyclicPoissonSampler, PoissonSampler
from dpopt.noise import SecretStream, TreeNoise, build_noise
from dpopt.noise import factorizations as fz
from dpopt.noise.mechanisms import amplified_bands
from dpopt.privacy import (AccountingError, CyclicPoissonSampling, GaussianRelease, PoissonSampling, PrivacyLedger,
                           epsilon_of)
from dpopt.run import TrainConfig, train


@pytest.mark.parametrize("period", [1, 3, 8])
def test_each_step_samples_only_its_group_at_the_rate_that_keeps_the_batch(period):
    n, batch = 4000, 50
    s = CyclicPoissonSampler(n, batch, period, SecretStream(1, "sampling"))
    assert s.participation == CyclicPoissonSampling(batch * period / n, period)
    assert s.normalizer == pytest.approx(batch) and s.steps_per_epoch == n // batch
    sizes = []
    for t in range(240):
        b = s.batch(t)
        assert bool((b % period == t % period).all()), "a step draws from its own group only"
        sizes.append(len(b))
    assert abs(sum(sizes) / len(sizes) - batch) < 3 and len(set(sizes)) > 5  # Poisson: expected size, varying
    if period == 1:  # one group: exactly Poisson sampling's batches
        plain = PoissonSampler.with_batch_size(n, batch, SecretStream(1, "sampling"))
        assert all(torch.equal(s.batch(t), plain.batch(t)) for t in range(20))


def test_a_batch_larger_than_its_group_is_refused():
    with pytest.raises(ValueError, match="batch size times the period must lie in"):
        CyclicPoissonSampler(100, 30, 4, SecretStream(1, "sampling"))
    with pytest.raises(ValueError, match="period must be >= 1"):
        CyclicPoissonSampling(0.1, 0)


@pytest.mark.parametrize("accountant", ["pld", "rdp"])
def test_accounting_is_one_subsampled_gaussian_per_period_as_dp_accounting_composes_it(accountant):
    z, q, period, steps = 1.1, 0.05, 8, 300
    got = epsilon_of([GaussianRelease(z, CyclicPoissonSampling(q, period), steps)], 1e-5, accountant)
    event = dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(z)), math.ceil(steps / period))
    reference = (dpa.pld.PLDAccountant() if accountant == "pld" else dpa.rdp.RdpAccountant()).compose(event)
    assert got == pytest.approx(reference.get_epsilon(1e-5), rel=1e-3)
    plain = epsilon_of([GaussianRelease(z, PoissonSampling(q), steps)], 1e-5, accountant)
    assert got < plain  # fewer compositions than plain Poisson at the same rate
    assert epsilon_of([GaussianRelease(z, CyclicPoissonSampling(q, 1), steps)], 1e-5, accountant) == plain


def test_account_and_calibrate_take_the_cyclic_period(capsys):
    main(["account", "--noise-multiplier", "1.1", "--sample-rate", "0.05", "--period", "8", "--steps", "300",
          "--delta", "1e-5", "--json"])
    eps = json.loads(capsys.readouterr().out)["epsilon"]
    assert eps == epsilon_of([GaussianRelease(1.1, PoissonSampling(0.05), 38)], 1e-5)  # ceil(300 / 8) visits
    main(["calibrate", "--epsilon", str(eps), "--delta", "1e-5", "--sample-rate", "0.05", "--period", "8",
          "--steps", "300", "--json"])
    assert json.loads(capsys.readouterr().out)["noise_multiplier"] == pytest.approx(1.1, rel=0.01)  # round trip
    main(["calibrate", "--epsilon", "2", "--delta", "1e-5", "--sample-rate", "0.05", "--period", "8", "--epochs",
          "2", "--json"])
    assert json.loads(capsys.readouterr().out)["steps"] == 320  # an epoch: 8 / 0.05 steps
    with pytest.raises(SystemExit) as e:
        main(["account", "--noise-multiplier", "1", "--period", "4", "--steps", "10", "--delta", "1e-5"])
    assert e.value.code == 2 and "give --sample-rate too" in capsys.readouterr().err


def test_a_ledger_counts_any_window_of_steps_by_its_group_visits():
    ledger = PrivacyLedger()
    for _ in range(10):  # one record per step merges into one entry of 10 steps: ceil(10 / 4) = 3 visits
        ledger.record(GaussianRelease(2.0, CyclicPoissonSampling(0.1, 4)))
    assert ledger.entries == [GaussianRelease(2.0, CyclicPoissonSampling(0.1, 4), 10)]
    assert ledger.epsilon(1e-5) == epsilon_of([GaussianRelease(2.0, PoissonSampling(0.1), 3)], 1e-5)


@pytest.mark.parametrize("kind,bands", [("banded", 4), ("sqrt", 3)])
def test_banded_noise_within_the_period_is_amplified_and_its_structure_allows_it(kind, bands):
    steps, period = 40, 4
    noise = build_noise(kind, 1.3, 0.5, SecretStream(0, "noise"), steps, steps, bands=bands)
    part = CyclicPoissonSampling(0.2, period)
    assert noise.release(part) == GaussianRelease(1.3, part)
    assert noise.whole_run(2.0, part) == GaussianRelease(2.0, part, steps)
    assert noise.std == pytest.approx(1.3 * 0.5)  # one participation's sensitivity: unit columns
    # the operator C behind the noise: n = C⁻¹ζ, so C = (rows of the noise at unit std)⁻¹
    probe = build_noise(kind, 1.0, 1.0, _Basis(steps), steps, steps, bands=bands)
    rows = torch.stack([probe.unit_noise(t, [torch.Size([steps])])[0] for t in range(steps)]).double()
    c = torch.linalg.inv(rows)
    assert torch.allclose(c, probe.matrix(), atol=1e-5)  # what the amplified audit whitens with
    assert c.norm(dim=0).max() == pytest.approx(1.0, rel=1e-5)  # every column's norm <= 1
    for j in range(period):  # one group's columns j, j + period, ... never share a row
        group = (c[:, j::period].abs() > 1e-4).sum(1)  # float32 noise: zeros to ~1e-7
        assert int(group.max()) <= 1


class _Basis:
    """A stream whose draw for step t is the t-th basis vector: the noise of step t is then row t of C⁻¹."""

    secure = False

    def __init__(self, size):
        self.size = size

    def normals(self, shapes, key, device="cpu"):
        e = torch.zeros(self.size)
        e[key] = 1.0
        return [e]


def test_noise_that_is_not_banded_within_the_period_is_refused():
    part = CyclicPoissonSampling(0.2, 4)
    tree = TreeNoise(1.0, 1.0, SecretStream(0, "noise"), 40, 40)
    with pytest.raises(AccountingError, match="this noise has no bands"):
        tree.release(part)
    with pytest.raises(AccountingError, match="this noise has 8 bands"):
        build_noise("banded", 1.0, 1.0, SecretStream(0, "noise"), 40, 40, bands=8).release(part)
    with pytest.raises(AccountingError, match="a multi-epoch sensitivity"):  # normalised for fixed-order epochs
        build_noise("banded", 1.0, 1.0, SecretStream(0, "noise"), 40, 10, bands=4).release(part)


def test_the_single_participation_error_is_the_matrix_one():
    steps, c = 60, fz.sqrt_coefficients(5)
    w = fz.workload_coefficients(steps, 0.9)
    dense = fz.expected_error(fz.toeplitz(w, steps), fz.toeplitz(c, steps), steps)
    assert fz.single_participation_error(w, c) == pytest.approx(dense, rel=1e-10)
    assert torch.allclose(fz.inverse_coefficients(c, steps), torch.linalg.inv(fz.toeplitz(c, steps))[:, 0])


def test_the_banded_optimiser_descends_through_the_series_inverse():
    """optimize_banded's loss inverts C by Newton's iteration on power series (O(T log T), not a T x T solve):
    it equals the dense inverse for any leading coefficient, its gradient is autograd's, and the optimum
    keeps the single-participation error (the dense formula's, test above) below the square-root start."""
    c = torch.tensor([2.0, -0.7, 0.3, 0.05, -0.1], dtype=torch.float64)
    assert torch.allclose(fz.inverse_coefficients(c, 37), torch.linalg.inv(fz.toeplitz(c, 37))[:, 0], atol=1e-12)
    assert torch.autograd.gradcheck(lambda x: fz.inverse_coefficients(x, 23), (c.clone().requires_grad_(),))
    w = fz.workload_coefficients(120, 0.9)
    best = fz.optimize_banded(w, 8, 120)
    assert fz.single_participation_error(w, best) < 0.99 * fz.single_participation_error(w, fz.sqrt_coefficients(8))


def test_the_period_is_one_where_two_groups_would_not_hold_a_batch():
    assert amplified_bands(2.0, 1e-5, 200, 128, 50, fz.workload_coefficients(50)) == 1


def test_a_cyclic_run_with_one_band_is_dp_sgd():
    """Period 1 and one band: Poisson sampling and iid noise, so dp-memf's run equals dp-sgd's at its lr."""
    common = dict(dataset="digits", epsilon=2.0, epochs=2, secret_seed=0)
    sgd = train(TrainConfig(algorithm="dp-sgd", hyperparameters=hyperparameters_for("dp-sgd", lr=0.3), **common),
                progress=False, log=lambda _: None)
    memf = train(TrainConfig(algorithm="dp-memf", sampling="cyclic", bands=1, **common), progress=False,
                 log=lambda _: None)
    assert memf["history"] == sgd["history"] and memf["epsilon"] == sgd["epsilon"]
    assert memf["noise"] == "banded" and memf["sampling"] == "cyclic"


def test_a_cyclic_run_reports_the_epsilon_of_its_ledger_and_keeps_its_period():
    logs = []
    m = train(TrainConfig(algorithm="dp-memf", dataset="digits", epsilon=2.0, epochs=2, secret_seed=0,
                          sampling="cyclic", batch_size=256), progress=False, log=logs.append)
    bands = m["config"]["bands"]
    assert bands >= 1 and any(f"cyclic sampling: period {bands}" in line for line in logs)
    part = CyclicPoissonSampling(256 * bands / 1437, bands)
    assert m["epsilon"] == pytest.approx(epsilon_of([GaussianRelease(m["noise_multiplier"], part, m["steps"])], 1e-5))
    assert m["epsilon"] <= 2.0


@pytest.mark.parametrize("argv,message", [
    (["--algorithm", "dp-ftrl", "--noise", "tree", "--sampling", "cyclic", "--bands", "4"], "this noise has no bands"),
    (["--algorithm", "dp-memf", "--sampling", "cyclic", "--bands", "8", "--noise", "banded", "--batch-size", "256"],
     "batch size times the period must lie in"),
])
def test_cyclic_sampling_refusals_are_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", *argv, "--epochs", "1", "--no-progress"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and len(err.strip().splitlines()) <= 2
