"""Sharded private training on FSDP2 (``torch.distributed.fsdp.fully_shard``): every rank holds 1/W of the
parameters, of their gradients and of the optimizer state, and the run is the unsharded run.

A step, per rank (W ranks of one process group, the model sharded on dim 0 of every parameter):

1. sample — rank 0 draws the global batch and broadcasts it (``DataParallel.global_batch``); rank r takes the
   r-th of W contiguous shares, cut into the same number of physical batches on every rank (FSDP2's
   collectives run once per forward and backward, so every rank runs as many).
2. statistic — the engine computes the per-example statistic of the rank's examples, as unsharded: the gradients
   (FSDP2 gathers each unit's parameters for its forward and backward, so an example's gradient covers every
   shard), or DiSK's two-point mixture (Zhang et al. 2024, Alg. 3 line 5; its second point is reached by moving
   every rank's shards there and back: ``_MovedInPlace``). The forward runs in the engine's precision (bf16
   autocast included); the norms and sums accumulate in fp32.
3. clipped sum — the clip stage weighs the statistic (flat, automatic or per-layer clipping: each example's norms
   are whole on its rank) and sums it, one parameter at a time; each parameter's sum of the rank's examples is
   summed over the ranks as soon as it exists (a reduce-scatter), and the rank keeps the rows it owns
   (``_ShardSum``; ``same_order`` checks that the ranks reduced the parameters in one order). The norms and the
   sum read the same captured per-example gradients: what is summed is what was clipped, whatever the precision
   of the forward.
4. noise — each rank adds the noise of the coordinates it owns, once: the noise is a function of the secret
   key, the step and the coordinate's index in the flat statistic (``SecretStream.add_normal_segments_``), so
   the W ranks together draw exactly the unsharded run's noise. The ledger records the release on every rank.
5. update — the transforms (DiSK's Kalman filter: each rank filters the coordinates it owns, Alg. 3 line 6) and
   the base torch optimizer update each rank's shards (their state is sharded with them).

The sums never pass through FSDP2's own gradient reduction; ``summing`` still makes it sum instead of average, so
that a plain backward through the sharded model (the attribution check's) gives the whole gradient.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map_only
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from dpopt.algorithms.base import PrivateStep, StepResult
from dpopt.clipping import clip_and_sum
from dpopt.data.samplers import distinct_examples, take
from dpopt.device import to_device
from dpopt.distributed import DataParallel
from dpopt.grad.engine import PerExampleEngine
from dpopt.grad.gradients import PerExampleGradients
from dpopt.grad.verify import ExampleMixingError, check_per_example
from dpopt.noise.gaussian import GaussianNoise
from dpopt.transforms.kalman import KalmanFilter

# recipes whose base update is a torch optimizer and whose statistic is the gradient, or DiSK's mixture of two
SHARDABLE = ("dp-sgd", "dp-adam", "dp-adamw", "disk-sgd", "disk-adam", "disk-adamw")
PRECISIONS = ("fp32", "bf16")  # fp16 needs CUDA and its loss scale; sharded, it is not tested yet


def device_mesh(parallel: DataParallel, device: torch.device) -> DeviceMesh:
    """A one-dimensional mesh of the group's W ranks for parameters on ``device`` (``init_device_mesh("cpu")``
    for a gloo group: an explicit CPU mesh, pytorch #132471)."""
    return init_device_mesh(device.type, (parallel.world_size,))


