"""Private training inside a Hugging Face ``Trainer`` (issue 22): ``TrainingArguments`` as users know them, and
one more argument::

    args = TrainingArguments("out", per_device_train_batch_size=32,       # the physical batch
                             num_train_epochs=3, learning_rate=5e-4, logging_steps=10, report_to="tensorboard")
    trainer = PrivateTrainer(model, args, train_dataset=train, eval_dataset=test, processing_class=tokenizer,
                             privacy=PrivacyArguments(epsilon=3.0, batch_size=512))   # the logical batch
    trainer.train()         # logs epsilon; checkpoints carry the ledger (and the secret key: keep them private)

Each item of the train DataLoader is one Poisson-sampled logical batch, so one Trainer step is one private
step: ``training_step`` walks through it in physical batches of ``per_device_train_batch_size``, adds up the
clipped per-example sums and releases them once (noise, ledger), and ``optimizer.step()`` updates with the
Trainer's own optimizer and schedule or with a dpopt recipe (``PrivacyArguments.algorithm``). It is built
on ``make_private``: the same engine, privatizer and ledger as ``dpopt train`` and the plain loop.

``max_grad_norm`` (1.0 by default) clips the gradient that ``optimizer.step`` sees: the released one, already
private (post-processing), and the logged ``grad_norm`` is its norm; the per-example bound is
``PrivacyArguments.clip``.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Sampler, Subset
from transformers import Trainer

from dpopt.algorithms import Hyperparameters, hyperparameters_for, settings_of
from dpopt.algorithms.base import PrivateStep
from dpopt.checkpoint import write_atomic
from dpopt.grad.batch import batch_size_of
from dpopt.loop import PrivateOptimizer, make_private
from dpopt.noise.rng import secret_key
from dpopt.privacy import PrivacyLedger


@dataclass
class PrivacyArguments:
    """The privacy side of a run; everything else is ``TrainingArguments``. Give ``epsilon`` (the noise is
    calibrated to the run's steps) or ``noise_multiplier``. ``batch_size`` is the expected logical batch;
    ``algorithm`` None trains with the Trainer's own optimizer (AdamW by default: DP-AdamW), or a dpopt recipe
    ("dp-grape", "disk-adam", ...) with ``learning_rate`` and ``weight_decay`` from ``TrainingArguments`` and
    its other ``hyperparameters`` (e.g. {"rank": 4}). ``secret_seed`` makes
    the noise replayable (tests, reproductions); by default the key is fresh OS entropy."""
    epsilon: float | None = None
    noise_multiplier: float | None = None
    delta: float = 1e-5
    batch_size: int = 256
    clip: float = 1.0
    clipping: str = "flat"
    algorithm: str | None = None
    noise: str = "auto"  # the recipe's mechanism (PrivacyPlan), or another: gaussian, tree, mf, banded, ...
    sampling: str = "auto"  # the recipe's sampling (PrivacyPlan), or poisson, cyclic, shuffle, fixed
    bands: int = 0  # banded noise's bands and cyclic sampling's period (0: chosen)
    workload: str = "ones"  # what an optimised factorization targets: ones, or true (the recipe's momentum)
    tree_decoder: str | None = None  # tree noise's decoder (None: the recipe's)
    accountant: str = "pld"
    secret_seed: int | None = None
    hyperparameters: dict[str, Any] = field(default_factory=dict)  # a recipe's others, e.g. {"rank": 4}


def per_example_loss(model: nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
    """Each example's own loss [B]: a classifier's cross-entropy (squared error for one output), or a language
    model's token cross-entropy averaged over the example's own labelled tokens (next-token shifted for a causal
    LM). The model's built-in loss averages over the batch's tokens, which would make an example's weight depend
    on the others' lengths: its clipped contribution would no longer be bounded by one example alone."""
    return _losses(model, *_forward(model, inputs))


def _forward(model: nn.Module, inputs: dict[str, Any]) -> tuple[Any, torch.Tensor]:
    """The model's output on ``inputs`` without their labels, and the labels."""
    inputs = dict(inputs)
    labels = inputs.pop("labels")
    return model(**inputs), labels


def _losses(model: nn.Module, out: Any, labels: torch.Tensor) -> torch.Tensor:
    logits = (out.logits if hasattr(out, "logits") else out).float()  # a model output, or your module's logits
    if logits.dim() == 2:
        if logits.shape[-1] == 1:
            return (logits.squeeze(-1) - labels.float()) ** 2
        return F.cross_entropy(logits, labels, reduction="none")
    if type(model).__name__.endswith(("ForCausalLM", "LMHeadModel")):
        logits, labels = logits[:, :-1], labels[:, 1:]
    tokens = F.cross_entropy(logits.transpose(1, 2), labels, reduction="none", ignore_index=-100)
    return tokens.sum(1) / (labels != -100).sum(1).clamp(min=1)


class _LogicalBatches(Sampler[list[int]]):
    """The indices of each logical step's Poisson batch, drawn by the privatizer (secret), one epoch per pass.
    Steps are numbered from the optimizer's count when a pass starts, so a resumed run draws the same batches.
    It reads the trainer's current private step, which a resumed ``train()`` rebuilds."""

    def __init__(self, trainer: "PrivateTrainer") -> None:
        self.trainer = trainer

    def __len__(self) -> int:
        return self.trainer.dp.privatizer.sampler.steps_per_epoch

    def __iter__(self):
        dp, per_epoch = self.trainer.dp, len(self)
        first = dp.steps - dp.steps % per_epoch  # the epoch's first step (a resumed epoch is skipped into)
        for step in range(first, first + per_epoch):
            yield dp.privatizer.batch(step).tolist()


class _PrivateUpdate(PrivateOptimizer):
    """The ``PrivateOptimizer`` the Trainer holds: ``step()`` is the update of a logical step whose release
    ``training_step`` made (``PrivateStep.apply``), with the released gradient in ``.grad`` (so the Trainer's
    ``max_grad_norm`` and logged ``grad_norm`` see it), or in ``released`` where it has other shapes than the
    parameters (DP-GRAPE's projections, DPZero's scalar). The Trainer's schedule sets the learning rate."""

    def __init__(self, dp: PrivateStep, key: int | bytes, delta: float) -> None:
        super().__init__(dp, True, key, delta)
        self.released: list[torch.Tensor] | None = None

    def hold(self, g: list[torch.Tensor]) -> None:
        """Keep a step's released statistic for ``step()``: in ``.grad`` if it has the parameters' shapes."""
        if isinstance(self.dp.base, torch.optim.Optimizer):
            for p, gi in zip(self.dp.params, g):
                p.grad = gi.to(p.dtype)
        else:
            self.released = g

    @torch.no_grad()
    def step(self, closure: Callable | None = None) -> None:
        g, self.released = self.released, None
        if g is None:
            g = [p.grad for p in self.dp.params]
        self._set_lr()
        self.dp.apply(g)


class PrivateTrainer(Trainer):
    """A ``Trainer`` whose every step is a private step; see the module docstring. ``per_example_loss(model,
    inputs) -> [B]`` replaces the model's batch loss (the default handles classifiers and language models)."""

    def __init__(self, *args: Any, privacy: PrivacyArguments,
                 per_example_loss: Callable[[nn.Module, dict[str, Any]], torch.Tensor] = per_example_loss,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.args.gradient_accumulation_steps != 1:
            raise ValueError("gradient_accumulation_steps must be 1: the logical batch is PrivacyArguments.batch_size, "
                             "walked through in physical batches of per_device_train_batch_size")
        if self.args.world_size != 1:
            raise ValueError("PrivateTrainer runs on one process; for data parallelism use dpopt train --nproc")
        if self.args.fp16:
            raise ValueError("fp16 is not supported by PrivateTrainer (its loss scaler never sees the per-example "
                             "gradients); use bf16, or fp32")
        if not self.label_names:  # a module whose forward names no labels: keep them for per_example_loss
            self.label_names = ["labels"]
        self.privacy, self.per_example_loss = privacy, per_example_loss
        self._given = self.optimizer, self.lr_scheduler  # Trainer(optimizers=...), or (None, None)
        self.dp: PrivateStep | None = None

    @property
    def ledger(self) -> PrivacyLedger:
        if self.dp is None:
            raise RuntimeError("nothing is accounted before train()")
        return self.dp.privatizer.ledger

    def epsilon(self, delta: float | None = None) -> float:
        """The epsilon spent so far, at ``delta`` (None: ``PrivacyArguments.delta``)."""
        return self.ledger.epsilon(self.privacy.delta if delta is None else delta)

    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs: Any) -> Any:
        if self.dp is not None and not resume_from_checkpoint:
            raise RuntimeError("a PrivateTrainer trains once (a second train() would start a new ledger); resume "
                               "from a checkpoint to go on")
        return super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)

    def get_train_dataloader(self) -> DataLoader:
        """One item per logical step: the Poisson batch, collated. Builds the private step (``make_private``,
        which verifies attribution before anything is released) on the first call."""
        if self.train_dataset is None:
            raise ValueError("PrivateTrainer: training requires a train_dataset")
        dataset, collate = self.train_dataset, self.data_collator
        if hasattr(dataset, "column_names"):  # a datasets.Dataset
            dataset = self._remove_unused_columns(dataset, description="training")
        else:
            collate = self._get_collator_with_removed_columns(collate, description="training")
        collate = lambda examples, collate=collate: dict(collate(examples)) if examples else {}  # noqa: E731
        self._make_private(dataset, collate)  # dict(): a tokenizer's BatchEncoding is no pytree of tensors
        return DataLoader(dataset, batch_sampler=_LogicalBatches(self), collate_fn=collate)

    def _make_private(self, dataset: Any, collate: Callable[[list], Any]) -> None:
        key = secret_key(self.privacy.secret_seed)  # a resumed run loads its own with the optimizer's state
        self.optimizer, self.lr_scheduler = self._given  # a resumed train() builds afresh, then loads the state
        p = self.privacy
        _, private, _ = make_private(
            self.model, None if p.algorithm else super().create_optimizer(), Subset(dataset, range(len(dataset))),
            self.per_example_loss, algorithm=p.algorithm, batch_size=p.batch_size,  # Subset: a list too
            epochs=self.args.num_train_epochs, steps=self.args.max_steps if self.args.max_steps > 0 else None,
            epsilon=p.epsilon, noise_multiplier=p.noise_multiplier, delta=p.delta, clip=p.clip, clipping=p.clipping,
            noise=p.noise, sampling=p.sampling, bands=p.bands, workload=p.workload, tree_decoder=p.tree_decoder,
            physical_batch_size=self.args.per_device_train_batch_size, accountant=p.accountant, secret_seed=key,
            hyperparameters=self._recipe_hyperparameters(), collate_fn=collate)
        self.dp = private.dp
        self.optimizer = self._update = _PrivateUpdate(self.dp, key, p.delta)

    def _recipe_hyperparameters(self) -> Hyperparameters | None:
        """A recipe's defaults with the Trainer's learning rate (and weight decay, where the recipe has one) under
        ``PrivacyArguments.hyperparameters`` (None for the Trainer's own optimizer, which reads them itself)."""
        if self.privacy.algorithm is None:
            return None
        trainer = {"lr": self.args.learning_rate}
        if "weight_decay" in settings_of(self.privacy.algorithm):
            trainer["weight_decay"] = self.args.weight_decay
        return hyperparameters_for(self.privacy.algorithm, **{**trainer, **self.privacy.hyperparameters})

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        if self.dp is None:
            raise RuntimeError("the private optimizer is built with the train DataLoader (get_train_dataloader)")
        return self.optimizer

    def training_step(self, model: nn.Module, inputs: dict[str, Any],
                      num_items_in_batch: Any = None) -> torch.Tensor:
        """Stages 2-5 of one logical step: the clipped sums of its physical batches, released once (noise,
        ledger; an empty batch releases noise alone) and held for ``optimizer.step()``. The loss returned is for
        display (not private)."""
        model.train()
        sums, losses = None, None
        if inputs:
            inputs = self._prepare_inputs(inputs)
            sums, _, losses = self.dp.clipped_sums(inputs, torch.arange(batch_size_of(inputs)))
        self._update.hold(self.dp.released(sums))
        loss = (losses[0] / losses[1]).float() if losses is not None else torch.tensor(float("nan"))  # 0/0: nan
        return loss.detach().to(self.args.device)

    def compute_loss(self, model: nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        """Evaluation's loss (training never calls this): the mean per-example loss, as trained."""
        if self.per_example_loss is per_example_loss:
            out, labels = _forward(model, inputs)
            loss = _losses(model, out, labels).mean()
        else:
            loss, out = self.per_example_loss(model, inputs).mean(), None
            if return_outputs:
                out = _forward(model, inputs)[0]
        return (loss, out) if return_outputs else loss

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """The Trainer's logs, with the epsilon spent so far (so TensorBoard and W&B get it through report_to)."""
        if self.dp is not None:
            logs["epsilon"] = self.epsilon()
        super().log(logs, start_time)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """The Trainer's files, plus privacy.json (epsilon, delta, the ledger; no key) beside them."""
        super()._save_optimizer_and_scheduler(output_dir)
        privacy = {"epsilon": self.epsilon(), "delta": self.privacy.delta, "steps": self.dp.steps,
                   "privacy_arguments": {k: v for k, v in asdict(self.privacy).items() if k != "secret_seed"},
                   "ledger": self.ledger.to_dict()}
        text = json.dumps(privacy, indent=2).encode()
        write_atomic(os.path.join(output_dir, "privacy.json"), lambda f: f.write(text))
