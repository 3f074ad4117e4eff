"""Correlated noise: tree aggregation and matrix factorizations (exact decompositions, brute-force
sensitivities from the implementation's own noise, error scaling, streams and resume, accounting)."""

import itertools
import math

import pytest
import torch

from dpopt.algorithms import Privatizer
from dpopt.clipping import Clipping
from dpopt.data.samplers import FixedOrderSampler, PoissonSampler, ShuffleSampler
from dpopt.noise import MatrixNoise, SecretStream, TreeNoise, build_noise, factorization
from dpopt.noise import factorizations as fz
from dpopt.privacy import (AccountingError, CorrelatedRelease, FixedOrderParticipation, FixedParticipation,
                           PoissonSampling, PrivacyLedger, epsilon_of, noise_multiplier_for, zcdp_noise_multiplier)
from dpopt.privacy.correlated import whole_run

F64 = torch.float64
KINDS = ["tree-sum", "tree-least-squares", "sqrt", "banded", "mf"]


def mechanism(kind, steps, period, stream=None, z=1.0, bands=0, momentum=0.0):
    stream = stream or SecretStream(0, "noise")
    if kind.startswith("tree"):
        return TreeNoise(z, 1.0, stream, steps, period, kind[5:])
    return build_noise(kind, z, 1.0, stream, steps, period, bands=bands, momentum=momentum)


class Probe:
    """A stream whose draw for a new key k is the next basis vector: the noise a mechanism returns for step t
    is then row t of its operator N (noise = N·ζ, ζ iid standard normal), exactly."""

    secure = False

    def __init__(self, size=64):
        self.size, self.keys = size, {}

    def normals(self, shapes, key, device="cpu", dtype=torch.float32):
        e = torch.zeros(self.size, dtype=F64)
        e[self.keys.setdefault(key, len(self.keys))] = 1.0
        return [e]


def operator(kind, steps, period, **kw):
    """N scaled to the mechanism's std at z = 1, clip = 1 (so the whole run should be 1-GDP)."""
    m = mechanism(kind, steps, period, Probe(), **kw)
    rows = [m.unit_noise(t, [torch.Size([m.stream.size])])[0] for t in range(steps)]
    return torch.stack(rows)[:, :len(m.stream.keys)].to(F64) * m.scale, m


def brute_force_mu(n, period, steps=None):
    """max over positions j and contribution signs of the Mahalanobis norm of the example's effect on the
    noisy steps X + N·ζ: the GDP parameter of releasing the first `steps` steps, found by enumeration."""
    steps = steps or n.shape[0]
    chol = torch.linalg.cholesky(n[:steps] @ n[:steps].T)
    best = 0.0
    for j in range(min(period, steps)):
        where = list(range(j, steps, period))
        for signs in itertools.product([-1.0, 1.0], repeat=len(where)):
            u = torch.zeros(steps, 1, dtype=F64)
            u[where, 0] = torch.tensor(signs, dtype=F64)
            best = max(best, float(torch.linalg.solve_triangular(chol, u, upper=False).norm()))
    return best


def test_tree_prefix_seven_is_three_nodes():
    """Lemma 4.3 (L182): Δ1 + ... + Δ7 = s_{1,2} + s_{3,1} + s_{7,0}, i.e. the nodes completed at (1-based)
    steps 4 (level 2), 6 (level 1) and 7 (level 0)."""
    n, m = operator("tree-sum", 8, 8)
    prefix7 = n[:7].sum(0) / m.scale
    nodes = {key: col for key, col in m.stream.keys.items()}
    used = {key for key, col in nodes.items() if prefix7[col] == 1.0}
    assert used == {3 * 64 + 2, 5 * 64 + 1, 6 * 64 + 0}
    assert int((prefix7 != 0).sum()) == 3


