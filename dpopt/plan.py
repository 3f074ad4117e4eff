"""The privacy plan: sampling, clipping, the noise mechanism, its calibration and its accounting, decided together.

A ``PrivacyPlan`` is built from the recipe, the data size, the batch, the run's length and a target (an epsilon or
a noise multiplier); ``make(key)`` returns the ``Privatizer`` (sampler, clipping, noise, ledger) that every entry
point drives: ``dpopt train`` (``TrainConfig.plan``), ``make_private``, ``PrivateTrainer`` and ``dpopt audit``.
None of them chooses a mechanism itself, so a recipe's name means one mechanism everywhere.

The rules, in order:

* the noise: the recipe's mechanism (``DEFAULT_NOISE``; iid Gaussian for the first-order recipes) unless ``noise``
  names another;
* the sampling: with the recipe's own noise, the recipe's sampling (``DEFAULT_SAMPLING``: cyclic Poisson for
  amplified BandMF, whose period is chosen for the privacy target); else Poisson for iid noise and fixed order for
  correlated noise, unless ``sampling`` names another. An epsilon and a noise multiplier give the same mechanism;
  only its scale differs;
* the mechanism that runs (``mechanism``): the noise above, except that a recipe's own correlated noise gives way
  to ``banded`` under cyclic sampling (which amplifies banded noise only) and its dense ``mf`` beyond
  ``MAX_DENSE_STEPS`` steps;
* the scale: the noise multiplier given, or the one calibrated to the epsilon by the accountant (or by advanced
  composition, for faithful reproductions of DPZero).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Protocol

from dpopt.algorithms import (DEFAULT_NOISE, DEFAULT_SAMPLING, DEFAULT_TREE_DECODER, NON_PRIVATE, Hyperparameters,
                              check_algorithm, hyperparameters_for)
from dpopt.algorithms.base import Privatizer
from dpopt.clipping import Clipping
from dpopt.data.samplers import Sampler, make_sampler
from dpopt.noise import factorizations as fz
from dpopt.noise.correlated import CorrelatedNoise
from dpopt.noise.gaussian import GaussianNoise
from dpopt.noise.mechanisms import MAX_DENSE_STEPS, TREE_DECODERS, WORKLOADS, amplified_bands, build_noise
from dpopt.noise.rng import SecretStream
from dpopt.privacy import (CyclicPoissonSampling, GaussianRelease, PoissonSampling, PrivacyLedger, Relation,
                           advanced_composition_noise, epsilon_of, noise_multiplier_for)

if TYPE_CHECKING:
    from dpopt.distributed import DataParallel

SLOW_FACTORIZATION_STEPS = 1024  # beyond it, optimising a dense mf factorization takes minutes: say so


class Settings(Protocol):
    """What the rules read: a ``PrivacyPlan``, or a ``TrainConfig`` before the data size is known."""

    algorithm: str
    noise: str
    sampling: str
    epsilon: float | None
    bands: int
    workload: str
    tree_decoder: str | None
    hyperparameters: Hyperparameters


def noise_kind(s: Settings) -> str:
    """The noise the settings ask for: ``noise``, or the recipe's own (iid Gaussian for most)."""
    return DEFAULT_NOISE.get(s.algorithm, "gaussian") if s.noise == "auto" else s.noise


def sampling_kind(s: Settings) -> str:
    """The sampling: ``sampling``, or the recipe's own with its own noise (cyclic: its period is chosen for the
    privacy target), else Poisson for iid noise and fixed order for correlated noise. How the target is given (an
    epsilon or a noise multiplier) never changes it."""
    if s.sampling != "auto":
        return s.sampling
    if s.noise == "auto" and s.algorithm in DEFAULT_SAMPLING:
        return DEFAULT_SAMPLING[s.algorithm]
    return "poisson" if noise_kind(s) == "gaussian" else "fixed"


def mechanism(s: Settings, steps: int) -> str:
    """The noise mechanism of a run of ``steps`` steps: ``noise_kind``, except that a recipe's default
    correlated noise (``noise="auto"``) gives way to ``banded`` under cyclic sampling (which amplifies banded noise
    only), and its dense ``mf`` beyond ``MAX_DENSE_STEPS`` steps, where the dense optimiser is out of reach (an
    explicit ``noise="mf"`` is refused there instead)."""
    kind = noise_kind(s)
    if s.noise != "auto" or kind == "gaussian":
        return kind
    return "banded" if sampling_kind(s) == "cyclic" or (kind == "mf" and steps > MAX_DENSE_STEPS) else kind


