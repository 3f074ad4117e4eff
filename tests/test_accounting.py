"""Accountant values against published references, calibration, and the ledger's conventions."""

import math

import dp_accounting as dpa
import pytest
from dp_accounting import pld, rdp

from dpopt.privacy import (AccountingError, FixedParticipation, GaussianRelease, PoissonSampling, PrivacyLedger,
                           epsilon_of, noise_multiplier_for)
from dpopt.federated.privacy import gaussian_epsilon
from dpopt.privacy import calibrate, ledger
from dpopt.privacy.correlated import CorrelatedRelease
from dpopt.privacy.ledger import CyclicPoissonSampling, FINE, FixedOrderParticipation, pld_interval


def poisson(z, q, steps):
    return [GaussianRelease(z, PoissonSampling(q), steps)]


def test_mnist_dpsgd_pin():
    """sigma 1.1, q = 256/60000, 60 epochs (14,063 steps), delta 1e-5: PLD 2.38, RDP 2.60."""
    releases = poisson(1.1, 256 / 60000, 14063)
    assert epsilon_of(releases, 1e-5, "pld") == pytest.approx(2.38, abs=0.01)
    assert epsilon_of(releases, 1e-5, "rdp") == pytest.approx(2.60, abs=0.01)


def test_opacus_pins():
    """Opacus's pinned references: sigma 1.5, q 0.04, 2250 steps: RDP 7.329; PRV upper bound 6.7774."""
    releases = poisson(1.5, 0.04, 2250)
    assert epsilon_of(releases, 1e-5, "rdp") == pytest.approx(7.329, abs=0.001)
    assert epsilon_of(releases, 1e-5, "pld") == pytest.approx(6.7774, abs=0.02)


def test_tf_privacy_pins():
    """TF Privacy's: sigma 0.7, q 0.01, 120 steps: RDP 3.2393, PLD 2.4612."""
    releases = poisson(0.7, 0.01, 120)
    assert epsilon_of(releases, 1e-5, "rdp") == pytest.approx(3.2393, abs=5e-4)
    assert epsilon_of(releases, 1e-5, "pld") == pytest.approx(2.4612, abs=5e-4)


@pytest.mark.parametrize("accountant", ["pld", "rdp"])
@pytest.mark.parametrize("participation,steps,target", [
    (PoissonSampling(0.01), 1000, 1.0), (PoissonSampling(0.2), 50, 8.0), (FixedParticipation(10), 100, 2.0)])
def test_calibration_round_trip(accountant, participation, steps, target):
    z = noise_multiplier_for(target, 1e-5, participation, steps, accountant)
    eps = epsilon_of([GaussianRelease(z, participation, steps)], 1e-5, accountant)
    assert eps <= target
    assert eps >= 0.99 * target


@pytest.mark.parametrize("participation,steps,target,delta", [
    (PoissonSampling(128 / 60000), 9380, 2.0, 1e-5), (PoissonSampling(0.5), 1, 2.0, 1e-2),
    (PoissonSampling(0.2), 50, 8.0, 1e-5), (FixedParticipation(10), 100, 0.5, 1e-6),
    (FixedParticipation(1), 1, 0.5, 0.5)])  # epsilon 0 at the upper end (a math domain error before)
def test_calibration_lands_in_its_band_with_few_fine_evaluations(monkeypatch, participation, steps, target, delta):
    """The secant search's budget: each fine (ledger-precision) PLD costs about ten coarse ones, and the search
    spends at most two of them and ten evaluations in all (bisection spent 9-33)."""
    calls = []

    def counted(releases, *args):
        calls.append(args[-1])
        return epsilon_of(releases, *args)

    monkeypatch.setattr(calibrate, "epsilon_of", counted)
    z = noise_multiplier_for(target, delta, participation, steps)
    assert 0.995 * target <= epsilon_of([GaussianRelease(z, participation, steps)], delta) <= target
    assert calls.count(FINE) <= 2 and len(calls) <= 10