def test_tree_error_is_popcount_and_least_squares_is_the_gls_estimate():
    steps = 13
    a = torch.ones(steps, steps, dtype=F64).tril()
    n_sum, m_sum = operator("tree-sum", steps, steps)
    var_sum = (a @ n_sum).square().sum(1) / m_sum.scale ** 2
    assert var_sum.tolist() == pytest.approx([bin(t + 1).count("1") for t in range(steps)], abs=1e-5)
    n_ls, m_ls = operator("tree-least-squares", steps, steps)
    var_ls = (a @ n_ls).square().sum(1) / m_ls.scale ** 2
    nodes, release = fz.tree_nodes(steps, full=True)
    gls = []
    for t in range(steps):  # variance of the best linear unbiased estimate from the nodes released by step t
        rows = nodes[release <= t][:, :t + 1]
        ones = torch.ones(t + 1, dtype=F64)
        gls.append(float(ones @ torch.linalg.solve(rows.T @ rows, ones)))
    assert var_ls.tolist() == pytest.approx(gls, abs=1e-5)
    assert bool((var_ls <= var_sum + 1e-9).all()) and float(var_ls.sum()) < 0.8 * float(var_sum.sum())


def test_tree_prefix_sums_are_unbiased_and_their_error_grows_like_log_t():
    """Monte Carlo with the real stream over 4000 coordinates: mean 0, variance popcount(t) node variances,
    worst case <= 1 + log2 T node variances against T for iid noise, and Lemma 4.3's high-probability bound."""
    steps, d = 64, 4000
    m = TreeNoise(1.0, 1.0, SecretStream(5, "noise"), steps, steps)
    sums = [m([torch.zeros(d)], t)[0] for t in range(steps)]
    prefix = torch.cumsum(torch.stack(sums), 0) / m.std
    assert float(prefix.mean(1).abs().max()) < 4 * math.sqrt(1 + math.log2(steps)) / math.sqrt(d)
    ratio = prefix.var(1) / torch.tensor([bin(t + 1).count("1") for t in range(steps)], dtype=torch.float32)
    assert float((ratio - 1).abs().max()) < 0.12
    assert float(prefix.var(1).max()) < 1.1 * (1 + math.log2(steps)) < 0.2 * steps
    delta = 1e-3  # Lemma 4.3 with C = mu = 1: error <= 4 log^1.5 T sqrt(d ln(2T/delta))
    errors = (prefix * m.std).norm(dim=1)
    assert float(errors.max()) <= 4 * math.log2(steps) ** 1.5 * math.sqrt(d * math.log(2 * steps / delta))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("steps,period", [(7, 7), (9, 3), (10, 4)])
def test_sensitivity_by_brute_force(kind, steps, period):
    """The whole run at z = 1 is 1-GDP: enumeration over every position and sign pattern of the noise the
    implementation actually adds gives mu = 1 (<= 1 for the least-squares tree, whose output is a
    post-processing of the node releases), and every prefix's reported sensitivity bounds its enumeration."""
    n, m = operator(kind, steps, period)
    mu = brute_force_mu(n, period)
    if kind == "tree-least-squares":
        assert mu <= 1.0 + 1e-6
    else:
        assert mu == pytest.approx(1.0, abs=1e-5)
    for s in range(1, steps + 1):
        assert m.prefix[s - 1] >= brute_force_mu(n, period, s) - 1e-5


def test_momentum_workload_factorizations_are_exactly_private_too():
    for kind in ("banded", "mf"):
        n, _ = operator(kind, 9, 3, momentum=0.9)
        assert brute_force_mu(n, 3) == pytest.approx(1.0, abs=1e-5)


def test_column_sum_formula_is_the_brute_force_maximum_and_negative_gram_is_refused():
    torch.manual_seed(1)
    c = torch.rand(8, 8, dtype=F64).tril()
    best = max(float((c[:, list(range(j, 8, 3))] @ torch.tensor(s, dtype=F64)).norm())
               for j in range(3) for s in itertools.product([-1.0, 1.0], repeat=len(range(j, 8, 3))))
    assert fz.sensitivity(c, 3) == pytest.approx(best)
    assert fz.sensitivity(torch.eye(8, dtype=F64), 3) == pytest.approx(math.sqrt(3))  # C = I: sqrt(epochs)
    signed = c.clone()
    signed[3:, 0] = -1.0
    assert fz.sensitivity(signed, 8) == pytest.approx(float(signed.norm(dim=0).max()))  # one epoch: any C
    with pytest.raises(ValueError, match="negative inner products"):
        fz.sensitivity(signed, 3)
    nodes, release = fz.tree_nodes(20, full=True)
    assert torch.allclose(fz.prefix_sensitivities(nodes, 6, release), fz.tree_prefix_sensitivities(20, 6, True))


