"""Recording: the layer hooks of one forward and backward. A layer with a rule (``rules.py``) captures its input
and output gradient as factors of its per-example gradients; a module without one, or a route (``routing.py``),
is recorded and differentiated per example with ``torch.func`` (``fallback.py``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.autograd.graph import GradientEdge, get_gradient_edge
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from dpopt.grad.captures import Capture, Dense, check_version
from dpopt.grad.fallback import module_gradients
from dpopt.grad.gradients import PerExampleGradients
from dpopt.grad.rules import TOKENWISE, Rule

if TYPE_CHECKING:
    from dpopt.grad.engine import PerExampleEngine


class Unit:
    """A module whose parameters' per-example gradients are captured together: by its layer rule, or with
    ``torch.func`` over its subtree (no rule). A torch.func unit is ``exclusive`` (the modules it calls are
    not recorded: it recomputes them) unless it is a route (``routing.py``), which differentiates only the
    parameters routed to it while the layers inside keep their hooks; ``fixed``: its subtree's other trainable
    parameters, held constant."""

    def __init__(self, name: str, module: nn.Module, rule: Rule | None, params: dict[str, int],
                 exclusive: bool = True, fixed: dict[str, int] | None = None) -> None:
        self.name, self.module, self.rule = name or "<root>", module, rule
        self.params = params  # attribute name (rule) or relative name (fallback) -> parameter index
        self.exclusive, self.fixed = exclusive, fixed or {}

    def describe(self) -> str:
        return f"layer {self.name!r} ({type(self.module).__name__})"


def slots(module: nn.Module, index: dict[int, int]) -> dict[str, int]:
    """Name (relative to ``module``) -> index of each trainable parameter registered in its subtree, visiting
    every module once."""
    return {f"{m}.{n}" if m else n: index[id(p)] for m, sub in module.named_modules()
            for n, p in sub._parameters.items() if p is not None and id(p) in index}


def attributable(unit: Unit, rows: int, b: int) -> bool:
    """Whether a rule unit fed ``rows`` rows can attribute them to ``b`` examples: one row per example, one row
    shared by all (broadcast), or a token-wise layer fed B*k rows (tokens flattened, as OPT's MLP does), regrouped
    as [B, k, ...], i.e. example-major, the layout of a flattened batch-first tensor. ``PerExampleEngine.verify``
    (run by every PrivateStep before its first release) routes a layer fed other rows, or whose rows are laid
    out otherwise, through ``torch.func`` (``routing.py``)."""
    return rows in (b, 1) or (unit.rule in TOKENWISE and rows % b == 0)


def _check_example_major(unit: Unit, x: torch.Tensor, b: int) -> None:
    if not attributable(unit, x.shape[0], b):
        raise ValueError(f"{unit.describe()} received {x.shape[0]} rows for a batch of {b} examples and they "
                         "cannot be attributed to examples; verify the engine on a batch first "
                         "(PerExampleEngine.verify), which takes such a layer per example with torch.func, or "
                         "keep the batch as dimension 0 of every layer's input")


class Recording:
    """The layer hooks of one forward and backward over ``b`` examples. A rule unit captures its input and
    output gradient; a fallback unit its inputs and output gradients, differentiated per example with
    ``torch.func`` in ``gradients``; every capture enters with ``coefficient`` (1 / the fp16 loss scale; times
    b for a mean loss). With a ``sink`` (the engine's own backward, parameters passed as constants), a zero
    scalar is added to first-layer outputs so that they require grad (``attached``: their gradient edges, which the
    backward is taken towards, so that the sink's own gradient, a reduction per output, is never formed; edges
    rather than the outputs, which a model may change in place); without one (a caller's backward) an output that
    does not require grad is not recorded."""

    def __init__(self, engine: "PerExampleEngine", b: int, detached: list[torch.Tensor], coefficient: float,
                 sink: torch.Tensor | None) -> None:
        self.engine, self.b, self.detached, self.coefficient, self.sink = engine, b, detached, coefficient, sink
        self.sink_used = False
        self.attached: list[GradientEdge] = []  # of the first-layer outputs plus the sink
        self.terms: list[list[tuple[float, Capture]]] = [[] for _ in engine.params]
        # torch.func units' calls: their detached inputs and their outputs' gradients (not the outputs: the autograd
        # graph holds the hooks, which hold this recording, a cycle the garbage collector cannot see through)
        self.calls: list[tuple[Unit, tuple, dict, list[torch.Tensor | None]]] = []
        self.inside = 0  # fallback forwards running: torch.func recomputes every call made within them
        self.handles = [u.module.register_forward_hook(self._rule_hook(u) if u.rule else self._fallback_hook(u),
                                                       with_kwargs=True) for u in engine.units]
        self.handles += [u.module.register_forward_pre_hook(self._enter) for u in engine.units
                         if u.rule is None and u.exclusive]

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def _attach(self, t: torch.Tensor) -> torch.Tensor | None:
        if t.requires_grad:
            return t
        if self.sink is None:
            return None
        self.sink_used = True
        out = t + self.sink.to(t.dtype)
        self.attached.append(get_gradient_edge(out))
        return out

    def _enter(self, module: nn.Module, args: tuple) -> None:
        self.inside += 1

    def _rule_hook(self, unit: Unit):
        wanted, b, engine = set(unit.params), self.b, self.engine

        def hook(module: nn.Module, args: tuple, kwargs: dict, out: torch.Tensor) -> torch.Tensor | None:
            if self.inside:
                return None
            arg = args[0] if args else next(iter(kwargs.values()))
            x, version = arg.detach(), arg._version
            out = self._attach(out)
            if out is None:
                return None
            rows = x.shape[0]
            if rows == 1 and b > 1:  # broadcast over the batch (BERT's position_ids buffer, say)
                x, out = x.expand(b, *x.shape[1:]), out.expand(b, *out.shape[1:])
            elif rows != b:
                _check_example_major(unit, arg, b)
                x = x.reshape(b, rows // b, *x.shape[1:])

            def on_grad(g: torch.Tensor) -> None:
                check_version(x, version)
                g = g.detach() if rows in (1, b) else g.detach().reshape(b, rows // b, *g.shape[1:])
                # under autocast the layer computed in its output's dtype, from its input cast to it
                a = x.to(g.dtype) if x.is_floating_point() else x
                for name, cap in unit.rule(module, a, g, wanted).items():
                    i = unit.params[name]
                    self.terms[i].append((self.coefficient, engine._keep(engine._project(i, cap))))

            out.register_hook(on_grad)
            return out

        return hook

    def _fallback_hook(self, unit: Unit):
        b = self.b

        def hook(module: nn.Module, args: tuple, kwargs: dict, out: Any) -> Any:
            self.inside -= unit.exclusive
            if self.inside:
                return None
            leaves, spec = tree_flatten(out)
            floats = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.is_floating_point()]
            attached = [self._attach(leaves[i]) for i in floats]
            if any(t is None for t in attached):
                return None
            grads: list[torch.Tensor | None] = [None] * len(floats)
            for k, (i, t) in enumerate(zip(floats, attached)):
                leaves[i] = t.expand(b, *t.shape[1:]) if t.dim() > 0 and t.shape[0] == 1 and b > 1 else t

                def store(g: torch.Tensor, k: int = k) -> None:
                    grads[k] = g.detach()

                leaves[i].register_hook(store)
            args, kwargs = tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, (args, kwargs))
            self.calls.append((unit, args, kwargs, grads))
            return tree_unflatten(leaves, spec)

        return hook

    def gradients(self, losses: torch.Tensor | None) -> PerExampleGradients:
        """The recorded per-example gradients, once the backward has run."""
        b, engine = self.b, self.engine
        for unit, args, kwargs, grads in self.calls:
            cot = {k: g for k, g in enumerate(grads) if g is not None}  # the outputs the loss depends on
            for k, g in cot.items():
                if g.dim() == 0 or g.shape[0] != b:
                    raise ValueError(
                        f"{unit.describe()} is differentiated per example with torch.func, and its output {k} has "
                        f"shape {tuple(g.shape)}, whose dimension 0 is not the batch of {b} examples, so it cannot "
                        "be attributed to examples; verify the engine on a batch first (PerExampleEngine.verify), "
                        "which takes it over a module around it that is batch-first, or keep the batch as "
                        "dimension 0 of its inputs and outputs (batch_first=True)")
            if not cot:
                continue
            sub = {n: self.detached[i] for n, i in unit.params.items()}
            fixed = {n: self.detached[i] for n, i in unit.fixed.items()}
            with engine.autocast():
                per_example = module_gradients(unit.module, sub, args, kwargs, cot, b, fixed)
            for n, i in unit.params.items():
                cap = Dense(per_example[n], engine.params[i].shape)
                self.terms[i].append((self.coefficient, engine._project(i, cap)))
        return PerExampleGradients(engine, b, self.terms, losses)