def shard_model(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """Shard ``model`` in place with FSDP2 for private training: one FSDP unit per module that owns trainable
    parameters itself (below the root), then the root; each unit's reduce-scatter sums (``summing``). A model
    sharded otherwise (its owner's ``fully_shard`` calls) trains as well, once ``summing``.

    :param model: the model, on the mesh's device, its frozen parameters already frozen, built the same on every
        rank (the same seed).
    :param mesh: the ranks to shard over (``device_mesh``).
    :returns: the model (now an ``FSDPModule``).
    """
    from torch.distributed.fsdp import fully_shard  # FSDP2 and DTensor take about a second to import: when used

    for name, module in list(model.named_modules()):
        if name and any(p.requires_grad for p in module.parameters(recurse=False)):
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    summing(model)
    return model


def summing(model: nn.Module) -> None:
    """Make every FSDP unit of ``model`` sum its gradients over the ranks instead of averaging them: a sharded
    model that its owner wrapped with ``fully_shard`` goes through this before private training."""
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not units:
        raise ValueError("the model is not sharded: wrap it with torch.distributed.fsdp.fully_shard (or "
                         "dpopt.sharded.shard_model) first")
    for unit in units:
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)  # a plain SUM: gloo has no pre-multiplied sum


class Ownership:
    """Which coordinates of the flat statistic (the trainable parameters in order, each flattened) this rank's
    shards hold: parameter i's local rows [o, o + r) of a [d0, ...] tensor are coordinates
    start_i + o * (numel_i / d0) onwards, contiguous (FSDP2 shards every parameter on dim 0)."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        from torch.distributed.tensor import DTensor, Shard
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        self.starts: list[int] = []
        self.rows: list[tuple[int, int]] = []  # (first row, rows) of each local shard
        total = 0
        for i, p in enumerate(params):
            if not (isinstance(p, DTensor) and p.placements == (Shard(0),)):
                raise ValueError(f"trainable parameter {i} is not sharded on dim 0 by FSDP2 (it is "
                                 f"{type(p).__name__}); shard the model with fully_shard (dpopt.sharded.shard_model)"
                                 " before building the private step")
            shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
            if tuple(p.to_local().shape) != tuple(shape):
                raise ValueError(f"parameter {i}'s local shard has shape {tuple(p.to_local().shape)}, not the "
                                 f"{tuple(shape)} its placement gives")
            self.starts.append(total + offset[0] * (p.numel() // max(p.shape[0], 1)))
            self.rows.append((offset[0], shape[0]))
            total += p.numel()
        self.total = total

    def segments(self, grads: list[torch.Tensor]) -> list[tuple[int, torch.Tensor]]:
        """(first flat coordinate, 1-D local values) of each gradient shard (``DTensor``)."""
        return [(start, g.to_local().view(-1)) for start, g in zip(self.starts, grads)]


class ShardedStep(PrivateStep):
    """A first-order private step whose update is a torch optimizer's (DP-SGD, DP-Adam, DP-AdamW, and their DiSK
    versions) on a model sharded with FSDP2, one rank's part of it; the step itself is the unsharded one (see the
    module's docstring)."""

    def __init__(self, dp: PrivateStep, name: str = "this recipe") -> None:
        """:param dp: the recipe's private step, built on the sharded model, with the group as its privatizer's
            ``parallel``.
        :param name: the recipe's name, for refusals.
        :raises ValueError: for a step that cannot be sharded (its statistic is neither the gradient nor DiSK's
            mixture, its update not a torch optimizer's, correlated noise, fp16, or no process group)."""
        why = cannot_shard(dp)
        if why is not None:
            raise ValueError(f"{name} cannot train a sharded model: {why}; shard {', '.join(SHARDABLE)}")
        super().__init__(dp.engine, dp.privatizer, dp.base, dp.transforms, statistic=dp._statistic,
                         verify=not dp.verified, physical_batch_size=dp.physical_batch_size)
        self.schedule = dp.schedule
        self.parallel: DataParallel = dp.privatizer.parallel
        self.ownership = Ownership(self.params)
        self._sums: list[torch.Tensor] | None = None  # the step's clipped sum so far, sharded as the parameters
        summing(self.engine.model)

    def verify(self, data: Any, rtol: float = 1e-3) -> None:
        """Check once, before the first release, on 3 distinct examples of ``data`` (the same on every rank), that
        no module mixes examples and that the engine's per-example gradient of each example is the gradient that
        FSDP2's backward gives for that example alone, on every rank's shards (in fp32, as the unsharded check).
        Reads the examples, releases nothing.

        :raises ExampleMixingError: where they differ (a layer whose gradient hooks cannot attribute to examples:
            train such a model unsharded, where torch.func takes it over)."""
        model, engine, world = self.engine.model, self.engine, self.parallel.world_size
        batch = to_device(distinct_examples(data, self.privatizer.sampler.dataset_size), self.device)
        engine.check_no_mixing()
        check_per_example(model, engine.loss_fn, batch)  # also FSDP2's first forward, outside the engine's own
        was_training, precision = model.training, engine.precision
        model.eval()
        engine.precision = "fp32"
        errors = torch.zeros(3, 3, dtype=torch.float64)  # per example: squared error, squared reference, non-finite
        try:
            with _constant(model, self.params):
                got = engine.gradients(batch)
            for i in range(got.batch_size):
                engine.loss(take(batch, torch.tensor([i]))).sum().backward()  # every rank: W times the gradient
                for j, (p, (row, rows)) in enumerate(zip(self.params, self.ownership.rows)):
                    g = got.parameter(j, slice(i, i + 1))[0]  # one parameter's row at a time, as verify.py reads
                    ref = (torch.zeros(p.to_local().shape) if p.grad is None else p.grad.to_local() / world).double()
                    ref = ref.cpu()
                    errors[i] += torch.stack([(g.narrow(0, row, rows).double().cpu() - ref).square().sum(),
                                              ref.square().sum(), (~torch.isfinite(ref)).sum().double()])
                    p.grad = None
        finally:
            model.train(was_training)
            engine.precision = precision
        dist.all_reduce(errors)
        errors = errors[errors[:, 2] == 0].sum(0)  # a non-finite example gets weight 0 in the clip stage: skipped
        if not errors[0].sqrt() <= rtol * errors[1].sqrt() + 1e-6:
            raise ExampleMixingError(
                f"the engine's per-example gradients differ from single-example backward passes through the sharded "
                f"model (relative error {float(errors[0].sqrt() / errors[1].sqrt().clamp_min(1e-12)):.2e}): some "
                "layer's gradient cannot be attributed to examples by hooks; train this model unsharded")
        self.verified = True

    def step(self, data: Any) -> StepResult:
        """One private step on the batch it samples from ``data`` (as ``PrivateStep.step``)."""
        if not self.verified:
            self.verify(data)
        totals = torch.zeros(5, dtype=torch.float64)  # examples, non-finite, clipped, loss sum, loss count
        for part, real in self.rounds():
            totals += self.accumulate(to_device(take(data, part), self.device), real)
        self.end()
        examples, nonfinite, clipped, loss_sum, loss_count = self.privatizer.total(totals.tolist())
        return StepResult(loss_sum / loss_count if loss_count else None, int(examples), int(nonfinite),
                          int(clipped))

    def rounds(self, step: int | None = None) -> list[tuple[torch.Tensor, bool]]:
        """Step ``step``'s global batch (None: this step's; drawn by rank 0), as this rank's physical batches: its
        share in as many physical batches as every rank runs, ceil(largest share / physical batch size), each at
        most the physical batch size; where this rank has no example for a round, the batch's first example with
        ``real`` False (it gets weight 0: the rank joins the collectives and adds nothing)."""
        index = self.parallel.global_batch(self.privatizer.sampler, self.steps if step is None else step)
        mine = torch.tensor_split(index, self.parallel.world_size)[self.parallel.rank]
        largest = math.ceil(index.numel() / self.parallel.world_size)
        rounds = math.ceil(largest / (self.physical_batch_size or max(largest, 1)))
        parts = torch.tensor_split(mine, rounds) if rounds else ()
        return [(part, True) if part.numel() else (index[:1], False) for part in parts]

    def statistic(self, batch: Any) -> PerExampleGradients:
        """The per-example statistic of ``batch`` (``PrivateStep.statistic``) through the sharded model: the
        gradients, or the recipe's own statistic (DiSK's), whose other points are reached by moving the shards
        (``_MovedInPlace``)."""
        with _constant(self.engine.model, self.params) as settle:
            if self._statistic is None:
                return self.engine.gradients(batch)
            return self._statistic(_MovedInPlace(self.engine, settle), batch)

    def accumulate(self, batch: Any, real: bool = True) -> torch.Tensor:
        """Add sum_i clip(g_i) of ``batch`` (on the model's device, or a ``Closure``) to the step's sharded clipped
        sum; ``real`` False: the batch gets weight 0 (``rounds``). Returns (examples, non-finite, clipped, loss sum,
        loss count) of this rank."""
        if self._sums is None:
            self._sums = [torch.zeros_like(p) for p in self.params]
        order: list[int] = []
        into = [_ShardSum(s, j, order) for j, s in enumerate(self._sums)]
        grads = self.statistic(batch)
        if real:
            _, stats = clip_and_sum(grads, self.privatizer.clipping, release=True, into=into)
            counts = torch.tensor([stats.examples, stats.nonfinite, stats.clipped, *(stats.losses or (0.0, 0))],
                                  dtype=torch.float64)
        else:  # the same clip-stage calls as a real batch, so the same collectives, in the same order
            grads.clipped_sum(torch.zeros_like, release=True, into=into)
            counts = torch.zeros(5, dtype=torch.float64)
        try:
            same_order(order)
        except RuntimeError:
            self._sums = None  # summed apart: never released
            raise
        return counts

    def end(self) -> None:
        """The end of a step, once every rank has accumulated its rounds: release the sharded clipped sum (noise,
        ledger), post-process it (the transforms), then update."""
        self.apply(self.released())

    def released(self, sums: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """Stages 4-5 on this rank's shards (``PrivateStep.released``, sharded): the step's clipped sum (``sums``,
        sharded as the parameters, or else what ``accumulate`` added up; neither: an empty batch, noise alone)
        released once (the noise of the owned coordinates, the ledger), then post-processed by the transforms."""
        if sums is None:
            sums, self._sums = self._sums, None
        grads = [torch.zeros_like(p) for p in self.params] if sums is None else sums
        self._release(grads)
        for t in self.transforms:
            grads = t(grads)
        return grads

    def state_dict(self) -> dict[str, Any]:
        """``PrivateStep.state_dict`` with the optimizer's and the transforms' sharded state gathered on rank 0 (a
        collective: every rank calls it; ``gathered``): the unsharded run's checkpoint format, whatever the number of
        ranks, on rank 0; None in place of each sharded tensor on the others."""
        return gathered(super().state_dict())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a ``state_dict`` (gathered, or an unsharded run's): each optimizer state tensor of its
        parameter's shape, and each per-parameter list of a transform's state, is sharded as the parameter is. The
        optimizer's state is numbered by its parameter groups, in their order (the Trainer's: decayed, then not)."""
        base = state["base"]
        numbered = [p for group in self.base.param_groups for p in group["params"]]
        per_param = {i: {k: _like(v, numbered[i]) for k, v in s.items()} for i, s in base["state"].items()}
        transforms = [{k: self._per_parameter(v) for k, v in s.items()} for s in state["transforms"]]
        super().load_state_dict({**state, "base": {**base, "state": per_param}, "transforms": transforms})

    def _per_parameter(self, value: Any) -> Any:
        """``value`` sharded as the parameters if it is a list of one tensor per parameter; else as it is."""
        if isinstance(value, list) and len(value) == len(self.params):
            return [_like(v, p) for v, p in zip(value, self.params)]
        return value

    def _release(self, grads: list[torch.Tensor]) -> None:
        """Stage 4 on this rank's shards: add the noise of the owned coordinates, record the release, divide by
        the normaliser."""
        segments = self.ownership.segments(grads)
        noise = self.privatizer.noise
        if noise.std:
            noise.stream.add_normal_segments_(segments, self.ownership.total, self.steps, noise.std)
        self.privatizer.ledger.record(noise.release(self.privatizer.sampler.participation))
        for _, s in segments:
            s.div_(self.privatizer.sampler.normalizer)


class _ShardSum:
    """A running sum of the clip stage (``clipped_sum(into=...)``) for sharded parameter ``index``: each sum it is
    given (the parameter's whole sum over this rank's examples) is summed over the ranks by a reduce-scatter, and
    this rank adds the rows it owns to ``total`` (a ``DTensor`` sharded as the parameter); ``index`` is appended to
    ``order``. The clip stage runs through the parameters in one order on every rank, so the reduce-scatters meet;
    ``same_order`` checks that they did."""

    def __init__(self, total: torch.Tensor, index: int, order: list[int]) -> None:
        self.total, self.index, self.order = total, index, order

    def add_(self, whole: torch.Tensor) -> "_ShardSum":
        from torch.distributed.tensor import DTensor, Partial

        self.order.append(self.index)

        mesh, placements = self.total.device_mesh, self.total.placements
        mine = DTensor.from_local(whole.contiguous(), mesh, [Partial()], run_check=False).redistribute(
            mesh, placements).to_local()
        self.total.to_local().add_(mine.to(self.total.dtype))
        return self


def same_order(order: list[int]) -> None:
    """Check that every rank reduced the parameters' sums in the same ``order`` (a collective), before anything is
    released: sums of parameters of one shape reduced in different orders would add up apart.

    :raises RuntimeError: where the orders differ."""
    code = 0
    for index in order:
        code = (code * 1_000_003 + index + 1) % 2 ** 31
    seen = torch.tensor([code, -code, len(order), -len(order)], dtype=torch.float64)
    dist.all_reduce(seen, dist.ReduceOp.MAX)
    if seen[0] != -seen[1] or seen[2] != -seen[3]:
        raise RuntimeError("the ranks reduced the parameters' clipped sums in different orders, so they were summed "
                           "apart; nothing was released. Every rank must run the same modules in the same order")


class _MovedInPlace:
    """The engine, for a recipe's statistic: ``gradients(batch, at=point)`` moves every rank's shards to ``point``
    (sharded as the parameters), takes the gradients there, and moves them back. FSDP2 gathers a unit's
    parameters from its shards for every forward, so a point handed to the engine's ``functional_call`` would be
    replaced by the current parameters; the shards themselves must hold it."""

    def __init__(self, engine: PerExampleEngine, settle: Callable[[], None]) -> None:
        """:param engine: the sharded model's engine.
        :param settle: reshards every unit (``_constant``)."""
        self._engine, self._settle = engine, settle

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def gradients(self, batch: Any, at: Sequence[torch.Tensor] | None = None) -> PerExampleGradients:
        """``PerExampleEngine.gradients`` at ``at`` (one tensor per parameter, sharded as it; None: here), the
        shards back where they were on return.

        :raises ValueError: for ``at`` of the wrong length."""
        if at is None:
            return self._engine.gradients(batch)
        shards = [p.to_local() for p in self._engine.params]
        if len(at) != len(shards):
            raise ValueError(f"`at` needs {len(shards)} tensors, got {len(at)}")
        here = [s.clone() for s in shards]
        self._settle()  # no unit keeps parameters it gathered at the current point
        try:
            with torch.no_grad():
                torch._foreach_copy_(shards, [v.to_local() for v in at])
            return self._engine.gradients(batch)
        finally:
            with torch.no_grad():
                torch._foreach_copy_(shards, here)
            self._settle()  # nor any it gathered at ``at``


def gathered(tree: Any) -> Any:
    """``tree`` (a state dict, nested) with every sharded tensor replaced, on rank 0, by the whole tensor in CPU
    memory, and by None on the other ranks (a collective: every rank calls it with the same structure). The tensors
    are gathered one at a time: a rank other than 0 holds one whole tensor, while it is gathered, and rank 0's
    device holds no more."""
    from torch.distributed.tensor import DTensor

    lead = dist.get_rank() == 0

    def whole(t: DTensor) -> torch.Tensor | None:
        full = t.full_tensor()  # every rank takes part in the all-gather
        return full.cpu() if lead else None

    return tree_map_only(DTensor, whole, tree)


def load_model_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load a whole (gathered, or unsharded) state dict into a sharded ``model``: each rank keeps its shards."""
    live = model.state_dict()
    model.load_state_dict({k: _like(v, live[k]) for k, v in state.items()})


def _like(value: Any, live: Any) -> Any:
    """``value`` sharded as ``live`` is, where ``live`` is a sharded tensor of its shape; else as it is."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(live, DTensor) and isinstance(value, torch.Tensor) and value.shape == live.shape:
        return distribute_tensor(value.to(live.device), live.device_mesh, live.placements)
    return value


@contextlib.contextmanager
def _constant(model: nn.Module, params: list[torch.Tensor]) -> Iterator[Callable[[], None]]:
    """Inside, the parameters (and the unsharded ones FSDP2 gathers from them) do not require grad: the engine's
    backward then takes activation gradients only, towards its sink, as on an unsharded model. It yields
    ``settle``, which reshards every unit, so that it holds its sharded parameters again (the engine's
    ``functional_call`` may leave the detached tensors it substituted registered where FSDP2 swapped parameters in
    the meantime) and its next forward gathers them from the shards as they are then; on exit, the parameters
    require grad again and ``settle`` runs."""
    from torch.distributed.fsdp import FSDPModule

    held = [(m, name, p) for m in model.modules() for name, p in m._parameters.items()]

    def settle() -> None:
        for unit in model.modules():
            if isinstance(unit, FSDPModule):
                unit.reshard()
        for module, name, p in held:
            module._parameters[name] = p

    for p in params:
        p.requires_grad_(False)
    try:
        yield settle
    finally:
        for p in params:
            p.requires_grad_(True)
        settle()


def refusal(algorithm: str, noise: str, clipping: str, precision: str) -> str | None:
    """Why a run of these settings cannot train sharded (None if it can), for the CLI to say before it starts."""
    if algorithm not in SHARDABLE:
        return f"{algorithm} cannot train sharded yet (--shard trains {', '.join(SHARDABLE)})"
    if noise != "gaussian":
        return f"--shard adds iid Gaussian noise; {noise} noise is correlated across steps (use --noise gaussian)"
    if precision not in PRECISIONS:
        return f"--shard trains in {' or '.join(PRECISIONS)}, not {precision} (use --precision bf16)"
    return None


def cannot_shard(dp: PrivateStep) -> str | None:
    """Why ``dp`` cannot run sharded (None if it can)."""
    if dp.privatizer.parallel is None:
        return "it needs a process group (torchrun, or `dpopt train --nproc N`)"
    kalman = dp.transforms[0] if dp.transforms and isinstance(dp.transforms[0], KalmanFilter) else None
    statistic = None if kalman is None else kalman.statistic  # the gradient, or DiSK's mixture
    if dp._statistic != statistic or dp._shapes is not None or not isinstance(dp.base, torch.optim.Optimizer):
        return "its statistic is neither the gradient nor DiSK's, or its update is not a torch optimizer's"
    if dp.transforms[kalman is not None:]:
        return "it post-processes the released gradient"
    if not isinstance(dp.privatizer.noise, GaussianNoise):
        return "its noise is correlated across steps (use iid Gaussian noise: --noise gaussian)"
    if dp.engine.precision not in PRECISIONS:
        return f"it trains in {' or '.join(PRECISIONS)}, not {dp.engine.precision}"
    return None
