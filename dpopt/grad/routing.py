"""Routes: parameters whose per-example gradients the hooks cannot attribute to examples, taken instead with
``torch.func`` over the smallest module around their uses that takes and returns the batch as dimension 0.

Hooks attribute a layer's gradient from its input and output gradient, whose dimension 0 must be the batch. The
models people write break that in a few ways: a position table looked up with ``torch.arange(T)`` and added to
every example (nanoGPT), a weight used outside its layer (``F.linear(h, self.wte.weight)``), a Linear,
``MultiheadAttention`` or ``LSTM`` on sequence-first [T, B, d] inputs, one row of a [1, T, d] table.
``PerExampleEngine.verify`` finds them before the first release: ``Probe`` runs the verification batch once,
recording every module call (who called it, whether it takes and returns the batch first) and what hooks cannot
attribute (a layer fed rows that are not examples, a torch.func unit whose output is not batch-first, a parameter
used where no layer capturing it runs); the single-example backward passes then find what looked attributable
and was not. ``Planner`` routes each such layer's parameters to the innermost module that contains every use of
them and whose every call is batch-first; there ``fallback.module_gradients`` takes their per-example gradients
(vmap of vjp, the module's other parameters held constant) while every other layer keeps its hooks. It is exact,
and costs one more forward and backward of that module per physical batch (vectorised over its examples) and the
routed parameters' per-example gradients, held materialised. A layer still wrong there moves one module up; with
no batch-first module left (the model's own input or output is sequence-first), it is refused with what to change.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from dpopt.grad.batch import batch_size_of
from dpopt.grad.hooks import Unit, attributable
from dpopt.grad.rules import REGISTERED

if TYPE_CHECKING:
    from dpopt.grad.engine import PerExampleEngine

_log = logging.getLogger("dpopt")


class UnattributableError(ValueError):
    """Hooks cannot attribute a layer's gradient to examples, and no module around it is batch-first."""


@dataclass(frozen=True)
class Call:
    """One call of a module: the modules running around it (ids, outermost first), and whether it took the batch
    as dimension 0 of an input and returned it as dimension 0 of every floating output."""
    callers: tuple[int, ...]
    batch_first: bool


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor) and t.dim() > 0]


def _batch_first(inputs: Any, out: Any, b: int) -> bool:
    outs = [t for t in _tensors(out) if t.is_floating_point()]
    return any(t.shape[0] == b for t in _tensors(inputs)) and bool(outs) and all(t.shape[0] == b for t in outs)


