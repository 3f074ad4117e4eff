"""What is checked before the first release: that no module mixes the examples of a batch, and that the engine's
per-example gradients match one backward per example, once the layers hooks cannot attribute (a parameter used
where no hook sees it, rows that are not examples) are routed to torch.func (``routing.py``). Any failure
refuses DP training: per-example clipping would not bound an example's influence."""

from __future__ import annotations

import contextlib
import math
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from dpopt.device import rng_state, set_rng_state
from dpopt.grad.batch import LossFn, batch_size_of
from dpopt.grad.routing import Planner, Probe, UnattributableError

if TYPE_CHECKING:
    from dpopt.grad.engine import PerExampleEngine
    from dpopt.grad.gradients import PerExampleGradients

# Modules whose training-mode forward mixes the examples of a batch, or stores batch statistics.
_MIXING = (nn.modules.batchnorm._BatchNorm,)


class ExampleMixingError(ValueError):
    """The model lets one example influence another's output: per-example clipping would not bound
    that example's influence, so DP training is refused."""


def check_no_mixing(model: nn.Module) -> None:
    """Refuse a module that computes batch statistics in training (or trains its affine parameters)."""
    for name, m in model.named_modules():
        if isinstance(m, _MIXING) and (m.training or any(p.requires_grad for p in m.parameters(recurse=False))):
            raise ExampleMixingError(
                f"layer {name or '<root>'!r} ({type(m).__name__}) computes batch statistics, so one example "
                "changes the others' outputs and per-example clipping cannot bound its influence. Replace "
                "it with GroupNorm (dpopt.models.replace_batchnorm(model)) or freeze it "
                "(dpopt.models.freeze_batchnorm(model)).")

# One example's reference gradients are taken a group of parameters at a time (``reference_groups``), each group at
# most this fraction of the parameters' bytes, and never under ``MIN_GROUP_BYTES`` (below it, one group: the model is
# small enough that one backward per example is cheaper than several, and as light).
REFERENCE_GROUP_FRACTION = 1 / 8
MIN_GROUP_BYTES = 2**28


def reference_groups(params: list[torch.Tensor], group_bytes: int) -> list[list[int]]:
    """Consecutive runs of parameter indices whose bytes add up to at most ``group_bytes`` each (a parameter larger
    than that forms a group of its own).

    :param params: the parameters, in the engine's order.
    :param group_bytes: the most bytes a group of two or more parameters holds.
    :returns: the groups, covering every index once, in order.
    """
    groups: list[list[int]] = [[]]
    held = 0
    for j, p in enumerate(params):
        size = p.numel() * p.element_size()
        if groups[-1] and held + size > group_bytes:
            groups.append([])
            held = 0
        groups[-1].append(j)
        held += size
    return groups


def default_group_bytes(params: list[torch.Tensor]) -> int:
    """``REFERENCE_GROUP_FRACTION`` of the parameters' bytes, at least ``MIN_GROUP_BYTES``."""
    total = sum(p.numel() * p.element_size() for p in params)
    return max(int(total * REFERENCE_GROUP_FRACTION), MIN_GROUP_BYTES)


