"""The training loop: a private run from a config, with progress, evaluation, checkpoints and resume.

A run is a function of its config and its secret key: the public seed drives initialisation, the secret
streams (keyed by 256 bits of OS entropy drawn at the start of the run, or by an explicit ``secret_seed``
for replayable noise; per-draw OS entropy in secure mode) drive sampling and noise, both counter-based. The
key is kept only in the checkpoint (private), so ``resume`` continues a run to exactly the parameters and
epsilon of an uninterrupted one; metrics.json and the exported model (``OUT/model``) never hold it.
A checkpoint is written at the end of every epoch and, with ``checkpoint_every = N``, after every N-th
step within an epoch, with the epoch's partial statistics, so a run killed at any instant loses at most N
steps and its resumed history (losses, evaluations) is the uninterrupted run's. With ``parallel`` (see
``dpopt.distributed``) the process is one rank of a data-parallel run: rank 0 logs and writes.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from dpopt.algorithms import (ALGORITHMS, DECAYED_WORKLOAD, DEFAULT_NOISE, DEFAULT_SAMPLING, NON_PRIVATE,
                              DPOptimizer, Hyperparameters, Privatizer, StepRule, build_algorithm)
from dpopt.algorithms.base import check_physical_batch_size
from dpopt.checkpoint import CheckpointError, check_writable, load_checkpoint, save_checkpoint, write_atomic
from dpopt.clipping import Clipping
from dpopt.data.datasets import (DATASET_MODEL, DATASETS, Dataset, check_dataset, default_epochs, default_model,
                                 labels_of, load_dataset)
from dpopt.data.samplers import SAMPLINGS, Sampler, make_sampler, sampler_state, take
from dpopt.device import autocast_dtype, resolve_device, to_device
from dpopt.distributed import DataParallel
from dpopt.grad.engine import MODES, STRATEGIES, PerExampleEngine, check_per_example
from dpopt.models import MODEL_TRAINABLE, build_model, check_model, hf_folder
from dpopt.noise import factorizations as fz
from dpopt.noise.correlated import CorrelatedNoise
from dpopt.noise.gaussian import GaussianNoise
from dpopt.noise.mechanisms import MAX_DENSE_STEPS, NOISES, amplified_bands, build_noise
from dpopt.noise.rng import SecretStream, derive_seed, secret_key
from dpopt.privacy import (CyclicPoissonSampling, PoissonSampling, PrivacyLedger, Relation, advanced_composition_noise,
                           check_budget, noise_multiplier_for)
from dpopt import report
from dpopt.report import CURVES, LOG, TENSORBOARD, logging_to, plot_curves, tensorboard_writer
from dpopt.privacy.ledger import ACCOUNTANTS
from dpopt.privacy.statement import privacy_statement


CALIBRATIONS = ("accountant", "advanced-composition")
DEFAULT_BATCH = 128  # expected examples per logical batch unless a run says otherwise (or the whole set if smaller)
# Examples per forward/backward unless a run says otherwise: a logical batch of at most this many is one pass.
DEFAULT_PHYSICAL_BATCH = 256


@dataclass(frozen=True)
class TrainConfig:
    algorithm: str = "dp-sgd"
    dataset: str = "digits"  # a built-in name, or a CSV, JSONL or Parquet file or save_to_disk folder
    model: str | None = None  # a built-in name, hf:PATH (a save_pretrained folder) or module:function; None: the
    # dataset's default (default_model), set at construction
    text_column: str = "text"  # the columns of a dataset file
    label_column: str = "label"
    epsilon: float | None = None
    delta: float = 1e-5
    noise_multiplier: float | None = None
    epochs: int | None = None  # None: the dataset's default (default_epochs), set at construction
    calibration_epochs: int | None = None  # epochs --epsilon calibrated the noise for (None: epochs; see extended)
    batch_size: int | None = None  # None: DEFAULT_BATCH, or the whole training set if smaller (set by build_run)
    clip: float = 1.0
    clipping: str = "flat"
    seed: int = 0  # public: initialisation, projections, directions, dropout; never the secret streams
    secret_seed: int | None = None  # replayable noise (reproductions, tests); None: a fresh OS-entropy key
    secure: bool = False  # every secret draw from OS entropy, no key stored anywhere (resume is not exact)
    sampling: str = "auto"  # the recipe's (DEFAULT_SAMPLING) with its own noise and an epsilon; else poisson for iid
    # noise, fixed for correlated noise
    noise: str = "auto"  # the recipe's mechanism (DEFAULT_NOISE)
    accountant: str = "pld"
    relation: str = "add-remove"
    per_example: str = "hooks"
    strategy: str = "auto"
    download: bool = False
    physical_batch_size: int | None = None  # examples per forward/backward; None: DEFAULT_PHYSICAL_BATCH (or all)
    device: str = "cpu"  # cpu, cuda, mps or auto (cuda, else mps, else cpu)
    precision: str = "fp32"  # fp32, bf16 or fp16 (CUDA): autocast forward/backward, float32 weights, sums, noise
    checkpoint_every: int = 0  # also checkpoint after every N-th step within an epoch (0: at epoch ends only)
    trainable: str | None = None  # regular expression: train only the parameters whose names it matches (None:
    # the model's default, MODEL_TRAINABLE, set at construction; every weight where it has none)
    calibration: str = "accountant"  # or "advanced-composition" (DPZero Lemma 2.2: loose, for faithful reproductions)
    hp: Hyperparameters | None = None  # None: the algorithm's defaults (Hyperparameters.for_algorithm)

    def __post_init__(self) -> None:
        if self.hp is None:  # resolved here, so the config (and the checkpoint) holds the values the run uses
            object.__setattr__(self, "hp", Hyperparameters.for_algorithm(self.algorithm))
        if self.epochs is None:
            object.__setattr__(self, "epochs", default_epochs(self.dataset))
        if self.model is None:
            object.__setattr__(self, "model", default_model(self.dataset))
        if self.trainable is None:
            object.__setattr__(self, "trainable", MODEL_TRAINABLE.get(self.model))

    def validate(self) -> None:
        check_dataset(self.dataset)
        check_model(self.model)
        if hf_folder(self.model) is not None and self.dataset in DATASETS:
            raise ValueError(f"model {self.model!r} tokenizes its text itself and takes a dataset file "
                             f"(CSV, JSONL, Parquet, save_to_disk), not the built-in {self.dataset!r}")
        for name, known in [("algorithm", ALGORITHMS), ("sampling", ("auto", *SAMPLINGS)), ("noise", ("auto", *NOISES)),
                            ("per_example", MODES), ("strategy", STRATEGIES), ("accountant", ACCOUNTANTS)]:
            if getattr(self, name) not in known:
                raise ValueError(f"unknown {name} {getattr(self, name)!r}; choose one of {', '.join(sorted(known))}")
        if self.algorithm in NON_PRIVATE:
            if self.epsilon is not None or self.noise_multiplier not in (None, 0.0):
                raise ValueError(f"{self.algorithm} is not differentially private (no clipping, no noise), so it "
                                 "takes no epsilon or noise multiplier: omit them (the run reports epsilon = inf) "
                                 "or use a private algorithm such as dpzero")
        elif (self.epsilon is None) == (self.noise_multiplier is None):
            raise ValueError("give exactly one of epsilon (the noise is calibrated to it) or noise_multiplier")
        elif self.epsilon is not None:
            check_budget(self.epsilon, self.delta)
        elif not (math.isfinite(self.noise_multiplier) and self.noise_multiplier > 0):
            raise ValueError(f"noise multiplier must be a finite number > 0, got {self.noise_multiplier}")
        if not 0.0 < self.delta < 1.0:
            raise ValueError(f"delta must lie in (0, 1), got {self.delta}")
        if self.epochs < 1:
            raise ValueError(f"epochs must be >= 1, got {self.epochs}")
        if self.calibration_epochs not in (None, self.epochs) and (
                not 1 <= self.calibration_epochs < self.epochs or self.noise_kind != "gaussian"):
            raise ValueError(f"calibration_epochs must lie in [1, epochs] and applies to iid Gaussian noise only, "
                             f"got {self.calibration_epochs}")
        if self.secure and self.secret_seed is not None:
            raise ValueError("--secure draws every secret number from OS entropy and takes no --secret-seed "
                             "(replayable noise); give one or the other")
        check_physical_batch_size(self.physical_batch_size)
        if self.checkpoint_every < 0:
            raise ValueError(f"checkpoint_every must be >= 0 steps (0: at the end of each epoch only), "
                             f"got {self.checkpoint_every}")
        Relation(self.relation)
        Clipping(self.clip, self.clipping)
        autocast_dtype(self.precision, resolve_device(self.device))
        if self.calibration not in CALIBRATIONS:
            raise ValueError(f"unknown calibration {self.calibration!r}; choose one of {', '.join(CALIBRATIONS)}")
        if self.calibration != "accountant" and (self.epsilon is None or self.noise_kind != "gaussian"):
            raise ValueError(f"calibration {self.calibration!r} sets iid Gaussian noise from --epsilon; it does not "
                             "apply to a given noise multiplier, a non-private algorithm or correlated noise")
        if self.trainable is not None:
            try:
                re.compile(self.trainable)
            except re.error as e:
                raise ValueError(f"trainable {self.trainable!r} is not a regular expression: {e}") from None

    @property
    def noise_kind(self) -> str:
        return DEFAULT_NOISE.get(self.algorithm, "gaussian") if self.noise == "auto" else self.noise

    @property
    def sampling_kind(self) -> str:
        if self.sampling != "auto":
            return self.sampling
        if self.noise == "auto" and self.epsilon is not None and self.algorithm in DEFAULT_SAMPLING:
            return DEFAULT_SAMPLING[self.algorithm]  # cyclic: its period is chosen for the epsilon
        return "poisson" if self.noise_kind == "gaussian" else "fixed"

    @property
    def randomness(self) -> str:
        """How the secret streams are keyed: ``os-entropy-key``, ``secret-seed`` (replayable) or ``secure``."""
        return "secure" if self.secure else "os-entropy-key" if self.secret_seed is None else "secret-seed"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def public_dict(self) -> dict[str, Any]:
        """``to_dict`` without the secret seed: what metrics.json shows."""
        return {k: v for k, v in self.to_dict().items() if k != "secret_seed"}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TrainConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown config keys: {', '.join(sorted(unknown))}")
        hp = {k: tuple(v) if isinstance(v, list) else StepRule(**v) if isinstance(v, dict) else v
              for k, v in data.get("hp", {}).items()}  # a dict: an lr rule not yet resolved (to_dict's asdict)
        return cls(**{**data, "hp": Hyperparameters(**hp)})


def logits_of(model: nn.Module, batch: Any) -> torch.Tensor:
    """Class scores for a batch of (inputs, labels) or of a dict of model inputs with "labels"."""
    out = model(**{k: v for k, v in batch.items() if k != "labels"}) if isinstance(batch, dict) else model(batch[0])
    return out.logits if hasattr(out, "logits") else out


def classification_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    return F.cross_entropy(logits_of(model, batch), labels_of(batch), reduction="none")


@torch.no_grad()
def accuracy(model: nn.Module, data: Any, batch_size: int = 1024, parallel: DataParallel | None = None) -> float:
    """Accuracy on ``data``; with ``parallel``, each rank evaluates its share and the counts are summed."""
    was_training = model.training
    model.eval()
    n = len(labels_of(data))
    index = torch.arange(n)
    if parallel is not None:
        index = torch.tensor_split(index, parallel.world_size)[parallel.rank]
    correct = 0
    device = next(model.parameters()).device
    for chunk in index.split(batch_size):
        batch = to_device(take(data, chunk), device)
        correct += int((logits_of(model, batch).argmax(-1) == labels_of(batch)).sum())
    model.train(was_training)
    if parallel is not None:
        correct = int(parallel.total([correct])[0])
    return correct / n


@dataclass
class Run:
    """Everything a run is made of, built from its config."""

    config: TrainConfig
    data: Dataset
    model: nn.Module
    optimizer: DPOptimizer
    sampler: Any
    ledger: PrivacyLedger
    total_steps: int
    secret_key: int | bytes | None  # private: the checkpoint holds it, nothing else may


def build_run(config: TrainConfig, log: Callable[[str], None] = print, parallel: DataParallel | None = None,
              key: int | bytes | None = None) -> Run:
    """The run of ``config``; ``key`` is its secret key when resuming (None: a new one, see ``secret_key``)."""
    config.validate()
    data = load_dataset(config.dataset, config.download, config.text_column, config.label_column,
                        hf_folder(config.model))
    if data.note is not None:
        log(data.note)
    n = len(data)
    if config.delta >= 1.0 / n:
        warnings.warn(f"delta = {config.delta:g} is not below 1/n = {1 / n:.3g}: such a guarantee allows "
                      "releasing an example outright; use delta << 1/n", stacklevel=2)
    torch.manual_seed(derive_seed(config.seed, "public", "init"))
    device = resolve_device(config.device)
    if DATASET_MODEL.get(config.dataset) == config.model:
        log(f"model: {config.model} ({config.dataset}'s default; --model sets it)")
    model = build_model(config.model, data).to(device)
    model.train()  # from step 0 (from_pretrained returns eval mode), as the HF Trainer and Opacus train
    if config.trainable is not None:
        default = config.trainable == MODEL_TRAINABLE.get(config.model)
        log(freeze_all_but(model, config.trainable)
            + (f" ({config.model}'s default; --trainable . trains every weight)" if default else ""))
    engine = PerExampleEngine(model, classification_loss, config.per_example, config.strategy, config.precision)
    engine.check_no_mixing()
    check_per_example(model, classification_loss, to_device(take(data.train, torch.arange(min(8, n))), device))

    if config.secure:
        key = None
    elif key is None:
        key = secret_key(config.secret_seed)
    if config.batch_size is None:  # the config keeps the value the run uses
        config = dataclasses.replace(config, batch_size=min(DEFAULT_BATCH, n))
    if config.sampling_kind == "cyclic" and not config.hp.bands:  # the config keeps the period the run uses
        config = dataclasses.replace(config, hp=dataclasses.replace(config.hp, bands=cyclic_period(config, n)))
        period = config.hp.bands
        log(f"cyclic sampling: period {period} " + ("(plain Poisson sampling, iid noise)" if period == 1 else
                                                    "(groups taken in turn, and the noise's bands)")
            + f", the least noise on the workload at epsilon {config.epsilon} (--bands sets it)")
    sampler = make_sampler(config.sampling_kind, n, config.batch_size, SecretStream(key, "sampling"), config.hp.bands)
    total = config.epochs * sampler.steps_per_epoch
    for name, rule in config.hp.rules().items():  # set by the run's length: the config keeps the value used
        flag = "--" + name.replace("_", "-")
        log(f"{config.algorithm}: {name} = {rule} = {rule(total):.3g} over {total} steps "
            f"(its default depends on the run's length; {flag} sets it)")
    config = dataclasses.replace(config, hp=config.hp.for_run(total))
    clipping = Clipping(config.clip, config.clipping)
    ledger = PrivacyLedger(config.relation, config.accountant)
    noise = build_run_noise(config, sampler, total, clipping.sensitivity, SecretStream(key, "noise"), log)
    privatizer = Privatizer(clipping, noise, sampler, ledger, parallel)
    physical = min(DEFAULT_PHYSICAL_BATCH, n) if config.physical_batch_size is None else config.physical_batch_size
    if physical > n:
        raise ValueError(f"the physical batch size ({physical}) exceeds the {n} training examples")
    optimizer = build_algorithm(config.algorithm, engine, privatizer, config.hp, physical)
    return Run(config, data, model, optimizer, sampler, ledger, total, key)


def freeze_all_but(model: nn.Module, pattern: str) -> str:
    """Train only the parameters whose names match ``pattern`` (``re.search``); freeze the rest. The frozen
    ones never see the data, so the privacy guarantee covers exactly what is trained."""
    names = [n for n, _ in model.named_parameters()]
    chosen = [n for n in names if re.search(pattern, n)]
    if not chosen:
        raise ValueError(f"trainable {pattern!r} matches no parameter of the model; its parameters are named "
                         f"{', '.join(names[:6])}{', ...' if len(names) > 6 else ''}")
    for name, p in model.named_parameters():
        p.requires_grad_(name in chosen)
    kept = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return f"training {len(chosen)} of {len(names)} parameter tensors ({kept:,} of " \
           f"{sum(p.numel() for p in model.parameters()):,} numbers) matching {pattern!r}"


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


def _state(run: Run, history: list[dict[str, Any]], wall: float, cpu: float, epoch_losses: list[float],
           epoch_nonfinite: int, epoch_clipped: tuple[int, int] | list[int] = (0, 0)) -> dict[str, Any]:
    """A checkpoint: model, optimizer, ledger, sampler and RNG state, and the current epoch's partial statistics.
    The secret streams and the sampler are counter-based (their state is the run's secret key plus the next
    step: the key makes the checkpoint private); the public torch generator is re-seeded every step and is
    saved as well."""
    steps = run.optimizer.steps
    if run.ledger.steps != steps:
        raise RuntimeError(f"refusing to checkpoint: the ledger holds {run.ledger.steps} releases but the "
                           f"optimizer took {steps} steps")
    return {"format": "dpopt-checkpoint-1", "config": run.config.to_dict(),
            "model": run.model.state_dict(), "optimizer": run.optimizer.state_dict(),
            "ledger": run.ledger.to_dict(), "step": steps, "sampler": sampler_state(run.sampler, steps),
            "rng": {"torch": torch.get_rng_state(), "secret_next_step": steps, "secure": run.config.secure,
                    "secret_key": run.secret_key},
            "history": history, "wall_time_s": wall, "cpu_time_s": cpu,
            "epoch_losses": list(epoch_losses), "epoch_nonfinite": epoch_nonfinite,
            "epoch_clipped": list(epoch_clipped)}


def _saved_key(state: dict[str, Any]) -> int | bytes | None:
    """The secret key a checkpoint holds; refuses one written before keys were (its noise came from the
    public seed), since resuming it with a new key would not continue the same run."""
    if "secret_key" not in state.get("rng", {}):
        raise CheckpointError("the checkpoint holds no secret key (an older dpopt wrote it and derived the noise "
                              "from the public seed); start a new run")
    return state["rng"]["secret_key"]


def _check_complete(state: dict[str, Any]) -> None:
    """Refuse a checkpoint written before its sampler, RNG state and CPU time were recorded."""
    missing = {"sampler", "rng", "cpu_time_s"} - set(state)
    if missing:
        raise CheckpointError(f"the checkpoint lacks {', '.join(sorted(missing))} (an older dpopt wrote it); "
                              "start a new run")


def saved_steps_per_epoch(state: dict[str, Any]) -> int:
    """The steps per epoch of the run a checkpoint holds (what ``extended`` names its noise by)."""
    _check_complete(state)
    return state["sampler"]["steps_per_epoch"]


def _restore(run: Run, state: dict[str, Any]) -> None:
    """Load a checkpoint into a freshly built run; refuses one that this config does not rebuild exactly."""
    _check_complete(state)
    run.model.load_state_dict(state["model"])
    run.optimizer.load_state_dict(state["optimizer"])
    run.ledger.entries = PrivacyLedger.from_dict(state["ledger"]).entries
    if run.ledger.steps != run.optimizer.steps:
        raise CheckpointError(f"checkpoint is inconsistent: the ledger holds {run.ledger.steps} releases but "
                              f"the optimizer took {run.optimizer.steps} steps; do not resume from it")
    if state["sampler"] != sampler_state(run.sampler, run.optimizer.steps):
        raise CheckpointError(f"the checkpoint's sampler {state['sampler']} differs from the one this run builds "
                              f"{sampler_state(run.sampler, run.optimizer.steps)}: the dataset or the sampling "
                              "changed since the checkpoint was written; start a new run")
    torch.set_rng_state(state["rng"]["torch"])


def _silent(_: str) -> None:
    pass


def train(config: TrainConfig, out: str | Path | None = None, progress: bool = True,
          log: Callable[[str], None] = print, _resume_state: dict[str, Any] | None = None,
          parallel: DataParallel | None = None) -> dict[str, Any]:
    """Run (or, with ``_resume_state``, continue) a private training run; returns the metrics. With
    ``parallel`` this process is one rank of a data-parallel run; only rank 0 logs and writes to ``out``."""
    if parallel is not None and not parallel.lead:
        out, progress, log = None, False, _silent
    writer = None
    if out is not None:
        out = check_writable(out)
        log = logging_to(out / LOG, log)
        writer = tensorboard_writer(out / TENSORBOARD, None if _resume_state is None else _resume_state["step"] + 1)
        if writer is None:
            log("tensorboard is not installed: no TensorBoard events (pip install tensorboard)")
    if _resume_state is not None:
        log(f"resuming {config.algorithm} on {config.dataset} from step {_resume_state['step']}")
    run = build_run(config, log, parallel, None if _resume_state is None else _saved_key(_resume_state))
    history: list[dict[str, Any]] = []
    losses: list[float] = []  # this epoch's step losses
    epoch_nonfinite = 0
    epoch_clipped = [0, 0]  # this epoch's clipped and clip-stage examples
    wall = cpu = 0.0
    if _resume_state is not None:
        _restore(run, _resume_state)
        history = list(_resume_state["history"])
        losses = list(_resume_state.get("epoch_losses", []))
        epoch_nonfinite = int(_resume_state.get("epoch_nonfinite", 0))
        epoch_clipped = list(_resume_state.get("epoch_clipped", [0, 0]))
        wall, cpu = float(_resume_state["wall_time_s"]), float(_resume_state["cpu_time_s"])
    if parallel is not None:
        parallel.broadcast_(run.optimizer.params)  # rank 0's starting point everywhere
    per_epoch, every = run.sampler.steps_per_epoch, config.checkpoint_every
    nonfinite = sum(h.get("nonfinite", 0) for h in history)
    start, cpu_start = time.perf_counter() - wall, time.process_time() - cpu
    while run.optimizer.steps < run.total_steps:
        epoch, done = divmod(run.optimizer.steps, per_epoch)
        bar = tqdm(initial=done, total=per_epoch, desc=f"epoch {epoch + 1}/{config.epochs}", disable=not progress,
                   leave=False, miniters=1)  # advanced by hand: an iterating bar's count lags its postfix's redraws
        for _ in range(done, per_epoch):
            torch.manual_seed(derive_seed(config.seed, "public", "step", run.optimizer.steps))  # dropout; not secret
            result = run.optimizer.step(run.data.train)
            epoch_nonfinite += result.nonfinite
            epoch_clipped = [epoch_clipped[0] + result.clipped, epoch_clipped[1] + result.examples]
            steps = run.optimizer.steps
            if result.loss is not None:
                losses.append(result.loss)
                if writer is not None:
                    writer.add_scalar("train/loss", result.loss, steps)
            if progress:
                bar.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.4f}" if losses else "-",
                                acc=f"{history[-1]['test_accuracy']:.4f}" if history else "-",
                                eps=bar_epsilon(run.ledger, config.delta), refresh=False)
                bar.update()
            if out is not None and every and steps % every == 0 and steps % per_epoch:  # epoch ends: below
                save_checkpoint(out, _state(run, history, time.perf_counter() - start,
                                            time.process_time() - cpu_start, losses, epoch_nonfinite,
                                            epoch_clipped))
        bar.close()
        if epoch_nonfinite and (parallel is None or parallel.lead):
            warnings.warn(f"{epoch_nonfinite} examples had non-finite gradients in epoch {epoch + 1}; "
                          "they contributed zero to the update", stacklevel=2)
        nonfinite += epoch_nonfinite
        acc = accuracy(run.model, run.data.test, parallel=parallel)
        eps = run.ledger.epsilon(config.delta)
        history.append({"epoch": epoch + 1, "step": run.optimizer.steps, "test_accuracy": acc, "epsilon": eps,
                        "train_loss": sum(losses) / max(1, len(losses)), "nonfinite": epoch_nonfinite,
                        "clipped_fraction": epoch_clipped[0] / max(1, epoch_clipped[1])})
        losses, epoch_nonfinite, epoch_clipped = [], 0, [0, 0]
        if out is not None:
            wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
            save_checkpoint(out, _state(run, history, wall, cpu, losses, epoch_nonfinite, epoch_clipped))
            _write_metrics(out, _metrics(run, history, nonfinite, wall, cpu, finished=False))
        if writer is not None:
            for key, value in history[-1].items():
                writer.add_scalar(f"eval/{key}", value, run.optimizer.steps)
            writer.flush()  # on disk with the checkpoint, so that a resumed run continues them
        log(f"epoch {epoch + 1}/{config.epochs}: test accuracy {acc:.4f}, epsilon {eps:.4g}")
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    metrics = _metrics(run, history, nonfinite, wall, cpu, finished=True)
    warning = chance_warning(run, history[-1])
    if warning is not None:
        metrics["warning"] = warning
        if parallel is None or parallel.lead:
            warnings.warn(warning, stacklevel=2)
    if out is not None:
        _write_metrics(out, metrics)
        export_model(run.model, Path(out, MODEL_DIR), hf_folder(config.model))
        if plot_curves(history, out / CURVES) is None:
            log(f"matplotlib is not installed: no {CURVES} (pip install matplotlib)")
    if writer is not None:
        writer.close()
    log(metrics["privacy_statement"])
    return metrics


def chance_warning(run: Run, last: dict[str, Any]) -> str | None:
    """``report.chance_warning`` for a run whose last evaluation is ``last``: the noise-to-signal ratio
    sigma * sqrt(d) / B is the norm of the noise N(0, sigma^2 C^2 I_d) over the largest norm of a clipped sum of
    B (expected batch) examples, B * C; clipped is the fraction of the last epoch's examples clipped."""
    d = sum(p.numel() for p in run.optimizer.params)
    ratio = run.optimizer.privatizer.noise.noise_multiplier * math.sqrt(d) / run.config.batch_size
    return report.chance_warning(
        last["test_accuracy"], run.data.num_classes, f"sigma * sqrt(d) / B, d = {d} parameters, "
        f"B = {run.config.batch_size}", ratio, last.get("clipped_fraction", 0.0),
        "use a larger --batch-size or --epsilon, or train fewer weights (a smaller model, or --trainable: e.g. "
        "a pretrained model's head)",
        f"each step moves at most lr * C = {run.config.hp.lr * run.config.clip:.3g}; raise --clip or --lr")


