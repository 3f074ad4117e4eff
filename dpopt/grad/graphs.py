"""Stages 2-3 of a physical batch captured once per batch shape and replayed: a CUDA graph of the forward, the
backward with its hooks, the per-example norms, the clip weights, the clipped sums and the step's status.

On a GPU a step costs one host dispatch per kernel; replaying a graph dispatches all of them at once. What makes the
clip stage capturable: batches of a few fixed shapes, their padding rows of weight 0 (``dpopt.data.buckets``); and a
clip stage that reads nothing while it runs (``PerExampleGradients.clipped_sum(static=True)``): its counts, lowest
squared norm, losses and doubts (a ghost norm that may have cancelled, a combined parameter that is not benign) are
one status tensor, read once after each replay.

Privacy holds as in the eager step, and is checked rather than assumed:

* the noise is not in the graph: the step adds it after the replay, drawn from the secret stream as always, so a
  replay can never repeat a draw; the ledger records each release as always;
* a negative squared norm is refused after the read, before the sums are used; a doubt makes the step form that
  batch's sums again, eagerly (a rare second pass); nothing of a replay with a doubt is used;
* each graph's first ``CHECKS`` replays are compared with the eager clip stage on the same batches (the first one
  is the batch it was captured on, the next a new batch: inputs copied in, nothing left of the last): sums to a
  tolerance, counts exactly. A difference turns capture off for the run (``auto``: one log line, then eager; ``on``:
  an error) and the eager result is the one used.

A model whose forward draws random numbers (dropout) is checked from the same random state: the state before the
replay is restored for the eager comparison, then the state after the replay; where the device's graphs draw other
numbers than its eager kernels from one state, the check fails and the step runs eager. ``Replayed`` is the contract; ``CudaGraphs`` implements it with
``torch.cuda.CUDAGraph``, and ``Rerun`` (the tests' CPU stand-in) by running the captured function again into the
same output tensors.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from dpopt.clipping import Clipping, ClipStats, Weighing
from dpopt.data.buckets import Padding
from dpopt.device import rng_state, set_rng_state
from dpopt.flat import zeros
from dpopt.grad.engine import PerExampleEngine

GRAPH_CHOICES = ("off", "auto", "on")
CHECKS = 2  # replays of each graph compared with the eager clip stage
Outputs = tuple[list[torch.Tensor], torch.Tensor, Weighing]  # the clipped sums, the status, its layout
Eager = Callable[[Any, Padding], tuple[list[torch.Tensor], ClipStats]]


class CaptureError(RuntimeError):
    """A step that cannot be captured, or whose replay differs from the eager step."""


class Replayed(Protocol):
    """A function of static inputs recorded once; ``replay`` recomputes its outputs, in place, from the inputs' new
    values."""

    outputs: Outputs

    def replay(self) -> None: ...


class Rerun:
    """The CPU stand-in of a CUDA graph: ``replay`` runs the function again and copies its results into the first
    run's outputs (what a replay leaves where). It checks the plumbing around a graph (inputs copied in, status read,
    doubts, checks); only a CUDA device makes the step faster."""

    def __init__(self, fn: Callable[[], Outputs]) -> None:
        self.fn = fn
        self.outputs = fn()

    def replay(self) -> None:
        sums, status, _ = self.fn()
        torch._foreach_copy_(self.outputs[0], sums)
        self.outputs[1].copy_(status)


class CudaGraphs:
    """``torch.cuda.CUDAGraph`` capture: warm-up runs on a side stream (which fill every lazily made constant), then
    the capture, sharing one memory pool with the run's other graphs."""

    WARMUP = 2

    def __init__(self, fn: Callable[[], Outputs], pool: Any = None) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(self.WARMUP):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.outputs = fn()

    def replay(self) -> None:
        self.graph.replay()


def check_choice(choice: str) -> None:
    """Refuse a graph choice other than ``GRAPH_CHOICES``."""
    if choice not in GRAPH_CHOICES:
        raise ValueError(f"unknown graph choice {choice!r}; choose one of {', '.join(GRAPH_CHOICES)}")


def why_not_captured(engine: PerExampleEngine, recipe_statistic: bool, parallel: bool) -> str | None:
    """Why the clip stage of this step cannot be captured (None: it can): the reason, as a log line's end."""
    if recipe_statistic or engine.projection is not None:
        return "the recipe's statistic (two points, a projection or zeroth-order) is not captured yet"
    if engine.mode != "hooks":
        return "per-example mode 'vmap' is the reference, and runs eager"
    if parallel:
        return "data-parallel steps run eager"
    device = engine.params[0].device
    if device.type != "cuda":
        return f"CUDA graphs need a CUDA device, and the model is on {device.type}"
    return None