def check_attribution(engine: PerExampleEngine, batch: Any, examples: int = 3, rtol: float = 1e-3,
                      group_bytes: int | None = None) -> None:
    """Refuse a model or loss that mixes examples (``check_per_example``), then compare the engine's per-example
    gradients on the first ``examples`` (at least 3) examples of ``batch`` with one autograd backward per example
    (in eval mode, so dropout cannot differ). A mismatch means some layer's gradient was attributed to the wrong
    example, which would void the clipping bound. In hooks mode, the layers hooks cannot attribute (found by a
    probe forward, or by a mismatch) are routed to torch.func over a batch-first module around them first
    (``routing.py``, one log line), and refused only where no such module exists. Reads the batch, releases
    nothing.

    :param group_bytes: the most bytes of reference gradients held at once (``reference_groups``; None:
        ``default_group_bytes``). The decisions do not depend on it; the memory and the number of backward passes do.
    """
    size = batch_size_of(batch)
    if not 3 <= examples <= size:
        raise ValueError(f"attribution is verified on at least 3 examples, and the batch holds {size} "
                         f"for {examples} to compare")
    leaves, spec = tree_flatten(batch)
    pick = lambda idx: tree_unflatten([t[idx] if isinstance(t, torch.Tensor) and t.dim() > 0  # noqa: E731
                                       and t.shape[0] == size else t for t in leaves], spec)
    check_per_example(engine.model, engine.loss_fn, pick(slice(0, max(examples, min(8, size)))))
    groups = reference_groups(engine.params, default_group_bytes(engine.params) if group_bytes is None
                              else group_bytes)
    was_training, projection, precision = engine.model.training, engine.projection, engine.precision
    engine.model.eval()
    engine.projection = None  # attribution is checked on the unprojected gradients, in full precision
    engine.precision = "fp32"
    try:
        planner = Planner(engine, Probe(engine, pick(slice(0, examples)))) if engine.mode == "hooks" else None
        while (wrong := _mismatches(engine, pick, examples, rtol, groups)) is not None:
            params, reason = wrong
            if planner is None:
                raise ExampleMixingError(f"{reason}: this layer's batch dimension is not dimension 0 of its input, "
                                         "so its gradient cannot be attributed to examples. Keep every layer's "
                                         "batch dimension first.")
            planner.escalate(params, reason)
        if planner is not None:
            planner.report()
    except UnattributableError as e:
        raise ExampleMixingError(str(e)) from None
    finally:
        engine.model.train(was_training)
        engine.projection, engine.precision = projection, precision


def _mismatches(engine: PerExampleEngine, pick: Callable[[slice], Any], examples: int, rtol: float,
                groups: list[list[int]]) -> tuple[set[int], str] | None:
    """The parameters whose per-example gradients differ from single-example backward passes, and the worst
    difference in words; None if they match. Each example's reference gradients are taken one group of parameters
    at a time (``_errors``), so the check holds one group of reference gradients and one parameter's row of the
    engine's statistic besides the statistic, not a whole gradient of the model."""
    with _unroutable(engine):
        got = engine.gradients(pick(slice(0, examples)))
    wrong: set[int] = set()
    reason = ""
    for i in range(examples):
        compared = _errors(engine, got, pick(slice(i, i + 1)), i, groups)
        if compared is None:  # a non-finite reference: the clip stage gives this example weight 0
            continue
        norms, errors = compared
        total = math.sqrt(sum(n * n for n in norms))
        if sum(e * e for e in errors) ** 0.5 <= rtol * total + 1e-6:
            continue
        j = max(range(len(errors)), key=errors.__getitem__)
        wrong |= {k for k, (e, n) in enumerate(zip(errors, norms)) if e > rtol * n + 1e-6} | {j}
        reason = reason or (f"the per-example gradients of {engine._layers(j)} did not match single-example "
                            f"backward passes (parameter {engine.names[j]!r}, relative error "
                            f"{errors[j] / max(total, 1e-12):.2e})")
    return (wrong, reason) if wrong else None


def _errors(engine: PerExampleEngine, got: PerExampleGradients, example: Any, i: int,
            groups: list[list[int]]) -> tuple[list[float], list[float]] | None:
    """Per parameter, the norm of example ``i``'s reference gradient (one autograd backward of its loss alone) and
    its distance from row ``i`` of ``got``; None if a reference gradient is not finite. The example's forward graph
    is kept and differentiated once per group (``torch.autograd.grad`` towards that group's parameters only), each
    group's references dropped once compared."""
    loss = engine.loss_fn(engine.model, example).sum()
    norms = [0.0] * len(engine.params)
    errors = [0.0] * len(engine.params)
    for k, group in enumerate(groups):
        ref: list[torch.Tensor | None] = list(torch.autograd.grad(
            loss, [engine.params[j] for j in group], allow_unused=True, retain_graph=k < len(groups) - 1))
        if not all(r is None or torch.isfinite(r).all() for r in ref):
            return None
        for n, j in enumerate(group):
            r, ref[n] = ref[n], None  # each reference gradient is dropped once compared
            with _unroutable(engine):
                g = got.parameter(j, slice(i, i + 1))[0]
            norms[j] = 0.0 if r is None else float(r.norm())
            errors[j] = float((g if r is None else g.sub_(r)).norm())
            del g, r
    return norms, errors