def bar_epsilon(ledger: PrivacyLedger, delta: float) -> str:
    """The epsilon spent so far, for the progress bar after every step: by RDP where it applies (cached per
    release, so microseconds a step; an upper bound like the PLD guarantee, usually a little above it), else
    by the run's accountant; labelled with the accountant used."""
    try:
        return f"{ledger.epsilon(delta, 'rdp'):.3g} (RDP)"
    except ValueError:
        return f"{ledger.epsilon(delta):.3g} ({ledger.accountant.upper()})"


def _write_metrics(out: Path, metrics: dict[str, Any]) -> None:
    write_atomic(out / "metrics.json", lambda f: f.write(json.dumps(metrics, indent=2).encode()))


def _metrics(run: Run, history: list[dict[str, Any]], nonfinite: int, wall: float, cpu: float,
             finished: bool) -> dict[str, Any]:
    """metrics.json: the run so far (``finished`` False after an evaluation before the last), never a secret."""
    config = run.config
    metrics = {
        "algorithm": config.algorithm, "dataset": config.dataset, "model": config.model,
        "noise": run_noise_kind(config, run.total_steps), "sampling": config.sampling_kind,
        "test_accuracy": history[-1]["test_accuracy"], "epsilon": run.ledger.epsilon(config.delta),
        "delta": config.delta, "steps": run.optimizer.steps, "epochs": config.epochs,
        "noise_multiplier": run.optimizer.privatizer.noise.noise_multiplier,
        "sample_rate": (run.sampler.participation.rate if isinstance(run.sampler.participation, PoissonSampling)
                        else None),
        "accountant": config.accountant, "relation": config.relation, "nonfinite_examples": nonfinite,
        "wall_time_s": wall, "cpu_time_s": cpu, "threads": torch.get_num_threads(),
        "device": str(run.optimizer.device), "precision": config.precision, "history": history,
        "ledger": run.ledger.to_dict(),
        "secret_randomness": config.randomness, "config": config.public_dict(), "finished": finished,
    }
    metrics["privacy_statement"] = privacy_statement(run.ledger, config.delta, len(run.data),
                                                     randomness=config.randomness)
    return metrics


