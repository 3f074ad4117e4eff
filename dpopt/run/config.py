"""A run's configuration: ``TrainConfig``, the frozen record of every choice a run makes (saved with its
checkpoints), and its validation."""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Any

from dpopt import plan
from dpopt.algorithms import (CONFIGS, DEFAULT_TREE_DECODER, NON_PRIVATE, Hyperparameters, StepRule, hyperparameters_for,
                              settings_of)
from dpopt.algorithms.base import check_physical_batch_size
from dpopt.grad.graphs import check_choice
from dpopt.clipping import Clipping
from dpopt.data.datasets import DATASETS, check_dataset, default_epochs, default_model
from dpopt.data.samplers import SAMPLINGS
from dpopt.device import autocast_dtype, resolve_device
from dpopt.grad.engine import MODES, STRATEGIES
from dpopt.models import MODEL_TRAINABLE, check_model, hf_folder
from dpopt.noise.mechanisms import NOISES
from dpopt.plan import PrivacyPlan
from dpopt.privacy import Relation, check_budget
from dpopt.privacy.ledger import ACCOUNTANTS
from dpopt.schedules import Schedule


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
    bands: int = 0  # banded noise's bands and cyclic sampling's period (0: chosen by the plan)
    workload: str = "ones"  # what an optimised factorization targets (PrivacyPlan)
    tree_decoder: str | None = None  # None: the recipe's
    accountant: str = "pld"
    relation: str = "add-remove"
    per_example: str = "hooks"
    strategy: str = "auto"
    download: bool = False
    physical_batch_size: int | None = None  # examples per forward/backward; None: DEFAULT_PHYSICAL_BATCH (or all)
    device: str = "cpu"  # cpu, cuda, mps or auto (cuda, else mps, else cpu)
    precision: str = "fp32"  # fp32, bf16 or fp16 (CUDA): autocast forward/backward, float32 weights, sums, noise
    graph: str = "off"  # capture the clip stage as CUDA graphs: off, auto (where it can work) or on (dpopt.grad.graphs)
    checkpoint_every: int = 0  # also checkpoint after every N-th step within an epoch (0: at epoch ends only)
    trainable: str | None = None  # regular expression: train only the parameters whose names it matches (None:
    # the model's default, MODEL_TRAINABLE, set at construction; every weight where it has none)
    calibration: str = "accountant"  # or "advanced-composition" (DPZero Lemma 2.2: loose, for faithful reproductions)
    lr_schedule: str = "constant"  # or cosine, linear (dpopt.schedules), after a linear warm-up of ``warmup``
    warmup: float = 0.0  # a fraction of the run's steps if below 1, else a number of steps
    hyperparameters: Hyperparameters | None = None  # None: the algorithm's defaults (hyperparameters_for)

    def __post_init__(self) -> None:
        if self.hyperparameters is None:  # resolved here, so the config (and the checkpoint) holds what the run uses
            object.__setattr__(self, "hyperparameters", hyperparameters_for(self.algorithm))
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
        for name, known in [("sampling", ("auto", *SAMPLINGS)), ("noise", ("auto", *NOISES)),
                            ("per_example", MODES), ("strategy", STRATEGIES), ("accountant", ACCOUNTANTS)]:
            if getattr(self, name) not in known:
                raise ValueError(f"unknown {name} {getattr(self, name)!r}; choose one of {', '.join(sorted(known))}")
        plan.check_noise_settings(self)
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
        check_choice(self.graph)
        if self.graph == "on" and self.device == "cpu":
            raise ValueError("--graph on captures the step as a CUDA graph: it needs --device cuda; use --graph auto "
                             "or off on a CPU")
        if self.checkpoint_every < 0:
            raise ValueError(f"checkpoint_every must be >= 0 steps (0: at the end of each epoch only), "
                             f"got {self.checkpoint_every}")
        Relation(self.relation)
        Clipping(self.clip, self.clipping)
        Schedule(self.lr_schedule, self.warmup)  # an unknown schedule or a negative warm-up
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
        return plan.noise_kind(self)

    @property
    def sampling_kind(self) -> str:
        return plan.sampling_kind(self)

    def plan(self, dataset_size: int) -> PrivacyPlan:
        """The run's privacy plan over ``dataset_size`` examples (``batch_size`` set: see ``build_run``)."""
        return PrivacyPlan(self.algorithm, dataset_size, self.batch_size, self.epochs, epsilon=self.epsilon,
                           noise_multiplier=self.noise_multiplier, delta=self.delta, clip=self.clip,
                           clipping=self.clipping, noise=self.noise, sampling=self.sampling, bands=self.bands,
                           workload=self.workload, tree_decoder=self.tree_decoder, accountant=self.accountant,
                           relation=self.relation, calibration=self.calibration,
                           calibration_epochs=self.calibration_epochs, hyperparameters=self.hyperparameters)

    @property
    def schedule(self) -> Schedule:
        return Schedule(self.lr_schedule, self.warmup)

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
        data = _from_flat_hp(data)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown config keys: {', '.join(sorted(unknown))}")
        hp = {k: StepRule(**v) if isinstance(v, dict) else v  # a dict: a rule not yet resolved (to_dict's asdict)
              for k, v in data.get("hyperparameters", {}).items()}
        return cls(**{**data, "hyperparameters": CONFIGS[data.get("algorithm", "dp-sgd")](**hp)})


NOISE_SETTINGS = ("bands", "workload", "tree_decoder")


def _from_flat_hp(data: dict[str, Any]) -> dict[str, Any]:
    """A config saved with one flat ``hp`` record of every recipe's fields, as its family's ``hyperparameters``
    and the plan's noise settings (a checkpoint written before the typed configs)."""
    if "hp" not in data:
        return data
    data = dict(data)
    flat = data.pop("hp")
    own = settings_of(data.get("algorithm", "dp-sgd"))
    data.update({k: flat[k] for k in NOISE_SETTINGS if k in flat})
    if data.get("tree_decoder") == DEFAULT_TREE_DECODER.get(data.get("algorithm", "dp-sgd"), "sum"):
        data["tree_decoder"] = None  # the recipe's own
    data["hyperparameters"] = {k: v for k, v in flat.items() if k in own}
    return data