@pytest.mark.parametrize("steps,bands,period", [(23, 4, 5), (23, 4, 23), (23, 9, 4), (23, 23, 6)])
def test_band_storage_equals_the_dense_sensitivities(steps, bands, period):
    """The band storage MatrixNoise is built from (O(T p), no T x T matrix) gives the dense functions' values."""
    torch.manual_seed(steps + bands + period)
    c = torch.rand(steps, steps, dtype=F64).tril() * (torch.ones(steps, steps).tril(-bands) == 0)
    stored = fz.to_bands(c)
    assert stored.shape == (steps, bands) and torch.equal(fz.from_bands(stored), c)
    assert torch.allclose(fz.band_prefix_sensitivities(stored, period), fz.prefix_sensitivities(c, period))
    assert torch.allclose(fz.from_bands(fz.normalize_bands(stored, period)), fz.normalize_columns(c, period))
    coefficients = torch.rand(bands, dtype=F64)
    assert torch.equal(fz.toeplitz_bands(coefficients, steps), fz.to_bands(fz.toeplitz(coefficients, steps)))
    signed = c.clone()
    signed[bands - 1:, 0] = 0.0
    signed[1:bands, 0] = -1.0
    if bands > period:  # an example's columns share rows: negative inner products are refused, as dense
        with pytest.raises(ValueError, match="negative inner products"):
            fz.normalize_bands(fz.to_bands(signed), period)
    else:  # they never share a row: any sign is aligned
        assert torch.allclose(fz.band_prefix_sensitivities(fz.to_bands(signed), period),
                              fz.prefix_sensitivities(signed, period))


def test_square_root_factorization():
    steps = 120
    c = fz.toeplitz(fz.sqrt_coefficients(steps), steps)
    assert torch.allclose(c @ c, torch.ones(steps, steps, dtype=F64).tril(), atol=1e-12)
    inverse = torch.linalg.inv(c)[:4, 0].tolist()
    assert inverse == pytest.approx([1.0, -0.5, -0.125, -0.0625])
    assert fz.sensitivity(c, steps) == pytest.approx(1.61, abs=0.005)  # spec §2.4


def test_optimised_factorizations_beat_sqrt_and_iid():
    steps, period = 24, 8
    w = fz.toeplitz(fz.workload_coefficients(steps, momentum=0.9), steps)
    identity = fz.expected_error(w, torch.eye(steps, dtype=F64), period)
    sqrt = fz.expected_error(w, fz.normalize_columns(fz.toeplitz(fz.sqrt_coefficients(steps), steps), period), period)
    banded = fz.expected_error(w, fz.from_bands(factorization("banded", steps, period, 0, 0.9)[0]), period)
    dense = fz.expected_error(w, fz.from_bands(factorization("mf", steps, period, 0, 0.9)[0]), period)
    assert dense <= banded * 1.001 and dense < sqrt < identity
    assert banded < identity
    with pytest.raises(ValueError, match="bands <= steps per epoch"):
        factorization("banded", steps, period, 9)