class Probe:
    """One forward of the verification batch (no gradients) with every module's calls and every use of a trainable
    parameter recorded: ``calls`` (module id -> its calls), ``broken`` (unit module id -> why its hooks cannot
    attribute its gradient) and ``uses`` (parameter index -> the stacks of running modules of each use where no
    unit capturing it runs: weight tying by hand)."""

    def __init__(self, engine: PerExampleEngine, batch: Any) -> None:
        self.engine, self.b = engine, batch_size_of(batch)
        self.calls: dict[int, list[Call]] = {}
        self.broken: dict[int, str] = {}
        self.uses: dict[int, list[tuple[int, ...]]] = {}
        self.users: dict[int, str] = {}  # parameter index -> who used it outside its layers, for messages
        self._stack: list[int] = []
        self.exclusive = {id(u.module) for u in engine.units if u.rule is None and u.exclusive}
        self._units = {id(u.module): u for u in engine.units if u.exclusive}
        self.names = {id(m): name for name, m in engine.model.named_modules()}
        self._modules = {id(m): m for m in engine.model.modules()}
        self._run(batch)

    def describe(self, module_id: int) -> str:
        return f"layer {self.names[module_id] or '<root>'!r} ({type(self._modules[module_id]).__name__})"

    @torch.no_grad()
    def _run(self, batch: Any) -> None:
        engine = self.engine
        owners = {i: {id(u.module) for u in engine.units if i in u.params.values()} for i in range(len(engine.params))}
        index, probe = engine._index, self

        class Uses(TorchFunctionMode):
            def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
                out = func(*args, **(kwargs or {}))
                if any(isinstance(t, torch.Tensor) for t in tree_flatten(out)[0]):
                    for t in tree_flatten((args, kwargs))[0]:
                        i = index.get(id(t)) if isinstance(t, torch.Tensor) else None
                        if i is not None and not owners[i].intersection(probe._stack):
                            probe.uses.setdefault(i, []).append(tuple(probe._stack))
                            user = probe.describe(probe._stack[-1]) if probe._stack else "the loss function"
                            probe.users.setdefault(i, user)
                return out

        handles = [h for m in self._modules.values() for h in (m.register_forward_pre_hook(self._enter),
                                                               m.register_forward_hook(self._leave, with_kwargs=True))]
        try:
            with Uses():
                engine.loss_fn(engine.model, batch)
        finally:
            for h in handles:
                h.remove()

    def _enter(self, module: nn.Module, args: tuple) -> None:
        self._stack.append(id(module))

    def _leave(self, module: nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
        self._stack.pop()
        callers = tuple(self._stack)
        self.calls.setdefault(id(module), []).append(Call(callers, _batch_first((args, kwargs), out, self.b)))
        unit = self._units.get(id(module))
        if unit is None or any(m in self.exclusive for m in callers):
            return
        if unit.rule is not None:
            x = args[0] if args else next(iter(kwargs.values()))
            if not attributable(unit, x.shape[0], self.b):
                self.broken[id(module)] = (f"{unit.describe()} received {x.shape[0]} rows for a batch of {self.b} "
                                           "examples")
        else:
            shapes = [tuple(t.shape) for t in _tensors(out) if t.is_floating_point() and t.shape[0] not in (1, self.b)]
            if shapes:
                self.broken[id(module)] = (f"{unit.describe()} returned shape {shapes[0]}, whose dimension 0 is not "
                                           f"the batch of {self.b} examples")


class Planner:
    """Routes the parameters hooks cannot attribute (``Probe``), and those found wrong later (``escalate``), to
    the innermost batch-first module around all their uses, updating the engine's units each time."""

    def __init__(self, engine: PerExampleEngine, probe: Probe) -> None:
        self.engine, self.probe = engine, probe
        self.reasons: dict[str, list[str]] = {name: [] for name in engine.routes}  # route -> why, for the log
        for module_id, reason in probe.broken.items():
            unit = next((u for u in engine.units if id(u.module) == module_id and u.exclusive), None)
            if unit is not None:  # not moved already with a layer it shares a parameter with
                self.move(set(unit.params.values()), reason)
        for i in sorted(probe.uses):
            self.move({i}, f"{probe.users[i]} uses {engine.names[i]!r} outside the layer that holds it")

    def _holders(self, params: set[int]) -> tuple[set[int], list[Unit]]:
        """The units that capture any of ``params``, and all their parameters (a layer moves whole)."""
        while True:
            units = [u for u in self.engine.units if params.intersection(u.params.values())]
            grown = params.union(*(u.params.values() for u in units))
            if grown == params:
                return params, units
            params = grown

    def move(self, params: set[int], reason: str, above_routes: bool = False) -> None:
        """Route ``params`` (with the rest of their layers) to the innermost batch-first module around every
        call of the units capturing them and every use of them outside those units: strictly above those units,
        or at a route that holds some of them already unless ``above_routes``."""
        params, units = self._holders(params)
        probe = self.probe
        stacks = [c.callers + ((id(u.module),) if not u.exclusive and not above_routes else ())
                  for u in units for c in probe.calls.get(id(u.module), [])]
        stacks += [s for i in params for s in probe.uses.get(i, [])]
        if not stacks:
            return  # never used: its gradient is zero, which the hooks record as such
        prefix: list[int] = []
        for level in zip(*stacks):
            if len(set(level)) > 1:
                break
            prefix.append(level[0])
            if level[0] in probe.exclusive:
                break  # a torch.func unit recomputes everything inside it: no route below it
        target = next((m for m in reversed(prefix) if all(c.batch_first for c in probe.calls.get(m, []))), None)
        if target is None:
            raise UnattributableError(self._refusal(params, reason, prefix, units))
        name = probe.names[target]
        routes = {n: held - params for n, held in self.engine.routes.items()}
        routes[name] = routes.get(name, set()) | params
        reasons = [r for n, rs in self.reasons.items() if n != name and not routes[n] for r in rs]
        self.reasons = {n: rs for n, rs in self.reasons.items() if routes[n]}
        self.reasons[name] = self.reasons.get(name, []) + reasons + [reason]
        self.engine.route(routes)

    def _refusal(self, params: set[int], reason: str, prefix: list[int], units: list[Unit]) -> str:
        names = ", ".join(repr(self.engine.names[i]) for i in sorted(params))
        if any(not s for i in params for s in self.probe.uses.get(i, [])):
            return (f"{reason}, and the loss function runs outside every module of the model, so no module around "
                    f"it can take the per-example gradients of {names} with torch.func. Use the parameter inside "
                    "the model's forward, or share it with a layer instead (head.weight = emb.weight, then call head).")
        if not prefix:
            tried = ", ".join(u.describe() for u in units)
            return (f"{reason}, even taken with torch.func over {tried}: the model's own input or output does not "
                    "have the batch as dimension 0. Keep the batch as dimension 0 of the model's input and output, "
                    "and of every layer's (batch_first=True).")
        return (f"{reason}, so hooks cannot attribute the gradients of {names} to examples, and no module around "
                f"it takes the batch as dimension 0 of its input and returns it as dimension 0 of its outputs (not "
                f"even {self.probe.describe(prefix[0])}), where torch.func could take them per example. Keep the "
                "batch as dimension 0 of the model's input and output, and of that layer's (batch_first=True).")

    def escalate(self, wrong: set[int], reason: str) -> None:
        """Move the layers of the parameters ``wrong`` (their gradients failed the single-example check) one
        batch-first module further up."""
        groups: list[set[int]] = []
        for i in sorted(wrong):
            if not any(i in g for g in groups):
                params, units = self._holders({i})
                own = next((u for u in units if u.rule in REGISTERED), None)
                if own is not None:
                    raise UnattributableError(f"{reason}: {own.describe()} has a rule of your own (register_rule); "
                                              "fix the rule, or keep the layer's batch dimension first")
                groups.append(params)
        for group in groups:
            self.move(group, reason, above_routes=True)

    def report(self) -> None:
        """One log line: what is routed where, why, and what it costs."""
        if not self.engine.routes:
            return
        modules = dict(self.engine.model.named_modules())
        parts, values = [], 0
        for name, params in self.engine.routes.items():
            values += sum(self.engine.params[i].numel() for i in params)
            held = ", ".join(repr(self.engine.names[i]) for i in sorted(params))
            why = "; ".join(self.reasons.get(name, []))
            parts.append(f"{held} over {name or '<root>'!r} ({type(modules[name]).__name__})"
                         + (f", because {why}" if why else ""))
        _log.info("per-example gradients that hooks cannot attribute are taken with torch.func: %s. Cost: one "
                  "more forward and backward of %s per physical batch, and %s values per example held as "
                  "per-example gradients (%s at float32)", "; ".join(parts),
                  "that module" if len(parts) == 1 else "each of those modules", f"{values:,}", _size(4 * values))


def _size(n: int) -> str:
    return f"{n / 2 ** 20:.1f} MB" if n >= 2 ** 20 else f"{n / 2 ** 10:.1f} KB"