@contextlib.contextmanager
def _unroutable(engine: PerExampleEngine) -> Iterator[None]:
    """Where parameters are routed to torch.func, its failure to take them per example (a RuntimeError or
    ValueError) refuses the model as mixing examples."""
    try:
        yield
    except (RuntimeError, ValueError) as e:
        if not engine.routes:
            raise
        routes = ", ".join(repr(name or "<root>") for name in engine.routes)
        raise ExampleMixingError(
            f"hooks cannot attribute some layers' gradients to examples, and torch.func could not take them per "
            f"example over {routes} ({type(e).__name__}: {e}): some operation there mixes rows of different "
            "examples. Keep the batch as dimension 0 of every layer's input and output.") from e


@torch.no_grad()
def check_per_example(model: nn.Module, loss_fn: LossFn, batch: Any) -> None:
    """Refuse a model (or loss) under which one example changes another example's loss: evaluate the
    batch twice, the second time with example 0 replaced by example 1, under the same random state. On a
    difference, the first module (in the order outputs are computed) whose output for the untouched
    examples changed is named; if none did, the loss itself mixes the examples."""
    b = batch_size_of(batch)
    if b < 3:
        raise ValueError(f"checking that examples do not mix needs at least 3 examples, got {b}")
    leaves, spec = tree_flatten(batch)
    swapped = tree_unflatten([torch.cat([t[1:2], t[1:]]) if isinstance(t, torch.Tensor) and t.dim() > 0
                              and t.shape[0] == b else t for t in leaves], spec)
    outputs: list[list[tuple[str, torch.Tensor]]] = [[], []]

    def record(name: str, run: list[tuple[str, torch.Tensor]]):
        def hook(module: nn.Module, args: tuple, out: Any) -> None:
            if isinstance(out, torch.Tensor) and out.dim() > 0 and out.shape[0] == b and out.is_floating_point():
                run.append((f"{name or '<root>'!r} ({type(module).__name__})", out[2:].detach().clone()))
        return hook

    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    state = rng_state(device)
    losses = []
    for run, data in zip(outputs, (batch, swapped)):
        handles = [m.register_forward_hook(record(n, run)) for n, m in model.named_modules()]
        try:
            set_rng_state(state, device)
            losses.append(loss_fn(model, data))
        finally:
            for h in handles:
                h.remove()
    first, second = losses
    if not isinstance(first, torch.Tensor) or first.shape != (b,):
        raise ValueError(f"the loss function must return one loss per example, shape ({b},)")
    if _close(first[2:], second[2:]):
        return
    for (layer, a), (_, c) in zip(*outputs):
        if a.shape != c.shape or not _close(a, c):
            raise ExampleMixingError(
                f"layer {layer} lets one example change the outputs of other examples in the batch (batch "
                "statistics or another reduction over the batch dimension), so per-example clipping cannot bound "
                "one example's influence. Compute it per example: e.g. GroupNorm or LayerNorm instead of batch "
                "statistics (dpopt.models.replace_batchnorm), or reduce over dimensions other than the batch.")
    raise ExampleMixingError(
        "changing one example changed the loss of other examples, and no layer's (batch-first) output did: the "
        "loss function mixes examples within a batch (a loss normalised over the batch, say), so per-example "
        "clipping cannot bound one example's influence. Return one loss per example computed from that example "
        "alone.")


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal up to float noise; non-finite entries (examples with non-finite losses) compare as equal."""
    scale = a.abs().nan_to_num(0.0, 0.0, 0.0).max().clamp_min(1e-6) if a.numel() else 1.0
    return bool(torch.allclose(a, b, rtol=1e-4, atol=1e-5 * float(scale), equal_nan=True))
