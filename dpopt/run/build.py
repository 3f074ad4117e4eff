"""A run built from its config: data, model, engine, sampler, the privacy plan and the optimizer."""

from __future__ import annotations

import dataclasses
import re
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from dpopt.algorithms import PrivateStep, build_algorithm
from dpopt.data.datasets import DATASET_MODEL, Dataset, load_dataset
from dpopt.data.samplers import take
from dpopt.device import resolve_device, to_device
from dpopt.distributed import DataParallel
from dpopt.grad.engine import PerExampleEngine
from dpopt.grad.verify import check_per_example
from dpopt.models import MODEL_TRAINABLE, build_model, text_encoder
from dpopt.names import flag
from dpopt.noise.rng import derive_seed, secret_key
from dpopt.privacy import PrivacyLedger
from dpopt.sharded import ShardedStep, device_mesh, shard_model
from dpopt.run.config import DEFAULT_BATCH, DEFAULT_PHYSICAL_BATCH, TrainConfig
from dpopt.task import classification_loss


@dataclass
class Run:
    """Everything a run is made of, built from its config."""

    config: TrainConfig
    data: Dataset
    model: nn.Module
    optimizer: PrivateStep
    sampler: Any
    ledger: PrivacyLedger
    total_steps: int
    secret_key: int | bytes | None  # private: the checkpoint holds it, nothing else may

    @property
    def sharded(self) -> bool:
        """Whether the model is sharded over the ranks (FSDP2): saving it and evaluating it involve every rank."""
        return isinstance(self.optimizer, ShardedStep)


def build_run(config: TrainConfig, log: Callable[[str], None] = print, parallel: DataParallel | None = None,
              key: int | bytes | None = None) -> Run:
    """The run of ``config``; ``key`` is its secret key when resuming (None: a new one, see ``secret_key``)."""
    config.validate()
    data = load_dataset(config.dataset, config.download, config.text_column, config.label_column,
                        text_encoder(config.model))
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
    sharded = parallel is not None and parallel.sharded
    if sharded:
        shard_model(model, device_mesh(parallel, device))
    engine = PerExampleEngine(model, classification_loss, config.per_example, config.strategy, config.precision)
    engine.check_no_mixing()
    check_per_example(model, classification_loss, to_device(take(data.train, torch.arange(min(8, n))), device))

    if config.secure:
        key = None
    elif key is None:
        key = secret_key(config.secret_seed)
    if config.batch_size is None:  # the config keeps the value the run uses
        config = dataclasses.replace(config, batch_size=min(DEFAULT_BATCH, n))
    plan = config.plan(n).resolved(log)
    config = dataclasses.replace(config, bands=plan.bands)  # the config keeps the cyclic period the run uses
    privatizer = plan.make(key, log, parallel)
    sampler, total = privatizer.sampler, plan.total_steps(privatizer.sampler)
    for name, rule in config.hyperparameters.rules().items():  # set by the run's length; the config keeps the value
        log(f"{config.algorithm}: {name} = {rule} = {rule(total):.3g} over {total} steps "
            f"(its default depends on the run's length; {flag(name)} sets it)")
    config = dataclasses.replace(config, hyperparameters=config.hyperparameters.for_run(total))
    ledger = privatizer.ledger
    physical = min(DEFAULT_PHYSICAL_BATCH, n) if config.physical_batch_size is None else config.physical_batch_size
    if physical > n:
        raise ValueError(f"the physical batch size ({physical}) exceeds the {n} training examples")
    optimizer = build_algorithm(config.algorithm, engine, privatizer, config.hyperparameters, physical)
    if sharded:
        optimizer = ShardedStep(optimizer, config.algorithm)
    elif config.graph != "off":
        optimizer.capture(config.graph, log)
    optimizer.schedule = config.schedule.for_run(total)
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
