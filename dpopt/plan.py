"""The privacy plan of a run: which noise mechanism runs, with which sampling, calibrated to which target."""

from __future__ import annotations

import functools
from typing import Callable, TYPE_CHECKING

from dpopt.algorithms import DECAYED_WORKLOAD, NON_PRIVATE
from dpopt.data.samplers import Sampler
from dpopt.noise import factorizations as fz
from dpopt.noise.correlated import CorrelatedNoise
from dpopt.noise.gaussian import GaussianNoise
from dpopt.noise.mechanisms import MAX_DENSE_STEPS, amplified_bands, build_noise
from dpopt.noise.rng import SecretStream
from dpopt.privacy import CyclicPoissonSampling, Relation, advanced_composition_noise, noise_multiplier_for

if TYPE_CHECKING:
    from dpopt.run.config import TrainConfig


def workload_rates(config: TrainConfig) -> tuple[float, float]:
    """(momentum, decay) of the workload an optimised factorization targets: with ``--workload true`` the run's
    momentum and, for the SRG recipes, its decay; else 0 and 0 (prefix sums)."""
    hp = config.hp
    if hp.workload != "true":
        return 0.0, 0.0
    return hp.momentum, hp.decay if config.algorithm in DECAYED_WORKLOAD else 0.0


def cyclic_period(config: TrainConfig, n: int) -> int:
    """``amplified_bands`` for a run of ``config`` over ``n`` examples, on the workload its noise targets."""
    if config.epsilon is None:
        raise ValueError("--sampling cyclic chooses its period (and the noise's bands) for an --epsilon; with a "
                         "--noise-multiplier give --bands")
    steps = config.epochs * max(1, round(n / config.batch_size))
    rates = workload_rates(config) if run_noise_kind(config, steps) != "sqrt" else (0.0, 0.0)
    workload = fz.workload_coefficients(steps, *rates)
    return amplified_bands(config.epsilon, config.delta, n, config.batch_size, steps, workload, config.accountant,
                           config.relation)


SLOW_FACTORIZATION_STEPS = 1024  # beyond it, optimising a dense mf factorization takes minutes: say so


def run_noise_kind(config: TrainConfig, steps: int) -> str:
    """The noise mechanism of a run of ``steps`` steps: ``config.noise_kind``, except that a recipe's default
    correlated noise (``--noise auto``) gives way to ``banded`` under cyclic sampling (which amplifies banded noise
    only), and its dense ``mf`` beyond ``MAX_DENSE_STEPS`` steps, where the dense optimiser is out of reach (an
    explicit ``--noise mf`` is refused there instead)."""
    kind = config.noise_kind
    if config.noise != "auto" or kind == "gaussian":
        return kind
    return "banded" if config.sampling_kind == "cyclic" or (kind == "mf" and steps > MAX_DENSE_STEPS) else kind


def build_run_noise(config: TrainConfig, sampler: Sampler, total: int, clip: float, stream: SecretStream,
                    log: Callable[[str], None] = print) -> GaussianNoise | CorrelatedNoise:
    """The run's noise mechanism (``config.noise_kind``), calibrated to ``config.epsilon`` if given. Correlated
    noise is built for the whole run (``total`` steps, examples recurring every epoch) and refuses a sampling
    its sensitivity does not cover before anything is calibrated."""
    if config.algorithm in NON_PRIVATE:
        log(f"{config.algorithm} is NOT differentially private: it releases un-noised statistics (epsilon = inf)")
        return GaussianNoise(0.0, clip, stream)
    kind, hp = run_noise_kind(config, total), config.hp
    if kind != config.noise_kind and config.sampling_kind == "cyclic":
        log(f"amplified BandMF: {kind} noise with {hp.bands} band{'s' * (hp.bands != 1)} on cyclic Poisson sampling"
            + (" (one band: iid noise, DP-SGD's privatization)" if hp.bands == 1 else "")
            + f"; the recipe's {config.noise_kind} noise is not amplified (--sampling fixed runs it on fixed-order "
            "batches)")
    elif kind != config.noise_kind:
        log(f"{config.noise_kind} noise (the recipe's default) is out of reach over {total} steps (at most "
            f"{MAX_DENSE_STEPS}): using {kind} noise (BandMF) instead")
    if kind == "mf" and SLOW_FACTORIZATION_STEPS < total <= MAX_DENSE_STEPS:
        log(f"optimising the {kind} factorization for {total} steps (once, before training; minutes at this size)")
    # cyclic sampling: the factorization's sensitivity is one participation's, amplified (privacy.correlated)
    period = total if isinstance(sampler.participation, CyclicPoissonSampling) else sampler.steps_per_epoch
    noise = build_noise(kind, 0.0, clip, stream, total, period, hp.tree_decoder, hp.bands, *workload_rates(config))
    release = None
    if isinstance(noise, CorrelatedNoise):
        release = functools.partial(noise.whole_run, participation=sampler.participation)
        release(1.0)
    z = config.noise_multiplier
    total = (config.calibration_epochs or config.epochs) * sampler.steps_per_epoch  # iid: its calibration horizon
    if z is None and config.calibration == "advanced-composition":
        sum_sensitivity = 2.0 if Relation(config.relation) is Relation.REPLACE_ONE else 1.0  # in units of C
        z = advanced_composition_noise(config.epsilon, config.delta, total) * sum_sensitivity
        log(f"noise multiplier {z:.4f} from advanced composition (DPZero Lemma 2.2, no amplification) for "
            f"({config.epsilon}, {config.delta})-DP over {total} steps; the ledger reports the exact, lower epsilon")
    elif z is None:
        z = noise_multiplier_for(config.epsilon, config.delta, sampler.participation, total, config.accountant,
                                 config.relation, release)
        log(f"calibrated noise multiplier {z:.4f} for ({config.epsilon}, {config.delta})-DP over {total} steps "
            f"({kind} noise)")
    return noise.calibrated(z) if isinstance(noise, CorrelatedNoise) else GaussianNoise(z, clip, stream)