@pytest.mark.parametrize("rate,steps,target", [(0.08907, 220, 1e-4), (128 / 60000, 9380, 1e-3)])
def test_a_tiny_epsilon_calibrates_close_to_the_converged_pld(rate, steps, target):
    """Digits' and MNIST's shapes. At the default grid step epsilon 1e-4 was refused ("no noise multiplier below
    1e6"): the step's rounding alone was above the target. dp-accounting's own PLD at a step of 1e-7, where its
    value has converged (finer steps lose precision in its FFT), must put the multiplier found within 1 % under
    the target."""
    z = noise_multiplier_for(target, 1e-5, PoissonSampling(rate), steps)
    assert epsilon_of([GaussianRelease(z, PoissonSampling(rate), steps)], 1e-5) <= target
    converged = pld.pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-7)
    converged.compose(dpa.PoissonSampledDpEvent(rate, dpa.GaussianDpEvent(z)), steps)
    assert 0.99 * target <= converged.get_epsilon(1e-5) <= target


def test_fixed_participation_is_gaussian_composed_per_epoch():
    """No amplification: 95 steps with period 10 release each example ceil(95/10) = 10 times."""
    acc = pld.PLDAccountant()
    acc.compose(dpa.GaussianDpEvent(3.0), 10)
    expected = acc.get_epsilon(1e-6)
    assert epsilon_of([GaussianRelease(3.0, FixedParticipation(10), 95)], 1e-6) == pytest.approx(expected)


@pytest.mark.parametrize("accountant", ["pld", "rdp"])
def test_replace_one_doubles_sensitivity_in_both_accountants(accountant):
    """dp-accounting's PLD and RDP read REPLACE_ONE differently for a plain Gaussian; the ledger must not."""
    part = FixedParticipation(1)
    replace = epsilon_of([GaussianRelease(2.0, part, 5)], 1e-5, accountant, "replace-one")
    add_remove_half = epsilon_of([GaussianRelease(1.0, part, 5)], 1e-5, accountant, "add-remove")
    assert replace == pytest.approx(add_remove_half, rel=1e-6)


def test_poisson_replace_one():
    releases = poisson(1.0, 0.01, 100)
    assert epsilon_of(releases, 1e-5, "pld", "replace-one") > epsilon_of(releases, 1e-5, "pld", "add-remove")
    with pytest.raises(AccountingError, match="replace-one"):
        epsilon_of(releases, 1e-5, "rdp", "replace-one")
    with pytest.raises(AccountingError):
        PrivacyLedger("replace-one", "rdp").record(GaussianRelease(1.0, PoissonSampling(0.01)))


def test_ledger_merges_and_round_trips():
    ledger = PrivacyLedger()
    for _ in range(300):
        ledger.record(GaussianRelease(1.1, PoissonSampling(0.01)))
    ledger.record(GaussianRelease(2.0, PoissonSampling(0.01)))
    assert [e.steps for e in ledger.entries] == [300, 1]
    assert ledger.steps == 301
    direct = epsilon_of([GaussianRelease(1.1, PoissonSampling(0.01), 300),
                         GaussianRelease(2.0, PoissonSampling(0.01), 1)], 1e-5)
    assert ledger.epsilon(1e-5) == pytest.approx(direct)
    again = PrivacyLedger.from_dict(ledger.to_dict())
    assert again.entries == ledger.entries and again.epsilon(1e-5) == pytest.approx(direct)


def test_no_noise_is_infinite_epsilon_and_empty_ledger_is_zero():
    assert math.isinf(epsilon_of(poisson(0.0, 0.1, 3), 1e-5))
    assert PrivacyLedger().epsilon(1e-5) == 0.0


@pytest.mark.parametrize("bad", [dict(epsilon=0.0), dict(epsilon=-1.0), dict(epsilon=math.inf),
                                 dict(delta=0.0), dict(delta=1.0)])
def test_bad_budget_refused(bad):
    args = dict(epsilon=1.0, delta=1e-5) | bad
    with pytest.raises(ValueError, match="epsilon must be a finite number > 0|delta must lie in"):
        noise_multiplier_for(args["epsilon"], args["delta"], PoissonSampling(0.1), 10)


def test_bad_participation_refused():
    with pytest.raises(ValueError, match="Poisson sampling rate must lie in"):
        PoissonSampling(0.0)
    with pytest.raises(ValueError, match="Poisson sampling rate must lie in"):
        PoissonSampling(1.5)
    with pytest.raises(ValueError, match="participation period must be >= 1"):
        FixedParticipation(0)


