"""One call for a plain PyTorch loop: ``make_private`` turns a model, a torch optimizer (or a recipe,
``algorithm=``), a dataset and a privacy target into what a PyTorch user already drives::

    model, optimizer, batches = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), dataset,
                                             loss_fn, epsilon=3.0, epochs=5, batch_size=512,
                                             physical_batch_size=64)
    for epoch in range(5):
        for batch in batches:                          # logical batches (the plan's sampling), in physical ones
            optimizer.zero_grad()
            loss_fn(model, batch).mean().backward()    # the mean of per-example losses (or their sum)
            optimizer.step()                           # one release after a logical batch's last physical one
    print(optimizer.epsilon())                         # at the run's delta

It is ``PrivateStep.step`` split at the caller's backward, not a second engine: the engine records each
physical batch's per-example gradients during ``loss.backward()`` (``PerExampleEngine.record``),
``Privatizer.clip`` adds their clipped sum to the logical step's running sums, and after the last physical
batch ``PrivateStep.finish`` releases them once (noise, ledger) and updates. ``batches`` releases an empty
logical batch itself (noise alone). The sampling, the noise and their calibration come from the ``PrivacyPlan``
of the recipe, as in ``dpopt train``. Attribution is verified on 3 distinct examples before anything is
released.

Recipes whose statistic evaluates the loss several times per step (DiSK at x + gamma d and x, SRG at x_t and
x_t-1, zeroth-order at x +/- lambda u) take a closure instead of the caller's backward, as
``torch.optim.LBFGS.step(closure)`` does::

    for batch in batches:
        optimizer.step(lambda: loss_fn(model, batch))  # per-example losses [B]; no backward inside

The recipe's statistic calls the closure (an ``engine.Closure`` batch) wherever ``PrivateStep.step`` would
evaluate ``loss_fn`` on the physical batch, at the points it chooses; any recipe accepts a closure.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.utils._pytree import tree_flatten
from torch.utils.data import Dataset, default_collate

from dpopt.algorithms import Hyperparameters, build_algorithm, hyperparameters_for
from dpopt.algorithms.base import PrivateStep
from dpopt.data.samplers import take
from dpopt.device import to_device
from dpopt.distributed import DataParallel
from dpopt.grad.batch import Closure, LossFn
from dpopt.grad.engine import PerExampleEngine
from dpopt.names import renamed
from dpopt.noise.rng import SecretStream, secret_key
from dpopt.plan import PrivacyPlan
from dpopt.schedules import Schedule
from dpopt.sharded import ShardedStep
from dpopt.privacy import PrivacyLedger, privacy_statement

_log = logging.getLogger("dpopt")  # what the plan chose (a cyclic period, a calibrated noise multiplier)


class PrivateOptimizer(torch.optim.Optimizer):
    """What the loop calls ``optimizer``: ``zero_grad()`` and ``step()`` after each physical batch's backward,
    or ``step(closure)``. The gradients autograd leaves in ``.grad`` are not private and are discarded; the
    update uses the release. It shares a torch base's parameter groups (a recipe's own update reads the first
    group's ``lr``), so ``torch.optim.lr_scheduler`` schedules it as any torch optimizer. ``make_private``
    builds it (see its example); it is not built by hand.

    :param dp: the private step it drives (engine, privatizer, recipe or torch optimizer).
    :param mean: whether the loop's backward is of the mean of the per-example losses (``loss_reduction="mean"``),
        so the recorded gradients are scaled back to each example's own.
    :param key: the secret key of the run's sampling and noise (saved by ``state_dict``).
    :param delta: the run's delta, at which ``epsilon()`` and ``statement()`` state the guarantee.
    """

    def __init__(self, dp: PrivateStep, mean: bool, key: int | bytes, delta: float) -> None:
        lr = getattr(dp.base, "lr", None)
        super().__init__(dp.params, {} if lr is None else {"lr": lr})
        if isinstance(dp.base, torch.optim.Optimizer):
            self.param_groups, self.state, self.defaults = dp.base.param_groups, dp.base.state, dp.base.defaults
        self.dp, self.mean, self.key, self.delta = dp, mean, key, delta
        # the recipe evaluates the loss itself (several times, or, sharded, inside its step)
        self.needs_closure = dp._statistic is not None or isinstance(dp, ShardedStep)
        self._real = True  # a sharded rank's physical batch holds its own examples (False: weight 0, see rounds)
        self._size: int | None = None  # the physical batch handed out and not stepped yet
        self._recording: Any = None
        self._last = False
        self._sums: list[torch.Tensor] | None = None

    @property
    def ledger(self) -> PrivacyLedger:
        """The run's ``PrivacyLedger``: every release made so far."""
        return self.dp.privatizer.ledger

    def epsilon(self, delta: float | None = None) -> float:
        """The epsilon spent so far.

        :param delta: the delta to state it at (None: the run's).
        :returns: the ledger's epsilon over every release made so far.
        """
        return self.ledger.epsilon(self.delta if delta is None else delta)

    def _set_lr(self) -> None:
        """A recipe's own update (not a torch optimizer) takes the first group's ``lr``, which a scheduler sets."""
        if hasattr(self.dp.base, "lr") and "lr" in self.param_groups[0]:
            self.dp.base.lr = self.param_groups[0]["lr"]

    def begin(self, size: int, last: bool, real: bool = True) -> None:
        """A physical batch of ``size`` examples is handed to the loop (``last``: of its logical batch). The
        batches ``make_private`` returned call it; a loop does not.

        :param size: the physical batch's number of examples.
        :param last: whether it is its logical batch's last (the next ``step()`` releases).
        :param real: False for a sharded rank's stand-in batch (weight 0: ``ShardedStep.rounds``).
        :raises RuntimeError: when the previous physical batch was not stepped.
        """
        if self._size is not None:
            if self._recording is not None:
                self._recording.remove()
            raise RuntimeError("optimizer.step() must follow every physical batch's backward")
        self._size, self._last, self._real = size, last, real
        self._recording = None if self.needs_closure else self.dp.engine.record(size, self.mean)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.dp.params:
            p.grad = None

    def step(self, closure: Callable[[], torch.Tensor] | None = None) -> torch.Tensor | None:
        """Add the physical batch's clipped sum to its logical batch's; after the last one, release once and
        update.

        :param closure: None after the caller's backward (its recorded per-example gradients are clipped); or a
            function returning the batch's per-example losses [B] at the model's current parameters (calling the
            model, no backward), which a recipe that evaluates the loss several times per step (DiSK, SRG,
            zeroth-order) calls as often and at whatever points it needs.
        :returns: the per-example losses the statistic saw (not private: for display), or None.
        :raises RuntimeError: without a batch from the returned batches, without a backward (or a closure where
            the recipe needs one), or when nothing was recorded.
        """
        size, recording = self._size, self._recording
        self._size = self._recording = None
        if recording is not None:
            recording.remove()
        if size is None:
            raise RuntimeError("optimizer.step() without a batch: iterate over the batches make_private returned")
        if isinstance(self.dp, ShardedStep):
            return self._sharded_step(closure, size)
        if closure is not None:
            grads = self.dp.statistic(Closure(closure, size))
        elif self.needs_closure:
            raise RuntimeError("this recipe evaluates the loss several times per step (DiSK, SRG, zeroth-order): "
                               "pass a closure returning the batch's per-example losses, "
                               "optimizer.step(lambda: loss_fn(model, batch)), instead of calling backward")
        else:
            grads = recording.gradients(None)
            if not any(grads.terms):
                raise RuntimeError("no per-example gradient was recorded: call loss.backward() before "
                                   "optimizer.step()")
        losses = grads.losses
        self._sums, _ = self.dp.privatizer.clip(grads, into=self._sums)
        self.zero_grad()  # autograd's batch gradient of this physical batch: not private
        if self._last:
            sums, self._sums = self._sums, None
            self._set_lr()
            self.dp.finish(sums)
        return losses

    def _sharded_step(self, closure: Callable[[], torch.Tensor] | None, size: int) -> None:
        """``step`` on a sharded model: the physical batch's clipped sum added to the sharded gradients (the closure
        evaluated inside the step); after the last one, release once and update."""
        if closure is None:
            raise RuntimeError("a sharded model evaluates the loss inside its step: "
                               "pass a closure returning the batch's per-example losses, "
                               "optimizer.step(lambda: loss_fn(model, batch)), instead of calling backward")
        self.dp.accumulate(Closure(closure, size), self._real)
        if self._last:
            self._set_lr()
            self.dp.end()

    def state_dict(self) -> dict[str, Any]:
        """The optimizer, the ledger and the secret key (``private_state``): save it with the model's
        ``state_dict`` and keep the file private.

        :returns: a dict for ``torch.save``; ``load_state_dict`` resumes from it.
        :raises RuntimeError: in the middle of a logical batch (its clipped sums are not released yet).
        """
        if self._sums is not None:
            raise RuntimeError("save between logical steps (after the step() that ends one): this one has clipped "
                               "sums not yet released")
        return private_state(self.dp, self.key)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from ``state_dict()``, in a fresh ``make_private`` before its first step: the run goes on with
        its own key (the same batches and noise as uninterrupted) and its ledger.

        ```python
        import torch
        import torch.nn.functional as F
        from dpopt import make_private

        x, y = torch.randn(80, 4), torch.randint(0, 2, (80,))
        loss_fn = lambda model, batch: F.cross_entropy(model(batch[0]), batch[1], reduction="none")

        def private_run():
            model = torch.nn.Linear(4, 2)
            return make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), (x, y), loss_fn,
                                noise_multiplier=1.0, batch_size=4, epochs=2)

        def epoch(model, optimizer, batches):
            for batch in batches:
                optimizer.zero_grad()
                loss_fn(model, batch).mean().backward()
                optimizer.step()

        model, optimizer, batches = private_run()
        epoch(model, optimizer, batches)
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, "checkpoint.pt")  # private

        model, optimizer, batches = private_run()     # later: a fresh make_private, then the saved state
        state = torch.load("checkpoint.pt")
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        epoch(model, optimizer, batches)               # the second epoch, with the run's key and ledger
        assert optimizer.ledger.steps == 40
        ```

        :param state: what ``state_dict()`` returned.
        :raises RuntimeError: after this optimizer's first release (the restored ledger would miss it).
        """
        self.key = load_private_state(self.dp, state)

    def statement(self, delta: float | None = None) -> str:
        """The privacy statement of the releases so far: the guarantee, its cross-check and what it covers.

        :param delta: the delta to state it at (None: the run's).
        :returns: the statement, as ``dpopt train`` prints it at a run's end.
        """
        return privacy_statement(self.ledger, self.delta if delta is None else delta,
                                 self.dp.privatizer.sampler.dataset_size,
                                 randomness="secret-seed" if isinstance(self.key, int) else "os-entropy-key")


def private_state(dp: PrivateStep, key: int | bytes) -> dict[str, Any]:
    """What resuming a run needs: the optimizer's state, the ledger and the secret key (so it is private)."""
    return {"dpopt": dp.state_dict(), "ledger": dp.privatizer.ledger.to_dict(), "secret_key": key}


def load_private_state(dp: PrivateStep, state: dict[str, Any]) -> int | bytes:
    """Restore ``private_state`` into ``dp`` before its first release: its sampler and noise take the saved key,
    its ledger the saved releases. Refused after a release, whose account the saved ledger would drop."""
    if dp.steps or dp.privatizer.ledger.entries:
        raise RuntimeError("load a checkpoint into a fresh make_private, before its first step: the releases made "
                           "since would be missing from the restored ledger")
    key = state["secret_key"]
    dp.privatizer.sampler.stream = SecretStream(key, "sampling")
    dp.privatizer.noise.stream = SecretStream(key, "noise")
    dp.load_state_dict(state["dpopt"])
    dp.privatizer.ledger.entries = PrivacyLedger.from_dict(state["ledger"]).entries
    return key


class PrivateBatches:
    """One epoch of logical batches drawn by the plan's sampler, each handed out in physical batches on the model's
    device."""

    def __init__(self, dp: PrivateStep, data: Any, optimizer: PrivateOptimizer) -> None:
        self.dp, self.data, self.optimizer = dp, data, optimizer

    def __len__(self) -> int:
        return self.dp.privatizer.sampler.steps_per_epoch

    def __iter__(self) -> Iterator[Any]:
        if isinstance(self.dp, ShardedStep):
            yield from self._sharded()
            return
        for _ in range(len(self) - self.dp.steps % len(self)):  # a resumed epoch: its remaining steps
            index = self.dp.privatizer.batch(self.dp.steps)
            if not index.numel():
                self.dp.finish(None)  # an empty logical batch is released too: noise alone
                continue
            parts = index.split(self.dp.physical_batch_size or index.numel())
            for k, part in enumerate(parts):
                self.optimizer.begin(part.numel(), last=k == len(parts) - 1)
                yield to_device(take(self.data, part), self.dp.device)


    def _sharded(self) -> Iterator[Any]:
        """A sharded step's physical batches: as many on every rank (``ShardedStep.rounds``)."""
        for _ in range(len(self) - self.dp.steps % len(self)):
            rounds = self.dp.rounds()
            if not rounds:
                self.dp.end()  # an empty logical batch is released too: noise alone
            for k, (part, real) in enumerate(rounds):
                self.optimizer.begin(part.numel(), last=k == len(rounds) - 1, real=real)
                yield to_device(take(self.data, part), self.dp.device)


def _indexable(data: Any, collate_fn: Callable[[list], Any] = default_collate) -> tuple[Any, int]:
    """``data`` as ``take`` reads it (tensors, a pytree of tensors, or a map-style dataset collated by
    ``collate_fn``), and its size."""
    if isinstance(data, Dataset) or (hasattr(data, "__getitem__") and not isinstance(
            data, (torch.Tensor, tuple, list, dict))):
        if not hasattr(data, "__len__"):
            raise ValueError("the dataset has no __len__: sampling needs the number of examples")
        return (lambda index: collate_fn([data[i] for i in index.tolist()])), len(data)
    leaves = [t for t in tree_flatten(data)[0] if isinstance(t, torch.Tensor) and t.dim() > 0]
    if not leaves:
        raise ValueError("data must be a map-style dataset or tensors with the examples on dimension 0")
    return data, leaves[0].shape[0]


@renamed(hp="hyperparameters")
def make_private(model: nn.Module, optimizer: torch.optim.Optimizer | None, data: Any, loss_fn: LossFn, *,
                 algorithm: str | None = None, batch_size: int, epochs: float = 1, steps: int | None = None,
                 epsilon: float | None = None, noise_multiplier: float | None = None, delta: float = 1e-5,
                 clip: float = 1.0, clipping: str = "flat", physical_batch_size: int | None = None,
                 loss_reduction: str = "mean", noise: str = "auto", sampling: str = "auto", bands: int = 0,
                 workload: str = "ones", tree_decoder: str | None = None, accountant: str = "pld",
                 relation: str = "add-remove", secret_seed: int | bytes | None = None,
                 hyperparameters: Hyperparameters | dict[str, Any] | None = None, lr_schedule: str = "constant",
                 warmup: float = 0.0, parallel: DataParallel | None = None,
                 collate_fn: Callable[[list], Any] = default_collate) -> tuple[nn.Module, PrivateOptimizer,
                                                                               PrivateBatches]:
    """Make a plain PyTorch loop private: the caller keeps its forward, ``loss.backward()`` and
    ``optimizer.step()``; dpopt samples the batches, clips each example, adds the noise once per logical batch and
    keeps the ledger. The sampling, noise and calibration are the ``PrivacyPlan`` of the recipe, as in
    ``dpopt train``. Attribution is verified on three examples before anything is released.

    ```python
    import torch
    import torch.nn.functional as F
    from dpopt import make_private

    x, y = torch.randn(80, 4), torch.randint(0, 2, (80,))
    loss_fn = lambda model, batch: F.cross_entropy(model(batch[0]), batch[1], reduction="none")  # one per example
    model = torch.nn.Linear(4, 2)
    model, optimizer, batches = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), (x, y), loss_fn,
                                             noise_multiplier=1.0, batch_size=4, epochs=2, physical_batch_size=2)
    for epoch in range(2):           # or epsilon=3.0 above: the noise is then calibrated to the run
        for batch in batches:        # a Poisson batch of about 4 examples, in physical batches of at most 2
            optimizer.zero_grad()
            loss_fn(model, batch).mean().backward()
            optimizer.step()         # one release (noise, ledger) after a logical batch's last physical batch
    assert optimizer.ledger.steps == 40                 # 20 logical steps per epoch
    print(optimizer.statement())     # epsilon at the run's delta, and what the guarantee covers
    ```

    A recipe (``algorithm=``) that evaluates the loss several times per step (DiSK, SRG, zeroth-order) takes a
    closure returning the per-example losses instead of the caller's backward:

    ```python
    model = torch.nn.Linear(4, 2)
    model, optimizer, batches = make_private(model, None, (x, y), loss_fn, algorithm="disk-adam", batch_size=4,
                                             noise_multiplier=1.0, hyperparameters={"lr": 0.01, "kappa": 0.5})
    for batch in batches:
        optimizer.step(lambda: loss_fn(model, batch))
    assert optimizer.ledger.steps == 20
    ```

    :param model: the model; its trainable parameters are the ones trained (freeze the others first).
    :param optimizer: a torch optimizer over exactly those parameters (DP-SGD's mechanism: Poisson batches, iid
        Gaussian noise, and that optimizer's update), or None with ``algorithm``.
    :param data: tensors or a pytree of tensors with the examples on dimension 0, or a map-style dataset.
    :param loss_fn: ``loss_fn(model, batch) -> [B]``, one loss per example (the attribution check runs it).
    :param algorithm: a recipe's name (``dpopt.ALGORITHMS``), run with the mechanism ``dpopt train`` runs under it.
    :param batch_size: the expected logical batch (one release, one ledger entry).
    :param epochs: the run's length in epochs of logical batches.
    :param steps: the number of logical steps the noise is calibrated for, if not ``ceil(epochs * steps per
        epoch)``.
    :param epsilon: the target epsilon (the noise is calibrated to it); or give ``noise_multiplier``.
    :param noise_multiplier: the noise's std over the clip bound; the run then reports its epsilon.
    :param delta: the target delta.
    :param clip: the per-example clip bound C.
    :param clipping: ``flat``, ``per-layer`` or ``automatic``.
    :param physical_batch_size: the most examples per forward and backward (None: the whole logical batch).
    :param loss_reduction: how the loop reduces the per-example losses before its backward: ``mean`` or ``sum``.
    :param noise: the noise mechanism (``auto``: the recipe's; ``gaussian``, ``tree``, ``sqrt``, ``banded``, ``mf``).
    :param sampling: the sampling (``auto``: the recipe's; ``poisson``, ``cyclic``, ``shuffle``, ``fixed``).
    :param bands: banded noise's bands and cyclic sampling's period (0: chosen by the plan).
    :param workload: what an optimised factorization targets: ``ones`` (prefix sums) or ``true``.
    :param tree_decoder: tree noise's decoder (None: the recipe's).
    :param accountant: ``pld`` or ``rdp``.
    :param relation: the neighbouring relation: ``add-remove`` or ``replace-one``.
    :param secret_seed: a key for replayable noise (tests, reproductions) or the one a checkpoint kept; None: a
        fresh key from OS entropy.
    :param hyperparameters: the recipe's settings on top of its tuned defaults: its family's config or a dict of
        its fields.
    :param lr_schedule: a recipe's learning-rate schedule over the run: ``constant``, ``cosine`` or ``linear``;
        attach a ``torch.optim.lr_scheduler`` to a torch optimizer instead.
    :param warmup: a linear warm-up of that learning rate: a fraction of the run if below 1, else steps.
    :param parallel: the process group of a model sharded with ``fully_shard`` (every rank calls ``make_private``
        with the same arguments; see docs/distributed.md): each rank trains its shards, the loop passes a closure,
        ``optimizer.step(lambda: loss_fn(model, batch))``, and the run is the unsharded one.
    :param collate_fn: makes a batch of a map-style dataset's examples.
    :returns: the model, a ``PrivateOptimizer`` (a ``torch.optim.Optimizer``: ``zero_grad()``, ``step()`` or
        ``step(closure)``, ``epsilon()``, ``statement()``, ``state_dict()``) and the ``PrivateBatches`` of one epoch.
    :raises ValueError: for a setting that does not apply or is out of range (the message says which), a torch
        optimizer that does not hold exactly the trainable parameters, or a model whose per-example gradients
        cannot be verified on three examples.
    :raises TypeError: for a recipe's name where the torch optimizer goes (use ``algorithm=``).
    """
    if loss_reduction not in ("mean", "sum"):
        raise ValueError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
    hyperparameters = _recipe(optimizer, algorithm, hyperparameters)
    schedule = Schedule(lr_schedule, warmup)
    if optimizer is not None and not schedule.is_constant:
        raise ValueError("lr_schedule and warmup schedule a recipe's (algorithm=) learning rate; attach a "
                         "torch.optim.lr_scheduler to your torch optimizer instead")
    data, n = _indexable(data, collate_fn)
    engine = PerExampleEngine(model, loss_fn)
    key = secret_key(secret_seed) if parallel is None else parallel.from_lead(lambda: secret_key(secret_seed))
    plan = PrivacyPlan(algorithm or "dp-sgd", n, batch_size, epochs, steps, epsilon=epsilon,
                       noise_multiplier=noise_multiplier, delta=delta, clip=clip, clipping=clipping, noise=noise,
                       sampling=sampling, bands=bands, workload=workload, tree_decoder=tree_decoder,
                       accountant=accountant, relation=relation, hyperparameters=hyperparameters).resolved(_log.info)
    privatizer = plan.make(key, _log.info, parallel)
    if optimizer is None:
        total = plan.total_steps(privatizer.sampler)
        dp = build_algorithm(plan.algorithm, engine, privatizer, plan.hyperparameters.for_run(total))
        dp.schedule = schedule.for_run(total)
    else:
        _check_optimizer(optimizer, engine)
        dp = PrivateStep(engine, privatizer, optimizer)
    dp.physical_batch_size = physical_batch_size
    if parallel is not None:
        dp = ShardedStep(dp, plan.algorithm)
    if not dp.verified:  # as PrivateStep.step: not for a statistic that is no per-example gradient (zeroth-order)
        dp.verify(data)
    private = PrivateOptimizer(dp, loss_reduction == "mean", key, delta)
    return model, private, PrivateBatches(dp, data, private)


def _recipe(optimizer: torch.optim.Optimizer | None, algorithm: str | None,
            hyperparameters: Hyperparameters | dict[str, Any] | None) -> Hyperparameters | None:
    """The recipe's hyper-parameters (None: the optimizer's own update), refusing what does not fit together."""
    if isinstance(optimizer, str):
        raise TypeError(f"make_private takes a recipe as algorithm=: make_private(model, None, data, loss_fn, "
                        f"algorithm={optimizer!r}, ...)")
    if (optimizer is None) == (algorithm is None):
        raise ValueError("give a torch optimizer (DP-SGD's mechanism with its update) or, with None in its place, "
                         "algorithm= (a recipe's name), not both")
    if optimizer is not None:
        if hyperparameters is not None:
            raise ValueError("hyperparameters are a recipe's (algorithm=); a torch optimizer holds its own")
        return None
    if isinstance(hyperparameters, dict):
        return hyperparameters_for(algorithm, **hyperparameters)
    return hyperparameters


def _check_optimizer(optimizer: torch.optim.Optimizer, engine: PerExampleEngine) -> None:
    mine = {id(p) for group in optimizer.param_groups for p in group["params"]}
    theirs = {id(p) for p in engine.params}
    if mine != theirs:
        raise ValueError(f"the optimizer's parameters are not the model's trainable parameters ({len(mine)} "
                         f"tensors given, the model trains {len(theirs)}): build it from model.parameters()")


