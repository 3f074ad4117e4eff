"""Private training inside a Hugging Face ``Trainer``: ``TrainingArguments`` as users know them, and
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

A model sharded with FSDP2 (``fully_shard``) on every rank of a torchrun launch trains as dpopt's sharded step
(``dpopt.sharded.ShardedStep``): the same run as one unsharded process. The Trainer leaves the model as it is given
(no DDP or FSDP wrapping of its own) and its checkpoints gather the whole model and optimizer state on rank 0.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import safetensors.torch
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
from torch.distributed.tensor import DTensor, Shard
from torch.utils.data import DataLoader, Dataset, Sampler, Subset
from transformers import Trainer
from transformers.utils import SAFE_WEIGHTS_NAME

from dpopt.algorithms import Hyperparameters, hyperparameters_for, settings_of
from dpopt.algorithms.base import PrivateStep
from dpopt.checkpoint import write_atomic
from dpopt.distributed import DataParallel
from dpopt.grad.batch import batch_size_of
from dpopt.loop import PrivateOptimizer, make_private
from dpopt.noise.rng import secret_key
from dpopt.privacy import PrivacyLedger
from dpopt.sharded import ShardedStep, gathered, load_model_state


@dataclass
class PrivacyArguments:
    """The privacy side of a ``PrivateTrainer`` run; everything else is ``TrainingArguments``. Give ``epsilon``
    (the noise is calibrated to the run's steps: ``num_train_epochs``, or ``max_steps`` where > 0) or
    ``noise_multiplier``. ``algorithm`` None trains with the Trainer's own optimizer (AdamW by default: DP-AdamW,
    with the Trainer's schedule), or a dpopt recipe (``dpopt.ALGORITHMS``: "dp-grape", "disk-adam", ...) with
    ``learning_rate`` and ``weight_decay`` from ``TrainingArguments`` and its other ``hyperparameters``.
    The settings are checked when the Trainer builds its private step (``train()``), with ``make_private``'s
    errors.

    ```python
    from dpopt import PrivacyArguments

    privacy = PrivacyArguments(epsilon=3.0, batch_size=512)              # DP-AdamW with the Trainer's AdamW
    grape = PrivacyArguments(epsilon=3.0, batch_size=512, algorithm="dp-grape", hyperparameters={"rank": 4})
    assert privacy.delta == 1e-5 and grape.hyperparameters["rank"] == 4
    ```

    :param epsilon: the target epsilon; or give ``noise_multiplier``, not both.
    :param noise_multiplier: the noise's std over the clip bound; the run then reports its epsilon.
    :param delta: the target delta, in (0, 1), well below 1 / (dataset size); default 1e-5.
    :param batch_size: the expected logical batch (Poisson sampling: each example is in a step's batch with
        probability ``batch_size / len(train_dataset)``); ``per_device_train_batch_size`` is the physical batch.
    :param clip: the per-example clip bound C (> 0).
    :param clipping: ``flat``, ``per-layer`` or ``automatic``.
    :param algorithm: None (the Trainer's optimizer), or a recipe's name.
    :param noise: the noise mechanism: ``auto`` (the recipe's), ``gaussian``, ``tree``, ``sqrt``, ``banded``, ``mf``.
    :param sampling: ``auto`` (the recipe's), ``poisson``, ``cyclic``, ``shuffle`` or ``fixed``.
    :param bands: banded noise's bands and cyclic sampling's period (0: chosen by the plan).
    :param workload: what an optimised factorization targets: ``ones`` (prefix sums) or ``true`` (the recipe's
        momentum).
    :param tree_decoder: tree noise's decoder (None: the recipe's).
    :param accountant: ``pld`` or ``rdp``.
    :param secret_seed: makes the sampling and noise replayable (tests, reproductions); None: a fresh key from
        OS entropy. Not saved in ``privacy.json``.
    :param hyperparameters: a recipe's settings other than the learning rate and weight decay, e.g.
        ``{"rank": 4}`` (``hyperparameters_for``); they override the Trainer's.
    """
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


SHARD_WITH = ("shard it on every rank with torch.distributed.fsdp.fully_shard, each module that holds trainable "
              "parameters and then the root (dpopt.sharded.shard_model)")


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` is sharded over processes: wrapped by FSDP2's ``fully_shard`` or FSDP1, or holding
    ``DTensor`` parameters (tensor parallelism).

    :param model: the model, before the Trainer sees it.
    :returns: True if any of its modules or parameters is sharded.
    """
    return (any(isinstance(m, (FSDPModule, FullyShardedDataParallel)) for m in model.modules())
            or any(isinstance(p, DTensor) for p in model.parameters()))


def sharding_refusal(model: nn.Module) -> str | None:
    """Why ``PrivateTrainer`` cannot train the sharded ``model`` (None if it can): its sharded step
    (``ShardedStep``) needs FSDP2 at the root and every trainable parameter sharded on dim 0 by it.

    :param model: a sharded model (``is_sharded``).
    :returns: the reason, in one line, or None.
    """
    if any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
        return f"PrivateTrainer does not train a model wrapped by FSDP1 (FullyShardedDataParallel); {SHARD_WITH}"
    if not isinstance(model, FSDPModule):
        return f"PrivateTrainer trains a sharded model whose root is sharded by fully_shard too; {SHARD_WITH}"
    for name, p in model.named_parameters():
        if p.requires_grad and not (isinstance(p, DTensor) and p.placements == (Shard(0),)):
            return f"trainable parameter {name} is not sharded on dim 0 by fully_shard; {SHARD_WITH}"
    return None


def per_example_loss(model: nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
    """Each example's own loss [B]: a classifier's cross-entropy (squared error for one output), or a language
    model's token cross-entropy averaged over the example's own labelled tokens (next-token shifted for a causal
    LM). The model's built-in loss averages over the batch's tokens, which would make an example's weight depend
    on the others' lengths: its clipped contribution would no longer be bounded by one example alone.

    :param model: the model; its output's ``logits`` (or the output itself) are read.
    :param inputs: the batch as the collator makes it, with its ``labels`` (-100: a token not counted).
    :returns: one loss per example, [B].
    """
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
            yield self.batch(step)

    def batch(self, step: int) -> list[Any]:
        """What the DataLoader reads for step ``step``: the indices of its batch."""
        return self.trainer.dp.privatizer.batch(step).tolist()


class _ShardedRounds(_LogicalBatches):
    """A sharded step's logical batches: rank 0 draws each step's global batch and sends it to every rank, which
    reads its share in as many physical batches as every other rank (``ShardedStep.rounds``). One item per step:
    the (indices, real) pairs of this rank's physical batches, for ``_Rounds`` to read."""

    def batch(self, step: int) -> list[Any]:
        return [[(part.tolist(), real) for part, real in self.trainer.dp.rounds(step)]]


class _Rounds(Dataset):
    """``dataset`` read by ``_ShardedRounds``' items: one logical step's physical batches, each collated, with
    whether it holds this rank's own examples (False: a stand-in of weight 0)."""

    def __init__(self, dataset: Any, collate: Callable[[list], Any]) -> None:
        self.dataset, self.collate = dataset, collate

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, rounds: list[tuple[list[int], bool]]) -> list[tuple[Any, bool]]:
        return [(self.collate([self.dataset[i] for i in part]), real) for part, real in rounds]


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
    """A Hugging Face ``Trainer`` whose every step is one private step, built on ``make_private`` (the same
    engine, privatizer and ledger as ``dpopt train`` and the plain loop).

    What it does differently from ``Trainer``:

    * each item of the train DataLoader is one Poisson-sampled logical batch of about
      ``PrivacyArguments.batch_size`` examples (drawn with the secret key), walked through in physical batches of
      ``per_device_train_batch_size``: ``training_step`` adds up every example's clipped gradient and releases
      the sum once (noise, ledger), and ``optimizer.step()`` updates with the Trainer's optimizer and schedule
      or with a dpopt recipe;
    * the loss is per example (``per_example_loss``), not the model's batch loss;
    * ``max_grad_norm`` clips the released gradient (already private: post-processing); the per-example bound is
      ``PrivacyArguments.clip``;
    * the logs carry ``epsilon`` (to every ``report_to``), and each checkpoint a ``privacy.json`` (epsilon, delta,
      steps, the ledger) beside the optimizer's state, which holds the secret key: keep checkpoints private;
    * under torchrun, a model that every rank sharded with ``fully_shard`` trains as dpopt's sharded step
      (``ShardedStep``: rank 0 draws the global Poisson batch, the ranks' clipped sums are summed, each coordinate's
      noise is drawn once, by the rank that owns it), the same run as one unsharded process at the same secret
      seed; the Trainer does not wrap the model (no DDP, no FSDP of its own), ``save_model`` and the checkpoints
      gather the whole model and optimizer state on rank 0 (every rank calls them), and a resumed run reads them on
      every rank and keeps its shards.

    ```python
    import torch
    from transformers import BertConfig, BertForSequenceClassification, TrainingArguments
    from dpopt import PrivacyArguments, PrivateTrainer

    model = BertForSequenceClassification(BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=1,
                                                     num_attention_heads=2, intermediate_size=20))
    g = torch.Generator().manual_seed(0)
    train = [{"input_ids": torch.randint(0, 40, (8,), generator=g), "attention_mask": torch.ones(8, dtype=torch.long),
              "labels": i % 2} for i in range(80)]
    args = TrainingArguments("out", per_device_train_batch_size=2, max_steps=3, learning_rate=1e-3,
                             report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True)
    trainer = PrivateTrainer(model, args, train_dataset=train,          # batch_size: the logical batch
                             privacy=PrivacyArguments(noise_multiplier=1.0, batch_size=4))
    trainer.train()                                 # logs epsilon with the Trainer's loss
    assert trainer.ledger.steps == 3 and 0 < trainer.epsilon() < float("inf")
    ```

    :param args: the ``Trainer``'s arguments (model, ``TrainingArguments``, datasets, collator, callbacks, ...).
    :param privacy: the run's ``PrivacyArguments``.
    :param per_example_loss: ``per_example_loss(model, inputs) -> [B]``, each example's own loss; the default
        takes a classifier's cross-entropy (squared error for one output) or a language model's token
        cross-entropy averaged over each example's own labelled tokens.
    :param kwargs: the ``Trainer``'s keyword arguments.
    :raises ValueError: for ``gradient_accumulation_steps`` other than 1 (the logical batch is
        ``PrivacyArguments.batch_size``), an unsharded model on more than one process (``dpopt train --nproc`` runs
        data-parallel), a sharded model that ``sharding_refusal`` refuses or that is launched otherwise than one
        Trainer process per rank of the group (torchrun), with ``save_on_each_node`` or ``load_best_model_at_end``,
        ``fp16`` (use bf16 or fp32), and at ``train()`` without a ``train_dataset``, for a privacy setting
        ``make_private`` refuses (a recipe that cannot shard), for ranks given different arguments, or for a
        sharded run resumed from a folder without the whole model (``model.safetensors``).
    :raises RuntimeError: at a second ``train()`` that does not resume from a checkpoint (it would start a new
        ledger).
    """

    def __init__(self, *args: Any, privacy: PrivacyArguments,
                 per_example_loss: Callable[[nn.Module, dict[str, Any]], torch.Tensor] = per_example_loss,
                 **kwargs: Any) -> None:
        model = kwargs.get("model", args[0] if args else None)
        self.sharded = model is not None and is_sharded(model)
        why = sharding_refusal(model) if self.sharded else None
        if why is not None:  # before the Trainer moves or wraps it
            raise ValueError(why)
        super().__init__(*args, **kwargs)
        if self.args.gradient_accumulation_steps != 1:
            raise ValueError("gradient_accumulation_steps must be 1: the logical batch is PrivacyArguments.batch_size, "
                             "walked through in physical batches of per_device_train_batch_size")
        if self.sharded:
            self._check_sharded_launch()
            # The Trainer's switch for a model that owns its placement and gradient reduction: accelerate leaves
            # it unwrapped (no DDP, whose backward would average over the ranks; no FSDP of its own).
            self.is_distributed_loading_by_transformers = True
        elif self.args.world_size != 1:
            raise ValueError(f"PrivateTrainer trains an unsharded model on one process, not {self.args.world_size} "
                             f"(for data parallelism use dpopt train --nproc N); to train on several, {SHARD_WITH}")
        if self.args.fp16:
            raise ValueError("fp16 is not supported by PrivateTrainer (its loss scaler never sees the per-example "
                             "gradients); use bf16, or fp32")
        if not self.label_names:  # a module whose forward names no labels: keep them for per_example_loss
            self.label_names = ["labels"]
        self.privacy, self.per_example_loss = privacy, per_example_loss
        self._given = self.optimizer, self.lr_scheduler  # Trainer(optimizers=...), or (None, None)
        self.dp: PrivateStep | None = None

    def _check_sharded_launch(self) -> None:
        """Refuse, in one line, what a sharded run cannot do under this Trainer's arguments and launch."""
        if not hasattr(self, "is_distributed_loading_by_transformers"):
            raise ValueError("a sharded PrivateTrainer needs a transformers Trainer that can leave a sharded model "
                             "unwrapped (is_distributed_loading_by_transformers): upgrade transformers")
        if self.args.world_size != dist.get_world_size():
            raise ValueError(f"the Trainer sees {self.args.world_size} process(es) and the process group "
                             f"{dist.get_world_size()}: launch one Trainer per rank with torchrun --nproc-per-node N")
        if self.args.save_on_each_node:
            raise ValueError("save_on_each_node does not apply to a sharded PrivateTrainer: rank 0 gathers the whole "
                             "model and writes every checkpoint")
        if self.args.load_best_model_at_end:
            raise ValueError("load_best_model_at_end is not supported for a sharded PrivateTrainer (it would load a "
                             "whole checkpoint into the shards); evaluate the saved checkpoints instead")

    def _move_model_to_device(self, model: nn.Module, device: torch.device) -> None:
        """The Trainer's placement, except for a sharded model, whose owner placed its shards on the mesh."""
        if not self.sharded:
            super()._move_model_to_device(model, device)

    @property
    def ledger(self) -> PrivacyLedger:
        """The run's ``PrivacyLedger``: every release so far.

        :raises RuntimeError: before ``train()``, when nothing is accounted.
        """
        if self.dp is None:
            raise RuntimeError("nothing is accounted before train()")
        return self.dp.privatizer.ledger

    def epsilon(self, delta: float | None = None) -> float:
        """The epsilon spent so far.

        :param delta: the delta to state it at (None: ``PrivacyArguments.delta``).
        :returns: the ledger's epsilon over every release so far.
        :raises RuntimeError: before ``train()``.
        """
        return self.ledger.epsilon(self.privacy.delta if delta is None else delta)

    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs: Any) -> Any:
        """``Trainer.train``, privately: builds the private step on the first DataLoader (attribution is verified
        before any release), or resumes one with its key and ledger from a checkpoint.

        :param resume_from_checkpoint: a checkpoint folder, or True for the output folder's last one.
        :param kwargs: ``Trainer.train``'s other keyword arguments.
        :returns: ``Trainer.train``'s ``TrainOutput``.
        :raises RuntimeError: at a second ``train()`` that does not resume (it would start a new ledger).
        """
        if self.dp is not None and not resume_from_checkpoint:
            raise RuntimeError("a PrivateTrainer trains once (a second train() would start a new ledger); resume "
                               "from a checkpoint to go on")
        return super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)

    def get_train_dataloader(self) -> DataLoader:
        """One item per logical step: the Poisson batch, collated. Builds the private step (``make_private``,
        which verifies attribution before anything is released) on the first call.

        :returns: a DataLoader of one epoch of logical batches.
        :raises ValueError: without a ``train_dataset``, or for a privacy setting ``make_private`` refuses.
        """
        if self.train_dataset is None:
            raise ValueError("PrivateTrainer: training requires a train_dataset")
        dataset, collate = self.train_dataset, self.data_collator
        if hasattr(dataset, "column_names"):  # a datasets.Dataset
            dataset = self._remove_unused_columns(dataset, description="training")
        else:
            collate = self._get_collator_with_removed_columns(collate, description="training")
        collate = lambda examples, collate=collate: dict(collate(examples)) if examples else {}  # noqa: E731
        self._make_private(dataset, collate)  # dict(): a tokenizer's BatchEncoding is no pytree of tensors
        if self.sharded:
            return DataLoader(_Rounds(dataset, collate), batch_sampler=_ShardedRounds(self),
                              collate_fn=lambda steps: steps[0])
        return DataLoader(dataset, batch_sampler=_LogicalBatches(self), collate_fn=collate)

    def _make_private(self, dataset: Any, collate: Callable[[list], Any]) -> None:
        key = secret_key(self.privacy.secret_seed)  # a resumed run loads its own with the optimizer's state
        self.optimizer, self.lr_scheduler = self._given  # a resumed train() builds afresh, then loads the state
        p = self.privacy
        parallel = None
        if self.sharded:
            parallel = DataParallel()
            self._check_same_on_every_rank(len(dataset))
        _, private, _ = make_private(
            self.model, None if p.algorithm else super().create_optimizer(), Subset(dataset, range(len(dataset))),
            self.per_example_loss, algorithm=p.algorithm, batch_size=p.batch_size,  # Subset: a list too
            epochs=self.args.num_train_epochs, steps=self.args.max_steps if self.args.max_steps > 0 else None,
            epsilon=p.epsilon, noise_multiplier=p.noise_multiplier, delta=p.delta, clip=p.clip, clipping=p.clipping,
            noise=p.noise, sampling=p.sampling, bands=p.bands, workload=p.workload, tree_decoder=p.tree_decoder,
            physical_batch_size=self.args.per_device_train_batch_size, accountant=p.accountant, secret_seed=key,
            hyperparameters=self._recipe_hyperparameters(), collate_fn=collate, parallel=parallel)
        self.dp = private.dp
        self.optimizer = self._update = _PrivateUpdate(self.dp, private.key, p.delta)  # sharded: rank 0's key

    def _check_same_on_every_rank(self, examples: int) -> None:
        """Refuse, on every rank, a sharded run whose ranks were given different privacy or training arguments or
        datasets of different sizes (a collective: one all-gather of a few settings)."""
        a = self.args
        mine = {**asdict(self.privacy), "train_dataset size": examples, "trainable parameters": [
                    tuple(q.shape) for q in self.model.parameters() if q.requires_grad],
                **{name: getattr(a, name) for name in (
                    "per_device_train_batch_size", "num_train_epochs", "max_steps", "learning_rate", "weight_decay",
                    "optim", "lr_scheduler_type", "warmup_steps", "max_grad_norm", "bf16", "seed")}}
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        differ = [name for name in mine if any(theirs[name] != every[0][name] for theirs in every)]
        if differ:
            raise ValueError(f"the ranks were given different {', '.join(differ)}: every rank builds the same "
                             "PrivateTrainer, with the same arguments and the same train_dataset")

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

    def training_step(self, model: nn.Module, inputs: dict[str, Any] | list[tuple[dict[str, Any], bool]],
                      num_items_in_batch: Any = None) -> torch.Tensor:
        """Stages 2-5 of one logical step: the clipped sums of its physical batches, released once (noise,
        ledger; an empty batch releases noise alone) and held for ``optimizer.step()``. The loss returned is for
        display (not private).

        :param model: the model (the Trainer's).
        :param inputs: one logical batch, collated (empty: no example was sampled); sharded, this rank's physical
            batches of it, each collated, with whether it holds this rank's examples (``_ShardedRounds``).
        :param num_items_in_batch: the Trainer's token count; unused (every example weighs the same).
        :returns: the batch's mean per-example loss, over every rank's examples (nan for an empty batch).
        """
        model.train()
        sums, losses = None, None
        if isinstance(self.dp, ShardedStep):  # this rank's physical batches; the ranks' sums meet in the release
            counts = torch.zeros(5, dtype=torch.float64)  # examples, non-finite, clipped, loss sum, loss count
            for batch, real in inputs:
                counts += self.dp.accumulate(self._prepare_inputs(batch), real)
            losses = torch.tensor(self.dp.privatizer.total(counts.tolist())[3:], dtype=torch.float64)
        elif inputs:
            inputs = self._prepare_inputs(inputs)
            sums, _, losses = self.dp.clipped_sums(inputs, torch.arange(batch_size_of(inputs)))
        self._update.hold(self.dp.released(sums))
        loss = (losses[0] / losses[1]).float() if losses is not None else torch.tensor(float("nan"))  # 0/0: nan
        return loss.detach().to(self.args.device)

    def compute_loss(self, model: nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        """Evaluation's loss (training never calls this): the mean per-example loss, as trained.

        :param model: the model.
        :param inputs: a batch with its ``labels``.
        :param return_outputs: also return the model's outputs (for predictions).
        :param num_items_in_batch: the Trainer's token count; unused.
        :returns: the loss, or (loss, outputs).
        """
        if self.per_example_loss is per_example_loss:
            out, labels = _forward(model, inputs)
            loss = _losses(model, out, labels).mean()
        else:
            loss, out = self.per_example_loss(model, inputs).mean(), None
            if return_outputs:
                out = _forward(model, inputs)[0]
        return (loss, out) if return_outputs else loss

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """The Trainer's logs, with the epsilon spent so far (so TensorBoard and W&B get it through report_to).

        :param logs: the values to log; ``epsilon`` is added once training has started.
        :param start_time: the Trainer's start time, for its speed metrics.
        """
        if self.dp is not None:
            logs["epsilon"] = self.epsilon()
        super().log(logs, start_time)

    def _save(self, output_dir: str | None = None, state_dict: dict[str, Any] | None = None) -> None:
        """The Trainer's model files; a sharded model's state is gathered first, whole on rank 0, which writes it
        (every rank takes part in each gather)."""
        if self.sharded and state_dict is None:
            state_dict = gathered(self.model.state_dict())
            if not self.args.should_save:
                return
        super()._save(output_dir, state_dict)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        """The Trainer's loading of a checkpoint's model; a sharded model reads the whole model that rank 0 wrote (on
        every rank: a checkpoint folder that every rank reaches) and keeps its shards.

        :raises ValueError: for a sharded model and a folder without ``model.safetensors``."""
        if not self.sharded:
            super()._load_from_checkpoint(resume_from_checkpoint, model)
            return
        path = os.path.join(resume_from_checkpoint, SAFE_WEIGHTS_NAME)
        if not os.path.isfile(path):
            raise ValueError(f"a sharded PrivateTrainer resumes from a checkpoint it wrote ({SAFE_WEIGHTS_NAME}); "
                             f"there is none in {resume_from_checkpoint}")
        load_model_state(model or self.model, safetensors.torch.load_file(path))

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """The Trainer's files, plus privacy.json (epsilon, delta, the ledger; no key) beside them. Sharded, the
        optimizer's state is gathered whole on rank 0, which writes it: the other ranks take part in the gather."""
        if self.sharded and not self.args.should_save:
            self.optimizer.state_dict()  # the gathers in which rank 0's Trainer reads the state it saves
        super()._save_optimizer_and_scheduler(output_dir)
        if not self.args.should_save:
            return
        privacy = {"epsilon": self.epsilon(), "delta": self.privacy.delta, "steps": self.dp.steps,
                   "privacy_arguments": {k: v for k, v in asdict(self.privacy).items() if k != "secret_seed"},
                   "ledger": self.ledger.to_dict()}
        text = json.dumps(privacy, indent=2).encode()
        write_atomic(os.path.join(output_dir, "privacy.json"), lambda f: f.write(text))