@pytest.mark.parametrize("kind", KINDS)
def test_streams_reproduce_from_seeds_and_resume_mid_run(kind):
    steps, shapes = 12, [torch.Size([3, 5]), torch.Size([7])]

    def run(mech, start=0):
        return [[x.clone() for x in mech([torch.zeros(s) for s in shapes], t)] for t in range(start, steps)]

    full = run(mechanism(kind, steps, 5, SecretStream(3, "noise")))
    again = run(mechanism(kind, steps, 5, SecretStream(3, "noise")))
    resumed = run(mechanism(kind, steps, 5, SecretStream(3, "noise")), start=7)  # replays steps 0..6
    other = run(mechanism(kind, steps, 5, SecretStream(4, "noise")))
    assert all(torch.equal(a, b) for ra, rb in zip(full, again) for a, b in zip(ra, rb))
    assert all(torch.equal(a, b) for ra, rb in zip(full[7:], resumed) for a, b in zip(ra, rb))
    assert not torch.equal(full[5][0], other[5][0])


class ReplayableSecure:
    """Stands in for an OS-entropy stream (secure: never replayed by the mechanism) with known draws."""

    secure = True

    def normals(self, shapes, key, device="cpu", dtype=torch.float32):
        g = torch.Generator().manual_seed(1000 + key)
        return [torch.randn(s, generator=g) for s in shapes]


@pytest.mark.parametrize("kind", ["tree-least-squares", "banded", "mf"])
def test_secure_stream_resumes_from_its_saved_state_and_is_never_replayed(kind):
    steps = 10
    full = mechanism(kind, steps, 5, ReplayableSecure())
    expected = [full([torch.zeros(6)], t)[0] for t in range(steps)]
    cut = mechanism(kind, steps, 5, ReplayableSecure())
    for t in range(4):
        cut([torch.zeros(6)], t)
    resumed = mechanism(kind, steps, 5, ReplayableSecure())
    resumed.load_state_dict(cut.state_dict())
    assert all(torch.equal(resumed([torch.zeros(6)], t)[0], expected[t]) for t in range(4, steps))
    with pytest.raises(RuntimeError, match="cannot be replayed"):
        mechanism(kind, steps, 5, ReplayableSecure())([torch.zeros(6)], 3)
    assert mechanism(kind, steps, 5, SecretStream(1, "noise")).state_dict() == {}  # replayable: nothing saved


def test_streaming_memory_is_bounded():
    tree = TreeNoise(1.0, 1.0, SecretStream(0, "noise"), 1000, 1000, "least-squares")
    banded = build_noise("sqrt", 1.0, 1.0, SecretStream(0, "noise"), 1000, 1000, bands=5)
    depth = 0
    for t in range(1000):
        tree([torch.zeros(4)], t)
        banded([torch.zeros(4)], t)
        depth = max(depth, len(tree._state))
    assert depth <= 1 + math.log2(1000)
    assert banded.bands == 5 and banded._state[0].shape[0] == 4  # bands - 1 past rows


# --- accounting -----------------------------------------------------------------------------------------
def test_release_round_trip_merge_and_partial_runs():
    mech = mechanism("tree-sum", 20, 5, z=3.0)
    ledger = PrivacyLedger()
    part = FixedOrderParticipation(5)
    for t in range(8):
        mech([torch.zeros(3)], t)
        ledger.record(mech.release(part))
    assert len(ledger.entries) == 1 and ledger.entries[0].steps == 8
    assert ledger.entries[0].sensitivity == pytest.approx(mech.prefix[7])
    assert PrivacyLedger.from_dict(ledger.to_dict()).entries == ledger.entries
    full = epsilon_of([whole_run(3.0, "tree-sum", 20, 5, part)], 1e-5)
    partial = ledger.epsilon(1e-5)
    assert partial < full  # an early stop is charged its prefix, never more than the whole run
    # and never less than the prefix's own Gaussian mechanism
    assert partial == pytest.approx(epsilon_of([whole_run(3.0 / mech.prefix[7], "x", 20, 5, part)], 1e-5))
    for t in range(8, 20):
        mech([torch.zeros(3)], t)
        ledger.record(mech.release(part))
    assert ledger.epsilon(1e-5) == pytest.approx(full)
    with pytest.raises(AccountingError, match="horizon"):
        ledger.record(CorrelatedRelease(3.0, "tree-sum", 20, 5, part, 1.0, 20, 1))