MODEL_DIR = "model"


def export_model(model: nn.Module, folder: Path, tokenizer: str | None = None) -> Path:
    """Write the trained model for publishing, with no secret in it: ``save_pretrained`` for a Hugging Face
    model (with the tokenizer saved in the folder ``tokenizer``, if given), else ``model.pt`` holding only the
    state_dict (parameters and buffers). Never the checkpoint, which holds the secret key, the optimizer and
    the ledger."""
    folder.mkdir(parents=True, exist_ok=True)
    if hasattr(model, "save_pretrained"):
        model.save_pretrained(folder)
        if tokenizer is not None:
            from transformers import AutoTokenizer

            AutoTokenizer.from_pretrained(tokenizer).save_pretrained(folder)
        return folder
    return write_atomic(folder / "model.pt", lambda f: torch.save(model.state_dict(), f))


def extended(config: TrainConfig, epochs: int | None, steps_per_epoch: int) -> TrainConfig:
    """``config`` run to ``epochs`` (None: as it is) when resuming. Extending keeps the noise calibrated for the
    original length, so the extra steps spend more privacy (the ledger accounts for every one); correlated noise
    is built for a fixed number of steps and cannot be extended (the refusal names the run's mechanism, which
    depends on its ``config.epochs * steps_per_epoch`` steps)."""
    if epochs is None or epochs == config.epochs:
        return config
    if epochs < config.epochs:
        raise ValueError(f"--epochs {epochs} is below the run's {config.epochs}: a resumed run can be extended, "
                         "not shortened")
    if config.algorithm not in NON_PRIVATE and config.noise_kind != "gaussian":
        kind = run_noise_kind(config, config.epochs * steps_per_epoch)
        raise ValueError(f"{kind} noise is built for the run's {config.epochs} epochs and cannot be "
                         f"extended to {epochs}; start a new run")
    return dataclasses.replace(config, epochs=epochs, calibration_epochs=config.calibration_epochs or config.epochs)


def resume(out: str | Path, progress: bool = True, log: Callable[[str], None] = print,
           parallel: DataParallel | None = None, epochs: int | None = None,
           state: dict[str, Any] | None = None) -> dict[str, Any]:
    """Continue the run whose checkpoint is in ``out`` to its configured end, or to ``epochs`` (see ``extended``;
    with ``parallel``, rank 0 reads the checkpoint and sends it to the other ranks). ``state``: that checkpoint,
    where the caller has read it already (the CLI, to check the flags), so it is not read and held twice."""
    read = (lambda: load_checkpoint(out)) if state is None else (lambda: state)
    state = read() if parallel is None else parallel.from_lead(read)
    saved = TrainConfig.from_dict(state["config"])
    config = extended(saved, epochs, saved_steps_per_epoch(state))
    if config is not saved and (parallel is None or parallel.lead):
        log(f"extending the run from {saved.epochs} to {epochs} epochs: the noise stays as calibrated for "
            f"{config.calibration_epochs} epochs, so epsilon grows past the target with every extra step "
            "(the ledger accounts for each)")
    return train(config, out, progress, log, _resume_state=state, parallel=parallel)
