"""Stage 2 (per-example statistic): the engine that owns forward and backward.

``PerExampleEngine.gradients(batch, at=params)`` runs one forward/backward of a per-example loss at the
current parameters or at any other point, and returns ``PerExampleGradients``: a lazy linear
combination of per-example gradients. Algorithms build their statistic with ordinary arithmetic
(DiSK: ``c * g(x + gamma d) + (1 - c) * g(x)``; SRG: ``g(x_t) - c * g(x_{t-1})``), and the clip stage
asks it for per-example norms (cross terms included, without materialising) and for the clipped sum.

Backward is run with ``torch.autograd.grad`` towards the outputs of the first layers, made to require grad by
adding a zero "sink" scalar, with the parameters passed as constants: autograd then computes activation gradients
only and never the (batch-summed) weight gradients, which the clip stage forms itself from the same
factors (book-keeping). Layer hooks see every supported layer's input and output gradient; modules
without a rule are differentiated per example with ``torch.func`` (``fallback.py``), and so are the layers hooks
cannot attribute to examples, over a batch-first module around them that ``verify`` chooses (``routing.py``).
``mode="vmap"`` runs the whole model through ``torch.func`` instead: the reference the hook path is tested against.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

import torch
from torch import nn
from torch.func import functional_call

from dpopt.device import FP16_LOSS_SCALE, autocast, autocast_dtype, rng_state, set_rng_state
from dpopt.grad.batch import Closure, LossFn, batch_size_of
from dpopt.grad.captures import Capture, Dense, Outer
from dpopt.grad.fallback import loss_gradients
from dpopt.grad.gradients import PerExampleGradients
from dpopt.grad.hooks import Recording, Unit, slots
from dpopt.grad.rules import rule_for
from dpopt.grad.verify import check_attribution, check_no_mixing

MODES = ("hooks", "vmap")
STRATEGIES = ("auto", "materialize", "ghost")


class _LossModule(nn.Module):
    """Wraps (model, loss_fn) so that ``functional_call`` can evaluate the loss at any parameters."""

    def __init__(self, model: nn.Module, loss_fn: LossFn) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, batch: Any) -> torch.Tensor:
        return batch.closure() if isinstance(batch, Closure) else self.loss_fn(self.model, batch)


class PerExampleEngine:
    """Per-example gradients of ``loss_fn(model, batch) -> [B]`` for every trainable parameter.

    ``strategy`` decides per layer whether an ``Outer`` capture is kept factored (ghost norms and the
    book-keeping sum) or materialised at once: "auto" keeps whichever form holds fewer elements.

    :param model: the model; its parameters with ``requires_grad`` are the ones trained.
    :param loss_fn: ``loss_fn(model, batch) -> [B]``, one loss per example.
    :param mode: ``hooks`` (module hooks, with ``torch.func`` where a layer needs it) or ``vmap`` (``torch.func``
        over the whole model: the reference, fp32 only).
    :param strategy: ``auto``, ``materialize`` (always materialised) or ``ghost`` (always kept factored).
    :param precision: the forward's precision: ``fp32``, ``bf16``, or ``fp16`` (CUDA only).
    :raises ValueError: for an unknown mode, strategy or precision, fp16 off CUDA, ``vmap`` with a precision
        other than fp32, or a model with no trainable parameter.
    """

    def __init__(self, model: nn.Module, loss_fn: LossFn, mode: str = "hooks", strategy: str = "auto",
                 precision: str = "fp32") -> None:
        if mode not in MODES:
            raise ValueError(f"unknown per-example mode {mode!r}; choose one of {', '.join(MODES)}")
        if strategy not in STRATEGIES:
            raise ValueError(f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
        self.model, self.loss_fn, self.mode, self.strategy = model, loss_fn, mode, strategy
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("the model has no trainable parameters (every parameter has requires_grad=False)")
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        autocast_dtype(precision, self.params[0].device)  # refuses an unknown precision, fp16 off CUDA
        if mode == "vmap" and precision != "fp32":
            raise ValueError(f"per-example mode 'vmap' (the reference the hooks are tested against) runs in fp32 "
                             f"only; use mode 'hooks' for {precision}")
        self.precision = precision
        self._draws: tuple[torch.Tensor, torch.Tensor | None] | None = None  # see ``same_random_draws``
        self._sink: torch.Tensor | None = None  # see ``_zero_sink``
        self.loss_scale = FP16_LOSS_SCALE  # fp16 only: fixed, never adjusted (docs/design.md)
        self._wrapper = _LossModule(model, loss_fn)
        self._index = {id(p): i for i, p in enumerate(self.params)}
        # Every place a parameter is registered, each module once (a module registered under two names is
        # one place), for ``functional_call`` without its weight tying, which would restore such a module's
        # parameter to the substituted tensor.
        self._slots = {"model." + n: i for n, i in slots(model, self._index).items()}
        # module name -> the parameters whose per-example gradients torch.func takes over it, where hooks cannot
        # attribute them (``routing.py``; set by ``verify``)
        self.routes: dict[str, set[int]] = {}
        self.units = self._units()
        self.groups = self._layer_groups()
        # An optional projection of per-example gradients (DP-GRAPE), applied to each capture in backprop:
        # any object with ``sides`` (projected parameter indices), ``shape(i)`` and ``project(i, capture)``.
        self.projection: Any = None

    def loss(self, batch: Any) -> torch.Tensor:
        """The per-example losses of ``batch`` at the model's parameters: ``loss_fn(model, batch)``, or the
        caller's closure for a ``Closure``."""
        return self._wrapper(batch)

    def autocast(self) -> contextlib.AbstractContextManager:
        """The forward's autocast context for ``precision`` on the parameters' device (none for fp32); the
        parameters themselves stay in their own dtype (master weights)."""
        device = self.params[0].device
        return autocast(device, autocast_dtype(self.precision, device))

    @contextlib.contextmanager
    def same_random_draws(self) -> Iterator[None]:
        """Inside, every ``gradients`` call starts from the random state the first one started from, so random
        layers (dropout) draw the same masks at every point: the same sample ξ_i at both points of a two-point
        estimator (SRG, Choquette-Choo et al. 2024 Alg. 1 line 3; DiSK, Zhang et al. 2024 Alg. 3 line 5), whose
        difference would otherwise carry the masks' difference. On exit the state is where one call leaves it."""
        self._draws = rng_state(self.params[0].device)
        try:
            yield
        finally:
            self._draws = None

    @property
    def _scale(self) -> float:
        """The loss scale of the backward: ``loss_scale`` for fp16, else 1."""
        return self.loss_scale if self.precision == "fp16" else 1.0

    @property
    def shapes(self) -> list[torch.Size]:
        """The shape of each parameter's per-example statistic (projected weights have their own)."""
        proj = self.projection
        return [proj.shape(i) if proj is not None and i in proj.sides else p.shape for i, p in enumerate(self.params)]

    # --- structure ---------------------------------------------------------------------------------
    def _collect_units(self, module: nn.Module, name: str, seen: set[int], units: list[Unit]) -> None:
        """One unit per module with trainable parameters of its own, each module once however often it is
        registered; a module without a rule takes its whole subtree."""
        if id(module) in seen:
            return
        seen.add(id(module))
        direct = {n: self._index[id(p)] for n, p in module._parameters.items()
                  if p is not None and id(p) in self._index}
        if direct:
            rule = rule_for(module)
            if rule is None:  # generic: the whole subtree, which may use its children's parameters directly
                units.append(Unit(name, module, None, slots(module, self._index)))
                return
            units.append(Unit(name, module, rule, direct))
        for child_name, child in module.named_children():
            self._collect_units(child, f"{name}.{child_name}" if name else child_name, seen, units)

    def _units(self) -> list[Unit]:
        """The units of the model, less the parameters routed elsewhere, and one unit per route."""
        units: list[Unit] = []
        self._collect_units(self.model, "", set(), units)
        routed = set().union(*self.routes.values())
        kept = []
        for u in units:
            params = {n: i for n, i in u.params.items() if i not in routed}
            if params:
                fixed = {n: i for n, i in u.params.items() if i in routed}
                kept.append(Unit(u.name, u.module, u.rule, params, fixed=fixed if u.rule is None else None))
        modules = dict(self.model.named_modules())
        for name, routed_here in self.routes.items():
            held = slots(modules[name], self._index)
            kept.append(Unit(name, modules[name], None, {n: i for n, i in held.items() if i in routed_here},
                             exclusive=False, fixed={n: i for n, i in held.items() if i not in routed_here}))
        return kept

    def route(self, routes: dict[str, set[int]]) -> None:
        """Take the per-example gradients of the parameters ``routes`` names (module name -> parameter indices)
        with torch.func over that module, and those of every other parameter as before."""
        self.routes = {name: set(params) for name, params in routes.items() if params}
        self.units = self._units()

    def _layers(self, j: int) -> str:
        """The units that capture parameter ``j``, for error messages."""
        return ", ".join(f"layer {u.name!r} ({type(u.module).__name__})" for u in self.units if j in u.params.values())

    def _layer_groups(self) -> list[int]:
        """Group id of each parameter for per-layer clipping: the module that owns it."""
        owners: dict[str, int] = {}
        return [owners.setdefault(n.rpartition(".")[0], len(owners)) for n in self.names]

    def check_no_mixing(self) -> None:
        """Refuse a module that computes batch statistics (``verify.check_no_mixing``)."""
        check_no_mixing(self.model)

    def verify(self, batch: Any, examples: int = 3, rtol: float = 1e-3) -> None:
        """Refuse a model whose per-example gradients are not attributed to the right examples
        (``verify.check_attribution``). Reads the batch, releases nothing.

        :param batch: a batch of at least ``examples`` distinct examples.
        :param examples: how many examples' gradients are compared with one autograd backward each (>= 3).
        :param rtol: the relative tolerance of that comparison.
        :raises ValueError: for too few examples, or a model or loss that mixes examples (``ExampleMixingError``)
            or whose gradients are attributed to the wrong examples.
        """
        check_attribution(self, batch, examples, rtol)

    # --- evaluation --------------------------------------------------------------------------------
    def gradients(self, batch: Any, at: Sequence[torch.Tensor] | None = None) -> PerExampleGradients:
        """Per-example gradients of the loss on ``batch`` at the current parameters, or at ``at``
        (one tensor per trainable parameter, in ``self.params`` order). Parameters are not modified.

        :param batch: the examples, on dimension 0 of each tensor.
        :param at: the point to take them at (None: the current parameters).
        :returns: the per-example gradients, possibly held factored (their norms and clipped sums are read
            from them by ``Privatizer.clip``).
        :raises ValueError: for a model that computes batch statistics, or ``at`` of the wrong length.
        """
        self.check_no_mixing()
        b = batch_size_of(batch)
        values = self.params if at is None else list(at)
        if len(values) != len(self.params):
            raise ValueError(f"`at` needs {len(self.params)} tensors, got {len(values)}")
        detached = [v.detach() for v in values]
        point = {n: detached[i] for n, i in self._slots.items()}
        if self._draws is not None:
            set_rng_state(self._draws, self.params[0].device)
        if self.mode == "vmap":
            return self._vmap_gradients(batch, b, point)
        return self._hook_gradients(batch, b, point, detached)

    def _check_losses(self, losses: Any, b: int) -> torch.Tensor:
        if not isinstance(losses, torch.Tensor) or losses.shape != (b,):
            shape = tuple(losses.shape) if isinstance(losses, torch.Tensor) else type(losses).__name__
            raise ValueError(f"the loss function must return one loss per example, shape ({b},), got {shape}; "
                             "use reduction='none' and average over tokens within each example")
        return losses

    def _vmap_gradients(self, batch: Any, b: int, point: dict[str, torch.Tensor]) -> PerExampleGradients:
        with torch.no_grad():
            losses = self._check_losses(functional_call(self._wrapper, point, (batch,), tie_weights=False), b)
        per_example = loss_gradients(lambda p, x: functional_call(self._wrapper, p, (x,), tie_weights=False),
                                     point, batch, b)
        summed: list[torch.Tensor | None] = [None] * len(self.params)
        for n, i in self._slots.items():  # a parameter registered in several modules: the sum of its uses
            summed[i] = per_example[n] if summed[i] is None else summed[i] + per_example[n]
        terms = [[(1.0, self._project(i, Dense(g, p.shape)))] for i, (g, p) in enumerate(zip(summed, self.params))]
        return PerExampleGradients(self, b, terms, losses)

    def _project(self, i: int, c: Capture) -> Capture:
        """The capture of parameter ``i`` as the statistic wants it: projected if a projection claims it."""
        return c if self.projection is None or i not in self.projection.sides else self.projection.project(i, c)

    def _keep(self, c: Capture) -> Capture:
        if isinstance(c, Outer) and not c.indexed and (
                self.strategy == "materialize"
                or (self.strategy == "auto" and c.materialized_elements() <= c.held_elements())):
            return Dense(c.materialize().to(c.dtype), c.shape)  # the norm and the sum read this one copy
        return c

    def _zero_sink(self) -> torch.Tensor:
        """The zero scalar the backward runs towards, on the parameters' device: made once and kept (autograd
        only reads it), so that a step does not spend a kernel launch filling a new one."""
        device = self.params[0].device
        if self._sink is None or self._sink.device != device:
            self._sink = torch.zeros((), device=device, requires_grad=True)
        return self._sink

    def _hook_gradients(self, batch: Any, b: int, point: dict[str, torch.Tensor],
                        detached: list[torch.Tensor]) -> PerExampleGradients:
        sink = self._zero_sink()
        recording = Recording(self, b, detached, 1.0 / self._scale, sink)
        try:
            with torch.enable_grad(), self.autocast():
                losses = self._check_losses(functional_call(self._wrapper, point, (batch,), tie_weights=False), b)
        finally:
            recording.remove()
        if not recording.sink_used or not losses.requires_grad:
            raise ValueError("the loss does not depend on any trainable parameter through the model's layers "
                             "(or the batch holds tensors that require grad, which is not supported)")
        # the backward of the (scaled) sum of the losses (each loss's output gradient is the scale) as far as the
        # first layers' outputs: the hooks have captured every layer's gradient by then
        attached, recording.attached = recording.attached, []
        torch.autograd.grad(losses, attached, grad_outputs=torch.full_like(losses, self._scale), allow_unused=True)
        return recording.gradients(losses.detach())

    def record(self, batch_size: int, mean: bool = True) -> "Recording":
        """Hooks that record the per-example gradients of the next forward and backward the caller runs
        itself (``loss.backward()`` of a plain training loop), for a batch of ``batch_size`` examples whose
        loss is the mean (``mean``) or the sum of per-example losses. ``remove()`` the recording after the
        backward, then ``gradients()``. Forwards without gradients (evaluation) are not recorded.

        :param batch_size: the number of examples of the batch the caller will run.
        :param mean: whether the caller's loss is the mean of the per-example losses (else their sum).
        :returns: the recording.
        """
        detached = [p.detach() for p in self.params]
        return Recording(self, batch_size, detached, (batch_size if mean else 1.0) / self._scale, None)