class CapturedClip:
    """The clip stage of physical batches, captured once per batch shape (``Replayed``) and replayed, with the
    status read once per batch; ``clip`` returns None where the caller must run the eager clip stage instead.

    :param engine: the per-example engine (its gradients are the statistic).
    :param clipping: the clipping of the run.
    :param eager: the eager clip stage of a batch and its padding (what the replays are checked against).
    :param strict: raise ``CaptureError`` where ``auto`` would fall back (``--graph on``).
    :param replayed: how to record a function: ``CudaGraphs`` on CUDA, ``Rerun`` for the tests.
    :param log: where the one line about falling back goes.
    """

    def __init__(self, engine: PerExampleEngine, clipping: Clipping, eager: Eager, strict: bool = False,
                 replayed: Callable[[Callable[[], Outputs]], Replayed] | None = None,
                 log: Callable[[str], None] = print) -> None:
        self.engine, self.clipping, self.eager, self.strict, self.log = engine, clipping, eager, strict, log
        self.replayed = replayed or self._cuda
        self._pool: Any = None
        self._graphs: dict[Any, tuple[list[torch.Tensor], Replayed]] = {}
        self._checked: dict[Any, int] = {}
        self.enabled = True
        self.replays = self.reruns = 0  # batches replayed, and those whose doubts sent them to the eager stage

    def _cuda(self, fn: Callable[[], Outputs]) -> Replayed:
        graph = CudaGraphs(fn, self._pool)
        self._pool = graph.graph.pool()
        return graph

    def _static(self, batch: Any, mask: torch.Tensor) -> Outputs:
        """The captured function: the statistic of the batch, its clipped sum and status, reading nothing. Autocast
        keeps no cache of cast weights (a cast made outside a capture would be replayed stale)."""
        cached = torch.is_autocast_cache_enabled()
        torch.set_autocast_cache_enabled(False)
        try:
            grads = self.engine.gradients(batch)
        finally:
            torch.set_autocast_cache_enabled(cached)
        weigh = Weighing(self.clipping, grads.groups, grads.losses, mask)
        sums = grads.clipped_sum(weigh, release=True, static=True)
        status = weigh.status([] if grads.recheck is None else [grads.recheck])
        return sums, status, weigh

    def _graph(self, batch: Any, padding: Padding) -> tuple[Any, list[torch.Tensor], Replayed]:
        """The graph of ``batch``'s shapes (captured on first sight of them): its key, static inputs and replay."""
        leaves, spec = tree_flatten(batch)
        key = (spec, tuple((t.shape, t.dtype) if isinstance(t, torch.Tensor) else t for t in leaves))
        if key not in self._graphs:
            inputs = [t.clone() if isinstance(t, torch.Tensor) else t for t in leaves]
            mask = padding.mask.clone()
            static = tree_unflatten(inputs, spec)
            try:
                graph = self.replayed(lambda: self._static(static, mask))
            except Exception as error:  # a forward that cannot be captured: the step runs eager
                raise CaptureError(f"the step could not be captured ({type(error).__name__}: {error})") from error
            self._graphs[key] = ([t for t in inputs if isinstance(t, torch.Tensor)] + [mask], graph)
            self._checked[key] = 0
        return (key, *self._graphs[key])

    def clip(self, batch: Any, padding: Padding,
             into: list[torch.Tensor] | None) -> tuple[list[torch.Tensor], ClipStats] | None:
        """The clipped sum of ``batch`` (padded: ``padding``) added to ``into`` (None: new sums), and its counts,
        from a replay; None where the eager clip stage must form them (capture off, or a doubt in the status)."""
        if not self.enabled:
            return None
        try:
            key, inputs, graph = self._graph(batch, padding)
        except CaptureError as error:
            return self._give_up(str(error))
        leaves = [t for t in tree_flatten(batch)[0] if isinstance(t, torch.Tensor)] + [padding.mask]
        torch._foreach_copy_(inputs, leaves)
        device = padding.mask.device
        before = rng_state(device) if self._checked[key] < CHECKS else None
        graph.replay()
        sums, status, weigh = graph.outputs
        weigh.restart()
        doubts = weigh.take(status.tolist())  # the one host synchronisation
        self.replays += 1
        stats = weigh.stats(padding.examples)  # refuses a negative squared norm
        if any(doubts):
            self.reruns += 1
            return None
        if before is not None:  # the eager step from the replay's random state (dropout), then the run's own again
            self._checked[key] += 1
            after = rng_state(device)
            set_rng_state(before, device)
            difference = self._differs(sums, stats, batch, padding)
            set_rng_state(after, device)
            if difference is not None:
                return self._give_up(f"the replayed step differs from the eager step ({difference})")
        if into is None:  # the running sums: one flat buffer (one launch, and the release's one draw: ``dpopt.flat``)
            into = zeros([s.shape for s in sums], sums[0].dtype, sums[0].device) \
                if len({s.dtype for s in sums}) == 1 else [torch.zeros_like(s) for s in sums]
        torch._foreach_add_(into, sums)
        return into, stats

    def _differs(self, sums: list[torch.Tensor], stats: ClipStats, batch: Any, padding: Padding) -> str | None:
        """How the replay's sums and counts differ from the eager clip stage's on the same batch (None: they agree)."""
        want, want_stats = self.eager(batch, padding)
        counts = (stats.examples, stats.nonfinite, stats.clipped)
        if counts != (want_stats.examples, want_stats.nonfinite, want_stats.clipped):
            return f"counts {counts}, eager {(want_stats.examples, want_stats.nonfinite, want_stats.clipped)}"
        tolerance = 1e-2 if self.engine.precision != "fp32" else 1e-4
        scale = max(float(torch.stack([w.abs().max() for w in want if w.numel()]).max()), 1e-30)
        error = max(float((s - w).abs().max()) for s, w in zip(sums, want) if w.numel()) / scale
        return None if error <= tolerance else f"largest difference {error:.2e} of the largest entry"

    def _give_up(self, reason: str) -> None:
        if self.strict:
            raise CaptureError(f"--graph on: {reason}")
        self.enabled = False
        self._graphs.clear()
        self.log(f"dpopt: the step runs eager: {reason}")
        return None
