"""A federated run as a frozen, serialisable config, and everything built from it.

The same ``FederatedConfig`` drives the in-process simulator and the Flower apps; both build the same
``Setup`` from it (method, message clipping, local noise, problem), and both use the public schedules
below (which clients the server asks each round, and which of them drop out in a simulated failure), so
a run is the same run on either engine.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from dpopt.data.datasets import DATASETS, load_dataset
from dpopt.device import resolve_device, to_device
from dpopt.federated.partition import SPLITS, partition
from dpopt.federated.privacy import LocalNoise, check_calibration, noise_std_for
from dpopt.federated.problem import FlatLayout, ModelOracle, Problem
from dpopt.federated.rules import ALGORITHMS, CLIP_MODES, MessageClipping, Method
from dpopt.models import MODELS, build_model
from dpopt.noise.rng import derive_seed, public_generator, secret_key
from dpopt.privacy import check_budget
from dpopt.task import accuracy

ENGINES = ("inprocess", "flower")
RENAMED_KEYS = {"tau": "clip", "noise_calibration": "calibration"}
FAILURE_POLICIES = ("continue", "abort")


@dataclass(frozen=True)
class FederatedConfig:
    algorithm: str = "clip21-sgd2m"
    dataset: str = "digits"
    model: str = "mlp"
    clients: int = 10
    rounds: int = 100
    epsilon: float | None = None
    delta: float = 1e-5
    noise_multiplier: float | None = None  # σ_ω / sensitivity (the paper's noise-to-clip ratio, global clipping)
    calibration: str = "accountant"  # or "advanced-composition": the paper's closed form (Corollary 1)
    clip: float = 1.0  # the clip radius tau of every message
    clipping: str = "flat"
    lr: float = 0.1
    beta: float | None = None  # None: 0.1 for clip21-sgd2m, 1 otherwise
    beta_hat: float | None = None  # None: 1
    batch_size: int | None = 32  # per client and round; None: all local data
    split: str = "iid"
    dirichlet_alpha: float = 0.5
    participation: float = 1.0
    dropout: float = 0.0
    on_failure: str = "continue"
    seed: int = 0  # public: partition, initialisation, participation, dropout; never the secret streams
    eval_every: int = 10
    device: str = "cpu"  # the in-process engine's model, data, client states and noise (Flower runs on the CPU)

    def validate(self) -> None:
        for name, known in [("dataset", DATASETS), ("model", MODELS), ("split", SPLITS),
                            ("on_failure", FAILURE_POLICIES)]:
            if getattr(self, name) not in known:
                raise ValueError(f"unknown {name} {getattr(self, name)!r}; choose one of {', '.join(sorted(known))}")
        for name in ("clients", "rounds", "eval_every"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"{name} must be an integer >= 1, got {value}")
        if (self.epsilon is None) == (self.noise_multiplier is None):
            raise ValueError("give exactly one of epsilon (the noise is calibrated to it) or noise_multiplier "
                             "(0 for a run without privacy)")
        if self.epsilon is not None:
            check_budget(self.epsilon, self.delta)
        elif not (math.isfinite(self.noise_multiplier) and self.noise_multiplier >= 0):
            raise ValueError(f"noise multiplier must be a finite number >= 0, got {self.noise_multiplier}")
        if not 0.0 < self.delta < 1.0:
            raise ValueError(f"delta must lie in (0, 1), got {self.delta}")
        if not 0.0 < self.participation <= 1.0:
            raise ValueError(f"participation (the fraction of clients asked each round) must lie in (0, 1], "
                             f"got {self.participation}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout (the probability that an asked client fails) must lie in [0, 1), "
                             f"got {self.dropout}")
        if self.batch_size is not None and not (isinstance(self.batch_size, int) and self.batch_size >= 1):
            raise ValueError(f"batch size must be an integer >= 1 (or None for all local data), got {self.batch_size}")
        if self.split == "dirichlet" and not self.dirichlet_alpha > 0:
            raise ValueError(f"the Dirichlet concentration alpha must be > 0, got {self.dirichlet_alpha}")
        MessageClipping(self.clip, self.clipping, [1])
        check_calibration(self.calibration)
        self.method()
        resolve_device(self.device)

    def method(self) -> Method:
        beta = self.beta if self.beta is not None else (0.1 if self.algorithm == "clip21-sgd2m" else 1.0)
        return Method(self.algorithm, self.lr, beta, self.beta_hat if self.beta_hat is not None else 1.0)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "FederatedConfig":
        data = json.loads(text)
        for old in data.keys() & RENAMED_KEYS.keys():
            raise ValueError(f"federated config key {old!r} is now {RENAMED_KEYS[old]!r}")
        unknown = set(data) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown federated config keys: {', '.join(sorted(unknown))}")
        return cls(**data)


@dataclass
class Setup:
    """What a run is made of: the same on every engine."""

    config: FederatedConfig
    method: Method
    clipping: MessageClipping
    noise: LocalNoise
    problem: Problem
    secret_key: int | bytes  # the clients' secret streams (noise, batches): never sent to the server

    @property
    def randomness(self) -> str:
        """``secret-seed`` (replayable) or ``os-entropy-key`` (a key drawn for this run and never stored)."""
        return "secret-seed" if isinstance(self.secret_key, int) else "os-entropy-key"


def classification_problem(config: FederatedConfig, key: int | bytes | None,
                           parts: Sequence[torch.Tensor] | None = None) -> Problem:
    """The config's dataset split over its clients (by ``config.split``, or the given ``parts``: one index
    tensor into the training set per client), its model (initialised from the public seed), the
    cross-entropy objective, and the test accuracy of the server model."""
    data = load_dataset(config.dataset)
    device = resolve_device(config.device)
    x_train, y_train = to_device(data.train, device)
    if parts is None:
        parts = partition(data.train[1], config.clients, config.split, config.dirichlet_alpha, config.seed)
    elif len(parts) != config.clients or any(len(p) == 0 for p in parts):
        raise ValueError(f"a given partition needs {config.clients} non-empty index sets (one per client), "
                         f"got {[len(p) for p in parts]}")
    torch.manual_seed(derive_seed(config.seed, "public", "init"))
    model = build_model(config.model, data).to(device)
    layout = FlatLayout.of(model)
    oracle = ModelOracle(model, lambda out, y: F.cross_entropy(out, y, reduction="none"), x_train, y_train, parts,
                         config.batch_size, key)

    def evaluate(x: torch.Tensor) -> dict[str, float]:
        torch.nn.utils.vector_to_parameters(x, [p for p in model.parameters() if p.requires_grad])
        return {"test_accuracy": accuracy(model, data.test)}

    return Problem(oracle, layout.flatten(model), layout.sizes, [len(p) for p in parts], evaluate, data.num_classes,
                   model)


def build_setup(config: FederatedConfig, problem: Problem | None = None, key: int | bytes | None = None) -> Setup:
    """Validate the config and build the run; ``problem`` replaces the config's dataset and model.

    ``key`` keys the clients' secret streams: an integer secret seed makes the noise replayable (reproductions,
    tests); None draws a fresh key from OS entropy, which nothing stores. It is never part of the config, so
    the server (which gets the config) never learns it; a Flower client passes its own."""
    config.validate()
    key = secret_key() if key is None else key
    problem = problem if problem is not None else classification_problem(config, key)
    if problem.clients != config.clients:
        raise ValueError(f"the problem has {problem.clients} clients but the config says {config.clients}")
    clipping = MessageClipping(config.clip, config.clipping, problem.block_sizes)
    if config.epsilon is not None:
        std = noise_std_for(clipping.sensitivity, config.rounds, config.epsilon, config.delta, config.calibration)
    else:
        std = config.noise_multiplier * clipping.sensitivity
    return Setup(config, config.method(), clipping, LocalNoise(std, clipping.sensitivity), problem, key)


def participants(config: FederatedConfig, round: int) -> list[int]:
    """The clients the server asks in ``round`` (public): all, or a uniform subset of ⌈p·n⌉ of them."""
    n = config.clients
    if config.participation >= 1.0:
        return list(range(n))
    m = max(1, math.ceil(config.participation * n))
    chosen = torch.randperm(n, generator=public_generator(config.seed, "federated", "participation", round))[:m]
    return sorted(chosen.tolist())


def drops_out(config: FederatedConfig, round: int, client: int) -> bool:
    """Whether an asked client fails in ``round`` in a simulated-dropout run (public, engine-independent)."""
    if config.dropout == 0.0:
        return False
    draws = torch.rand(config.clients, generator=public_generator(config.seed, "federated", "dropout", round))
    return bool(draws[client] < config.dropout)
