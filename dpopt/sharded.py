"""Sharded private training on FSDP2 (``torch.distributed.fsdp.fully_shard``): every rank holds 1/W of the
parameters, of their gradients and of the optimizer state, and the run is the unsharded run.

A step, per rank (W ranks of one process group, the model sharded on dim 0 of every parameter):

1. sample — rank 0 draws the global batch and broadcasts it (``DataParallel.global_batch``); rank r takes the
   r-th of W contiguous shares, cut into the same number of physical batches on every rank (FSDP2's
   collectives run once per forward and backward, so every rank runs as many).
2. norms — the engine computes the per-example squared norms of the rank's examples (FSDP2 gathers each unit's
   parameters for its forward and backward, so a norm covers every shard of the example's gradient); the clip
   weights w_i follow (``Clipping.weights``).
3. clipped sum — a second forward and backward of sum_i w_i loss_i (the reweighted backward of ghost clipping,
   Li et al. 2022, Sec. 4): its gradient is sum_i w_i g_i = sum_i clip(g_i), and FSDP2's reduce-scatter leaves
   each rank the global sum of the coordinates it owns. The reduce-scatter *sums* (``shard_model`` sets the
   divide factor to 1 on every unit: FSDP2 divides by W by default, which would scale the clipped sum, and so
   the signal-to-noise ratio, by 1/W).
4. noise — each rank adds the noise of the coordinates it owns, once: the noise is a function of the secret
   key, the step and the coordinate's index in the flat statistic (``SecretStream.add_normal_segments_``), so
   the W ranks together draw exactly the unsharded run's noise. The ledger records the release on every rank.
5. update — the base torch optimizer updates each rank's shards (its state is sharded with them).

Steps 2-3 compute each example's gradient twice; both passes run under the same random state, on the same
examples, so both see the same function. An example whose norm is not finite has weight 0; its weighted
gradient (0 times a non-finite number) may still be non-finite, so a step whose clipped sum is not finite is
refused before anything is released (the unsharded step drops the example instead).
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map_only
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from dpopt.algorithms.base import PrivateStep, StepResult
from dpopt.clipping import loss_totals
from dpopt.data.samplers import distinct_examples, take
from dpopt.device import rng_state, set_rng_state, to_device
from dpopt.distributed import DataParallel
from dpopt.grad.verify import ExampleMixingError, check_per_example
from dpopt.noise.gaussian import GaussianNoise

SHARDABLE = ("dp-sgd", "dp-adam", "dp-adamw")  # first-order recipes whose statistic is the gradient itself


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
    """A first-order private step (DP-SGD, DP-Adam, DP-AdamW: the stock optimizer on the privatized gradient)
    on a model sharded with FSDP2, one rank's part of it; the step itself is the unsharded one (see the module's
    docstring)."""

    def __init__(self, dp: PrivateStep, name: str = "this recipe") -> None:
        """:param dp: the recipe's private step, built on the sharded model, with the group as its privatizer's
            ``parallel``.
        :param name: the recipe's name, for refusals.
        :raises ValueError: for a step that cannot be sharded (its statistic is not the gradient, its update not
            a torch optimizer's, correlated noise, per-layer clipping, reduced precision, or no process group)."""
        why = cannot_shard(dp)
        if why is not None:
            raise ValueError(f"{name} cannot train a sharded model: {why}; shard {', '.join(SHARDABLE)}")
        super().__init__(dp.engine, dp.privatizer, dp.base, dp.transforms, verify=not dp.verified,
                         physical_batch_size=dp.physical_batch_size)
        self.schedule = dp.schedule
        self.parallel: DataParallel = dp.privatizer.parallel
        self.ownership = Ownership(self.params)
        summing(self.engine.model)

    def verify(self, data: Any, rtol: float = 1e-3) -> None:
        """Check once, before the first release, on 3 distinct examples of ``data`` (the same on every rank), that
        no module mixes examples and that the engine's per-example gradient of each example is the gradient that
        FSDP2's backward gives for that example alone, on every rank's shards: what the reweighted backward sums
        is what the norms measured. Reads the examples, releases nothing.

        :raises ExampleMixingError: where they differ (a layer whose gradient hooks cannot attribute to examples:
            train such a model unsharded, where torch.func takes it over)."""
        model, engine, world = self.engine.model, self.engine, self.parallel.world_size
        batch = to_device(distinct_examples(data, self.privatizer.sampler.dataset_size), self.device)
        engine.check_no_mixing()
        check_per_example(model, engine.loss_fn, batch)  # also FSDP2's first forward, outside the engine's own
        was_training = model.training
        model.eval()
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

    def rounds(self) -> list[tuple[torch.Tensor, bool]]:
        """This step's global batch (drawn by rank 0), as this rank's physical batches: its share in as many
        physical batches as every rank runs, ceil(largest share / physical batch size), each at most the physical
        batch size; where this rank has no example for a round, the batch's first example with ``real`` False (it
        gets weight 0: the rank joins FSDP2's collectives and adds nothing)."""
        index = self.parallel.global_batch(self.privatizer.sampler, self.steps)
        mine = torch.tensor_split(index, self.parallel.world_size)[self.parallel.rank]
        largest = math.ceil(index.numel() / self.parallel.world_size)
        rounds = math.ceil(largest / (self.physical_batch_size or max(largest, 1)))
        parts = torch.tensor_split(mine, rounds) if rounds else ()
        return [(part, True) if part.numel() else (index[:1], False) for part in parts]

    def end(self) -> None:
        """The end of a step, once every rank has accumulated its rounds: release the sharded clipped sum (noise,
        ledger), then update."""
        grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in self.params]
        self._release(grads)
        self.apply(grads)

    def accumulate(self, batch: Any, real: bool = True) -> torch.Tensor:
        """Norms, then the reweighted backward that adds sum_i clip(g_i) of ``batch`` (on the model's device, or a
        ``Closure``) to the sharded gradients; ``real`` False: the batch gets weight 0 (``rounds``). Returns
        (examples, non-finite, clipped, loss sum, loss count)."""
        state = rng_state(self.device)
        with _constant(self.engine.model, self.params):
            grads = self.engine.gradients(batch)
            weights, finite = self.privatizer.clipping.weights(grads.sq_norms(), grads.groups)
        weights = weights[:, 0] if real else torch.zeros_like(weights[:, 0])
        losses = grads.losses
        del grads
        set_rng_state(state, self.device)  # the same dropout masks as the norms' pass
        (self.engine.loss(batch) * weights.to(losses.dtype)).sum().backward()
        if not real:
            return torch.zeros(5, dtype=torch.float64)
        clipped = (finite & (weights < 1)).sum()
        counts = torch.stack([torch.tensor(len(finite), device=finite.device), (~finite).sum(), clipped])
        return torch.cat([counts.to(torch.float64).cpu(), loss_totals(losses).cpu()])

    def state_dict(self) -> dict[str, Any]:
        """``PrivateStep.state_dict`` with the optimizer's sharded state gathered (a collective: every rank calls
        it): the unsharded run's checkpoint format, whatever the number of ranks."""
        return gathered(super().state_dict())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a ``state_dict`` (gathered, or an unsharded run's): each optimizer state tensor of its
        parameter's shape is sharded as the parameter is."""
        base = state["base"]
        per_param = {i: {k: _like(v, self.params[i]) for k, v in s.items()} for i, s in base["state"].items()}
        super().load_state_dict({**state, "base": {**base, "state": per_param}})

    def _release(self, grads: list[torch.Tensor]) -> None:
        """Stage 4 on this rank's shards: refuse a non-finite clipped sum (on any rank), add the noise of the
        owned coordinates, record the release, divide by the normaliser."""
        segments = self.ownership.segments(grads)
        bad = torch.tensor([float(sum(int((~torch.isfinite(s)).sum()) for _, s in segments))])
        dist.all_reduce(bad)
        if bad.item():
            raise FloatingPointError("the clipped sum is not finite: an example's gradient overflowed, and a "
                                     "sharded step cannot drop it (its weight 0 times a non-finite gradient); "
                                     "nothing was released. Lower the learning rate, or train unsharded")
        noise = self.privatizer.noise
        if noise.std:
            noise.stream.add_normal_segments_(segments, self.ownership.total, self.steps, noise.std)
        self.privatizer.ledger.record(noise.release(self.privatizer.sampler.participation))
        for _, s in segments:
            s.div_(self.privatizer.sampler.normalizer)


def gathered(tree: Any) -> Any:
    """``tree`` (a state dict, nested) with every sharded tensor replaced by the whole tensor on every rank (a
    collective: every rank calls it with the same structure)."""
    from torch.distributed.tensor import DTensor

    return tree_map_only(DTensor, lambda t: t.full_tensor(), tree)


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
def _constant(model: nn.Module, params: list[torch.Tensor]) -> Iterator[None]:
    """Inside, the parameters (and the unsharded ones FSDP2 gathers from them) do not require grad: the engine's
    backward then takes activation gradients only, towards its sink, as on an unsharded model. On exit every unit
    is resharded and holds its sharded parameters again (the engine's ``functional_call`` may leave the detached
    tensors it substituted registered where FSDP2 swapped parameters in the meantime), so that its next forward
    gathers parameters that require grad."""
    from torch.distributed.fsdp import FSDPModule

    held = [(m, name, p) for m in model.modules() for name, p in m._parameters.items()]
    for p in params:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p in params:
            p.requires_grad_(True)
        for unit in model.modules():
            if isinstance(unit, FSDPModule):
                unit.reshard()
        for module, name, p in held:
            module._parameters[name] = p


def refusal(algorithm: str, noise: str, clipping: str, precision: str) -> str | None:
    """Why a run of these settings cannot train sharded (None if it can), for the CLI to say before it starts."""
    if algorithm not in SHARDABLE:
        return f"{algorithm} cannot train sharded yet (--shard trains {', '.join(SHARDABLE)})"
    if noise != "gaussian":
        return f"--shard adds iid Gaussian noise; {noise} noise is correlated across steps (use --noise gaussian)"
    if clipping == "per-layer":
        return "--shard clips each example as a whole (use --clipping flat or automatic)"
    if precision != "fp32":
        return (f"--shard trains in fp32: its norms and its clipped sum come from two passes, which {precision} "
                "would round apart, past the clip bound (use --precision fp32)")
    return None


def cannot_shard(dp: PrivateStep) -> str | None:
    """Why ``dp`` cannot run sharded (None if it can)."""
    if dp.privatizer.parallel is None:
        return "it needs a process group (torchrun, or `dpopt train --nproc N`)"
    if dp._statistic is not None or dp._shapes is not None or not isinstance(dp.base, torch.optim.Optimizer):
        return "its statistic is not the gradient, or its update is not a torch optimizer's"
    if dp.transforms:
        return "it post-processes the released gradient"
    if not isinstance(dp.privatizer.noise, GaussianNoise):
        return "its noise is correlated across steps (use iid Gaussian noise: --noise gaussian)"
    if dp.privatizer.clipping.mode == "per-layer":
        return "per-layer clipping weighs each layer separately (use --clipping flat or automatic)"
    if dp.engine.precision != "fp32":
        return "its norms and its clipped sum come from two passes, which reduced precision would round apart"
    return None