def workload_rates(s: Settings) -> tuple[float, float]:
    """(momentum, decay) of the workload an optimised factorization targets: with ``workload="true"`` the run's
    momentum and, for the SRG recipes, its decay; else 0 and 0 (prefix sums)."""
    if s.workload != "true":
        return 0.0, 0.0
    return getattr(s.hyperparameters, "momentum", 0.0), getattr(s.hyperparameters, "decay", 0.0)


def tree_decoder(s: Settings) -> str:
    """The decoder of tree noise: ``tree_decoder``, or the recipe's own (the plain sum for most)."""
    return s.tree_decoder or DEFAULT_TREE_DECODER.get(s.algorithm, "sum")


def check_noise_settings(s: Settings) -> None:
    """Refuse a noise setting that the chosen noise and sampling would ignore, and values no mechanism has."""
    check_algorithm(s.algorithm)
    if s.workload not in WORKLOADS:
        raise ValueError(f"unknown workload {s.workload!r}; choose one of {', '.join(WORKLOADS)}")
    if s.tree_decoder not in (None, *TREE_DECODERS):
        raise ValueError(f"unknown tree decoder {s.tree_decoder!r}; choose one of {', '.join(TREE_DECODERS)}")
    if s.bands < 0:
        raise ValueError(f"bands must be >= 0 (0: the mechanism's default), got {s.bands}")
    kind, cyclic = noise_kind(s), sampling_kind(s) == "cyclic"
    if s.bands and kind in ("gaussian", "tree") and not cyclic:
        raise ValueError(f"bands applies to banded, sqrt and mf noise and to cyclic sampling, not to {kind} noise "
                         f"on {sampling_kind(s)} sampling")
    if s.workload != "ones" and kind == "gaussian" and not cyclic:
        raise ValueError("workload applies to optimised correlated noise (banded, mf; amplified BandMF), not to iid "
                         "gaussian noise")
    if s.tree_decoder is not None and kind != "tree":
        raise ValueError(f"tree_decoder applies to tree noise, not to {kind} noise")