@pytest.mark.parametrize("releases", [poisson(1.1, 256 / 60000, 14063), poisson(0.5, 0.5, 4),  # both bounds < 100
                                      poisson(0.34, 0.01, 3000),  # integer orders 1,366; all orders 95.5
                                      poisson(0.2, 0.01, 3000), [GaussianRelease(0.4, FixedParticipation(1), 25)]])
def test_pld_grid_from_the_integer_order_bound_equals_the_full_rdp_estimate(releases):
    """The integer orders are a subset of dp-accounting's, so their epsilon bounds the full estimate from above;
    the grid step is the same whether or not the full estimate was needed (cases below, across and above
    epsilon 100)."""
    assert set(ledger.INTEGER_ORDERS) <= set(rdp.rdp_privacy_accountant.DEFAULT_RDP_ORDERS)
    events = [r.dp_event("rdp", ledger.Relation.ADD_REMOVE) for r in releases]
    full = ledger._rdp_epsilon(events, 1e-5, ledger.Relation.ADD_REMOVE)
    assert ledger._rdp_epsilon(events, 1e-5, ledger.Relation.ADD_REMOVE, ledger.INTEGER_ORDERS) >= full
    assert pld_interval(releases, 1e-5) == max(FINE, full / ledger.GRID_POINTS)


def test_pld_grid_coarsens_past_epsilon_100_and_still_bounds_epsilon(monkeypatch):
    """25 Gaussians of z = 0.2 are one of z / 5 (exact epsilon about 418): a fixed 1e-4 grid would hold
    millions of points (z = 0.05 on MNIST's shape: 10 GB); the coarser grid's epsilon stays an upper bound,
    loose by at most steps x grid step (a grid of 1e4 points here, for speed). Runs of ordinary epsilon keep
    dp-accounting's grid."""
    assert pld_interval(poisson(1.1, 256 / 60000, 14063), 1e-5) == FINE
    monkeypatch.setattr(ledger, "GRID_POINTS", 1e4)
    releases = [GaussianRelease(0.2, FixedParticipation(1), 25)]
    step = pld_interval(releases, 1e-5)
    assert step > 100 * FINE
    eps = epsilon_of(releases, 1e-5)
    assert eps == releases[0].pld(ledger.Relation.ADD_REMOVE, step).get_epsilon_for_delta(1e-5)
    exact = gaussian_epsilon(5 / 0.2, 1e-5)  # Balle & Wang's exact epsilon, mu = sensitivity / std
    assert exact <= eps <= exact + 25 * step


def _ledger(relation, accountant, releases):
    book = PrivacyLedger(relation, accountant)
    for r in releases:
        book.record(r)
    return book


@pytest.mark.parametrize("relation,accountant,releases", [
    ("add-remove", "pld", poisson(1.1, 0.01, 300) + poisson(2.0, 0.02, 40)),
    ("add-remove", "rdp", poisson(1.1, 0.01, 300) + [GaussianRelease(3.0, FixedParticipation(10), 95)]),
    ("replace-one", "pld", poisson(1.5, 0.05, 60) + [GaussianRelease(2.0, FixedParticipation(4), 9)]),
    ("replace-one", "rdp", [GaussianRelease(2.0, FixedParticipation(4), 9)]),
    ("add-remove", "pld", [GaussianRelease(0.9, CyclicPoissonSampling(0.05, 4), 30)]),
    ("replace-one", "pld", [CorrelatedRelease(3.0, "tree-sum", 20, 5, FixedOrderParticipation(5), 0.8, 0, 20)]),
])
def test_the_ledger_as_a_dp_event_gives_dp_accountings_own_epsilon(relation, accountant, releases):
    """A run composed in dp-accounting (its own accountants, built with the ledger's relation) has the epsilon the
    ledger reports: the exported event is the one the ledger accounts."""
    book = _ledger(relation, accountant, releases)
    if accountant == "pld":
        theirs = pld.PLDAccountant(book.neighboring_relation, value_discretization_interval=FINE)
    else:
        theirs = rdp.RdpAccountant(neighboring_relation=book.neighboring_relation)
    theirs.compose(book.dp_event())
    assert theirs.get_epsilon(1e-6) == pytest.approx(book.epsilon(1e-6), rel=1e-9)
    assert isinstance(PrivacyLedger().dp_event(), dpa.NoOpDpEvent)
    with pytest.raises(ValueError, match="accountant"):
        book.dp_event("moments")