def test_a_second_run_is_composed_not_merged():
    part = FixedOrderParticipation(5)
    first = CorrelatedRelease(3.0, "tree-sum", 10, 5, part, 1.0, 0, 10)
    ledger = PrivacyLedger()
    ledger.record(first)
    ledger.record(CorrelatedRelease(3.0, "tree-sum", 10, 5, part, 0.5, 0, 1))  # restarts at step 0
    assert len(ledger.entries) == 2


def test_poisson_and_reshuffled_epochs_are_refused():
    mech = mechanism("mf", 12, 4)
    with pytest.raises(AccountingError, match="Poisson"):
        Privatizer(Clipping(1.0), mech, PoissonSampler(40, 0.1, SecretStream(0, "s")), PrivacyLedger())
    with pytest.raises(AccountingError, match="same position"):
        Privatizer(Clipping(1.0), mech, ShuffleSampler(40, 10, SecretStream(0, "s")), PrivacyLedger())
    Privatizer(Clipping(1.0), mech, FixedOrderSampler(40, 10, SecretStream(0, "s")), PrivacyLedger())
    one_epoch = mechanism("mf", 4, 4)
    Privatizer(Clipping(1.0), one_epoch, ShuffleSampler(40, 10, SecretStream(0, "s")), PrivacyLedger())
    with pytest.raises(AccountingError, match="one participation"):
        one_epoch.release(FixedParticipation(2))
    with pytest.raises(ValueError, match="outside the horizon"):
        one_epoch([torch.zeros(2)], 4)


@pytest.mark.parametrize("accountant", ["pld", "rdp"])
def test_calibration_round_trip(accountant):
    mech = mechanism("sqrt", 30, 10)
    part = FixedOrderParticipation(10)
    z = noise_multiplier_for(1.0, 1e-6, part, 30, accountant, release=lambda v: mech.whole_run(v, part))
    assert 0.995 <= epsilon_of([mech.whole_run(z, part)], 1e-6, accountant) <= 1.0
    # one Gaussian mechanism: the same z as a single iid release
    assert z == pytest.approx(noise_multiplier_for(1.0, 1e-6, FixedParticipation(1), 1, accountant), rel=1e-3)
    assert noise_multiplier_for(1.0, 1e-6, part, 30, accountant) > 1.5 * z  # iid noise needs sqrt(3) more


def test_paper_zcdp_calibration():
    """Spec §2.2: rho(0.1, 1e-6) = 1.80304e-4 (std 52.66) and rho(2, 1e-6) = 0.0675739 (std 2.7202)."""
    assert zcdp_noise_multiplier(0.1, 1e-6) == pytest.approx(52.66, abs=0.01)
    assert zcdp_noise_multiplier(2.0, 1e-6) == pytest.approx(2.7202, abs=1e-4)
    assert epsilon_of([whole_run(52.66, "mf", 120, 120, FixedOrderParticipation(120))], 1e-6) < 0.1


def test_poisson_participation_in_a_stored_ledger_is_refused():
    bad = CorrelatedRelease(1.0, "tree-sum", 10, 10, PoissonSampling(0.1), 1.0, 0, 1)
    with pytest.raises(AccountingError, match="Poisson"):
        PrivacyLedger().record(bad)


@pytest.mark.parametrize("accountant", ["pld", "rdp"])
@pytest.mark.parametrize("relation", ["add-remove", "replace-one"])
def test_a_whole_run_is_one_gaussian_mechanism_under_both_relations(accountant, relation):
    """The run at z equals one iid Gaussian release at z (dp-accounting's conventions for replace-one
    included); a prefix with relative sensitivity s equals one at z / s."""
    from dpopt.privacy import GaussianRelease

    part = FixedOrderParticipation(4)
    for s in (1.0, 0.5):
        run = CorrelatedRelease(2.0, "mf", 12, 4, part, s, 0, 3 if s < 1 else 12)
        single = GaussianRelease(2.0 / s, FixedParticipation(1), 1)
        assert epsilon_of([run], 1e-5, accountant, relation) == pytest.approx(
            epsilon_of([single], 1e-5, accountant, relation), rel=1e-9)