@dataclass(frozen=True)
class PrivacyPlan:
    """The privacy of one run: its sampling, clipping, noise mechanism, calibration and ledger, decided together
    from the recipe, the data, the run's length and one target. Every entry point builds one; ``make(key)``
    returns the ``Privatizer`` a step drives.

    ```python
    from dpopt import PrivacyPlan
    from dpopt.noise.rng import secret_key

    plan = PrivacyPlan("dp-sgd", dataset_size=80, batch_size=4, epochs=2, noise_multiplier=1.0)
    assert (plan.noise_kind, plan.sampling_kind) == ("gaussian", "poisson")
    privatizer = plan.make(secret_key())       # sampler, clipping, calibrated noise and an empty ledger
    assert plan.total_steps(privatizer.sampler) == 40 and privatizer.ledger.steps == 0

    memf = PrivacyPlan("dp-memf", dataset_size=60_000, batch_size=512, epochs=5, epsilon=2.0)
    assert (memf.noise_kind, memf.sampling_kind) == ("mf", "cyclic")   # the recipe's own mechanism
    ```

    :param algorithm: the recipe, whose mechanism the plan runs unless ``noise`` or ``sampling`` say otherwise.
    :param dataset_size: the number of training examples.
    :param batch_size: the expected logical batch.
    :param epochs: the run's length in epochs.
    :param steps: the run's length in logical steps, if not ``ceil(epochs * steps per epoch)``.
    :param epsilon: the target epsilon (the noise is calibrated to it); or give ``noise_multiplier``.
    :param noise_multiplier: the noise's std over the clip bound.
    :param delta: the target delta.
    :param clip: the per-example clip bound.
    :param clipping: ``flat``, ``per-layer`` or ``automatic``.
    :param noise: the noise mechanism (``auto``: the recipe's).
    :param sampling: the sampling (``auto``: the recipe's).
    :param bands: banded noise's bands and cyclic sampling's period (0: chosen for the target).
    :param workload: what an optimised factorization targets: ``ones`` (prefix sums) or ``true`` (the recipe's
        momentum and decay).
    :param tree_decoder: tree noise's decoder (None: the recipe's).
    :param accountant: ``pld`` or ``rdp``.
    :param relation: ``add-remove`` or ``replace-one``.
    :param calibration: ``accountant`` or ``advanced-composition`` (iid noise at an epsilon only).
    :param calibration_epochs: the epochs iid noise was calibrated for, when a resumed run is extended past them.
    :param hyperparameters: the recipe's (None: its defaults); their momentum and decay shape a ``true`` workload.
    :raises ValueError: for an unknown recipe, both or neither target, or a noise setting the chosen noise and
        sampling would ignore.
    """

    algorithm: str
    dataset_size: int
    batch_size: int
    epochs: float = 1
    steps: int | None = None
    epsilon: float | None = None
    noise_multiplier: float | None = None
    delta: float = 1e-5
    clip: float = 1.0
    clipping: str = "flat"
    noise: str = "auto"
    sampling: str = "auto"
    bands: int = 0
    workload: str = "ones"
    tree_decoder: str | None = None
    accountant: str = "pld"
    relation: str = "add-remove"
    calibration: str = "accountant"
    calibration_epochs: int | None = None
    hyperparameters: Hyperparameters | None = None  # None: the recipe's defaults

    def __post_init__(self) -> None:
        check_noise_settings(self)
        if self.hyperparameters is None:
            object.__setattr__(self, "hyperparameters", hyperparameters_for(self.algorithm))
        if self.algorithm not in NON_PRIVATE and (self.epsilon is None) == (self.noise_multiplier is None):
            raise ValueError("give exactly one of epsilon (the noise is calibrated to it) or noise_multiplier")

    @property
    def noise_kind(self) -> str:
        """The noise asked for: ``noise``, or the recipe's own (``gaussian`` for most; ``tree``, ``mf``)."""
        return noise_kind(self)

    @property
    def sampling_kind(self) -> str:
        """The sampling: ``sampling``, or the recipe's own with its own noise, else ``poisson`` for iid noise and
        ``fixed`` for correlated noise."""
        return sampling_kind(self)

    def resolved(self, log: Callable[[str], None] = print) -> "PrivacyPlan":
        """The plan with every choice it makes from the target written down: cyclic sampling's period (the
        noise's bands), the least noise on the workload at the epsilon, unless ``bands`` gives it. At a noise
        multiplier, the epsilon is the one DP-SGD's Poisson sampling reaches with it on the same batches, by RDP
        (fast at any scale; the run's ledger accounts whichever period this chooses).

        :param log: where the choice is written (one line).
        :returns: this plan with ``bands`` set where cyclic sampling chose a period.
        """
        if self.sampling_kind != "cyclic" or self.bands or self.algorithm in NON_PRIVATE:
            return self
        steps = self.steps or math.ceil(self.epochs * max(1, round(self.dataset_size / self.batch_size)))
        epsilon, accountant = self.epsilon, self.accountant
        if epsilon is None:  # the period is a utility choice (the ledger accounts any): RDP's is fast at any scale
            accountant = "rdp" if Relation(self.relation) is Relation.ADD_REMOVE else self.accountant
            rate = min(1.0, self.batch_size / self.dataset_size)
            epsilon = epsilon_of([GaussianRelease(self.noise_multiplier, PoissonSampling(rate), steps)], self.delta,
                                 accountant, self.relation)
        rates = workload_rates(self) if mechanism(self, steps) != "sqrt" else (0.0, 0.0)
        workload = fz.workload_coefficients(steps, *rates)
        period = amplified_bands(epsilon, self.delta, self.dataset_size, self.batch_size, steps, workload,
                                 accountant, self.relation)
        log(f"cyclic sampling: period {period} " + ("(plain Poisson sampling, iid noise)" if period == 1 else
                                                    "(groups taken in turn, and the noise's bands)")
            + f", the least noise on the workload at epsilon {epsilon:.4g}"
            + ("" if self.epsilon is not None else f" (DP-SGD's at noise multiplier {self.noise_multiplier})")
            + " (--bands sets it)")
        return dataclasses.replace(self, bands=period)

    def sampler(self, key: int | bytes | None) -> Sampler:
        """The run's sampler, its secret stream keyed by ``key`` (None: secure, per-draw OS entropy).

        :param key: the run's secret key (``dpopt.noise.rng.secret_key``), or None.
        :returns: the sampler of ``sampling_kind`` over ``dataset_size`` examples.
        """
        return make_sampler(self.sampling_kind, self.dataset_size, self.batch_size, SecretStream(key, "sampling"),
                            self.bands)

    def total_steps(self, sampler: Sampler) -> int:
        """The run's logical steps: ``steps``, or ``epochs`` of ``sampler``'s.

        :param sampler: the run's sampler (``sampler(key)``), whose epoch length it reads.
        :returns: the number of logical steps the noise is calibrated for.
        """
        return self.steps or math.ceil(self.epochs * sampler.steps_per_epoch)

    def make(self, key: int | bytes | None, log: Callable[[str], None] = print,
             parallel: DataParallel | None = None) -> Privatizer:
        """The ``Privatizer`` of the ``resolved`` plan: its sampler and noise keyed by ``key``, the noise
        calibrated to the target, and an empty ledger.

        :param key: the secret key of the sampling and noise streams (``dpopt.noise.rng.secret_key``); None: every
            draw from OS entropy.
        :param log: where the plan's choices are written.
        :param parallel: a ``DataParallel`` group whose processes share each step.
        :returns: the ``Privatizer`` a ``PrivateStep`` drives.
        :raises AccountingError: for a sampling the mechanism cannot account.
        """
        plan = self.resolved(log)
        sampler = plan.sampler(key)
        clipping = Clipping(plan.clip, plan.clipping)
        noise = plan._noise(sampler, clipping.sensitivity, SecretStream(key, "noise"), log)
        return Privatizer(clipping, noise, sampler, PrivacyLedger(plan.relation, plan.accountant), parallel)

    def _noise(self, sampler: Sampler, clip: float, stream: SecretStream,
               log: Callable[[str], None]) -> GaussianNoise | CorrelatedNoise:
        """The run's noise mechanism (``mechanism``), calibrated to ``epsilon`` if given. Correlated noise is built
        for the whole run (examples recurring every epoch) and refuses a sampling its sensitivity does not cover
        before anything is calibrated."""
        if self.algorithm in NON_PRIVATE:
            log(f"{self.algorithm} is NOT differentially private: it releases un-noised statistics (epsilon = inf)")
            return GaussianNoise(0.0, clip, stream)
        total = self.total_steps(sampler)
        kind, bands = mechanism(self, total), self.bands
        if kind != self.noise_kind and self.sampling_kind == "cyclic":
            log(f"amplified BandMF: {kind} noise with {bands} band{'s' * (bands != 1)} on cyclic Poisson "
                "sampling" + (" (one band: iid noise, DP-SGD's privatization)" if bands == 1 else "")
                + f"; the recipe's {self.noise_kind} noise is not amplified (--sampling fixed runs it on fixed-order "
                "batches)")
        elif kind != self.noise_kind:
            log(f"{self.noise_kind} noise (the recipe's default) is out of reach over {total} steps (at most "
                f"{MAX_DENSE_STEPS}): using {kind} noise (BandMF) instead")
        if kind == "mf" and SLOW_FACTORIZATION_STEPS < total <= MAX_DENSE_STEPS:
            log(f"optimising the {kind} factorization for {total} steps (once, before training; minutes at this "
                "size)")
        # cyclic sampling: the factorization's sensitivity is one participation's, amplified (privacy.correlated)
        period = total if isinstance(sampler.participation, CyclicPoissonSampling) else sampler.steps_per_epoch
        noise = build_noise(kind, 0.0, clip, stream, total, period, tree_decoder(self), bands,
                            *workload_rates(self))
        release = None
        if isinstance(noise, CorrelatedNoise):
            release = functools.partial(noise.whole_run, participation=sampler.participation)
            release(1.0)
        z = self.noise_multiplier
        horizon = total if self.calibration_epochs is None else self.calibration_epochs * sampler.steps_per_epoch
        if z is None and self.calibration == "advanced-composition":
            sum_sensitivity = 2.0 if Relation(self.relation) is Relation.REPLACE_ONE else 1.0  # in units of C
            z = advanced_composition_noise(self.epsilon, self.delta, horizon) * sum_sensitivity
            log(f"noise multiplier {z:.4f} from advanced composition (DPZero Lemma 2.2, no amplification) for "
                f"({self.epsilon}, {self.delta})-DP over {horizon} steps; the ledger reports the exact, lower "
                "epsilon")
        elif z is None:
            z = noise_multiplier_for(self.epsilon, self.delta, sampler.participation, horizon, self.accountant,
                                     self.relation, release)
            log(f"calibrated noise multiplier {z:.4f} for ({self.epsilon}, {self.delta})-DP over {horizon} steps "
                f"({kind} noise)")
        return noise.calibrated(z) if isinstance(noise, CorrelatedNoise) else GaussianNoise(z, clip, stream)
