"""Stage 2 (per-example statistic): the engine that owns forward and backward.

``PerExampleEngine.gradients(batch, at=params)`` runs one forward/backward of a per-example loss at the
current parameters or at any other point, and returns ``PerExampleGradients``: a lazy linear
combination of per-example gradients. Algorithms build their statistic with ordinary arithmetic
(DiSK: ``c * g(x + gamma d) + (1 - c) * g(x)``; SRG: ``g(x_t) - c * g(x_{t-1})``), and the clip stage
asks it for per-example norms (cross terms included, without materialising) and for the clipped sum.

Backward is run with ``torch.autograd.grad`` towards a zero "sink" scalar that is added to the outputs of
the first layers, with the parameters passed as constants: autograd then computes activation gradients
only and never the (batch-summed) weight gradients, which the clip stage forms itself from the same
factors (book-keeping). Layer hooks see every supported layer's input and output gradient; modules
without a rule are differentiated per example with ``torch.func`` (``fallback.py``). ``mode="vmap"``
runs the whole model through ``torch.func`` instead: the reference the hook path is tested against.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Collection, Iterable, Iterator, Sequence

import torch
from torch import nn
from torch.func import functional_call
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from dpopt.clipping import PerExampleStatistic
from dpopt.device import FP16_LOSS_SCALE, autocast, autocast_dtype, rng_state, set_rng_state
from dpopt.grad.captures import (Capture, Combination, Dense, Outer, by_materializing, check_version, chunk_elements,
                                 chunks, coalesce, difference, inner_dense)
from dpopt.grad.captures import sq_norms_of
from dpopt.grad.fallback import loss_gradients, module_gradients
from dpopt.grad.rules import TOKENWISE, Rule, rule_for

LossFn = Callable[[nn.Module, Any], torch.Tensor]
MODES = ("hooks", "vmap")
STRATEGIES = ("auto", "materialize", "ghost")

# Modules whose training-mode forward mixes the examples of a batch, or stores batch statistics.
_MIXING = (nn.modules.batchnorm._BatchNorm,)


class ExampleMixingError(ValueError):
    """The model lets one example influence another's output: per-example clipping would not bound
    that example's influence, so DP training is refused."""


class Closure:
    """A physical batch of ``size`` examples given as the caller's closure (``PrivateOptimizer.step(closure)``),
    which returns its per-example losses [size] at the model's current parameters. The engine calls it wherever
    it would evaluate ``loss_fn(model, batch)``, at whatever point it evaluates the loss."""

    def __init__(self, closure: Callable[[], torch.Tensor], size: int) -> None:
        self.closure, self.size = closure, size


def batch_size_of(batch: Any) -> int:
    if isinstance(batch, Closure):
        return batch.size
    tensors = [t for t in tree_flatten(batch)[0] if isinstance(t, torch.Tensor) and t.dim() > 0]
    if not tensors:
        raise ValueError("a batch must contain at least one tensor with a leading batch dimension")
    return tensors[0].shape[0]


class _LossModule(nn.Module):
    """Wraps (model, loss_fn) so that ``functional_call`` can evaluate the loss at any parameters."""

    def __init__(self, model: nn.Module, loss_fn: LossFn) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, batch: Any) -> torch.Tensor:
        return batch.closure() if isinstance(batch, Closure) else self.loss_fn(self.model, batch)


class _Unit:
    """A module whose parameters' per-example gradients are captured together."""

    def __init__(self, name: str, module: nn.Module, rule: Rule | None, params: dict[str, int]) -> None:
        self.name, self.module, self.rule = name or "<root>", module, rule
        self.params = params  # attribute name (rule) or relative name (fallback) -> parameter index


def _slots(module: nn.Module, index: dict[int, int]) -> dict[str, int]:
    """Name (relative to ``module``) -> index of each trainable parameter registered in its subtree, visiting
    every module once."""
    return {f"{m}.{n}" if m else n: index[id(p)] for m, sub in module.named_modules()
            for n, p in sub._parameters.items() if p is not None and id(p) in index}


def _check_example_major(unit: _Unit, x: torch.Tensor, b: int) -> None:
    """A token-wise layer fed B*k rows (tokens flattened, as OPT's MLP does) is regrouped as [B, k, ...],
    i.e. example-major, the layout of a flattened batch-first tensor. ``PerExampleEngine.verify`` (run by
    every DPOptimizer before its first release) catches a model whose rows are laid out otherwise."""
    if unit.rule not in TOKENWISE or x.shape[0] % b:
        raise ValueError(f"layer {unit.name!r} ({type(unit.module).__name__}) received {x.shape[0]} rows for a "
                         f"batch of {b} examples and they cannot be attributed to examples; keep the batch as "
                         "dimension 0 of every layer's input")


BENIGN = 16
# ``clipped_sum``'s one pass over the materialised parameters works a chunk of examples at a time and, per chunk,
# every such parameter in turn: a chunk holds at least this many examples, or a model of many small parameters
# spends its step in per-call overhead (vit-tiny's two-point step: 3 examples a chunk at 2^20 elements; 12.5 ->
# 5.4 times PyTorch's CPU time, docs/performance.md). The pass needs 2 * per_example <= chunk_elements, so its
# temporaries stay under DIRECT_ROWS * chunk_elements (64 MB of float32 on a CPU).
DIRECT_ROWS = 16


def _weighted_rows(w: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """sum_i w_i g[i] over the rows of weight != 0 (a non-finite row given weight 0 contributes exactly zero):
    the other rows are replaced by zeros on the device, so no host synchronisation is needed to find them."""
    g = torch.where((w != 0).unsqueeze(1), g, g.new_zeros(()))
    return torch.tensordot(w.to(g.dtype), g, dims=1)


class PerExampleGradients(PerExampleStatistic):
    """Per-example gradients of a batch, as a linear combination of captured terms per parameter."""

    def __init__(self, engine: "PerExampleEngine", batch_size: int,
                 terms: list[list[tuple[float, Capture]]], losses: torch.Tensor | None = None) -> None:
        self.engine, self.batch_size, self.terms, self.losses = engine, batch_size, terms, losses
        self.shapes = engine.shapes
        self.released = False
        self._settled = False  # one-hot captures merged (``_settle``)
        # combined parameters whose terms may be summed apart (``sq_norms``): a flag on the device until ``_sums``
        # reads them all at once
        self._benign: dict[int, bool | torch.Tensor] = {}

    @property
    def groups(self) -> list[int]:
        return self.engine.groups

    @property
    def device(self) -> torch.device:
        return self.engine.params[0].device

    # --- linear combinations -------------------------------------------------------------------
    def _combine(self, other: "PerExampleGradients", a: float, b: float) -> "PerExampleGradients":
        self._check_alive()
        other._check_alive()
        if other.engine is not self.engine or other.batch_size != self.batch_size:
            raise ValueError("only per-example gradients of the same engine and batch can be combined")
        terms = [[(a * c, t) for c, t in mine] + [(b * c, t) for c, t in theirs]
                 for mine, theirs in zip(self.terms, other.terms)]
        return PerExampleGradients(self.engine, self.batch_size, terms, self.losses)

    def __add__(self, other: "PerExampleGradients") -> "PerExampleGradients":
        return self._combine(other, 1.0, 1.0)

    def __sub__(self, other: "PerExampleGradients") -> "PerExampleGradients":
        return self._combine(other, 1.0, -1.0)

    def __mul__(self, c: float) -> "PerExampleGradients":
        c = float(c)
        return PerExampleGradients(self.engine, self.batch_size,
                                   [[(c * k, t) for k, t in ts] for ts in self.terms], self.losses)

    __rmul__ = __mul__

    def __neg__(self) -> "PerExampleGradients":
        return self * -1.0

    # --- what the clip stage needs ---------------------------------------------------------------
    # A parameter with several terms (a combination, or a parameter used twice) is normed and summed from
    # its materialised per-example vectors, sum_k c_k G_k formed in float32 a chunk of examples at a time:
    # expanded into cross terms, its squared norm is a float sum that cancels below the true value when the
    # coefficients nearly cancel (DiSK's c = 43 at gamma = 0.01 and 1 - c; SRG's eta and -(eta - 1)), and
    # the clip bound is lost. One-hot captures are merged instead (``coalesce``): exact, and cheap; so are two
    # dense-factored ones whose coefficients differ in sign, rewritten as one capture in difference form
    # (``difference``) where its Gram route is cheaper than materialising. The sum of
    # a combined parameter is formed from the same materialised vectors too, unless its terms are benign for
    # every example: (sum_k |c_k| ||G_k||)^2 <= BENIGN * ||sum_k c_k G_k||^2 (no cancellation beyond a factor 4
    # in norm, as for DiSK's default c = 0.86, 1 - c, or SRG's g_t - 0.08 g_t-1). Then each term is summed by
    # book-keeping, whose float32 rounding is at most about 4u of the released norm, and the second
    # materialisation is saved.
    def _settle(self) -> None:
        if self._settled:
            return
        for j, ts in enumerate(self.terms):
            if ts and all(isinstance(t, Outer) and t.indexed for _, t in ts) and (len(ts) > 1 or ts[0][1].steps > 1):
                self.terms[j] = [(1.0, coalesce(ts))]
            elif (merged := difference(ts)) is not None:
                self.terms[j] = [(1.0, merged)]
        self._settled = True

    def _combined(self, j: int) -> bool:
        return len(self.terms[j]) > 1

    def _combination(self, j: int) -> Combination | None:
        """The combined parameter ``j`` as a ``Combination`` normed by the ghost identity, where its terms are
        dense-factored ``Outer`` captures for which that is cheaper; else None (normed from materialised vectors)."""
        ts = self.terms[j]
        if len(ts) < 2 or not all(type(t) is Outer and not t.indexed for _, t in ts):
            return None
        combination = Combination(ts)
        return combination if combination.by_ghost() else None

    def _materialized(self, j: int) -> bool:
        """Whether parameter ``j`` is normed from its materialised per-example vectors."""
        ts = self.terms[j]
        if self._combined(j):
            return self._combination(j) is None
        return bool(ts) and by_materializing(ts[0][1])

    def sq_norms(self, skip: Collection[int] = ()) -> torch.Tensor:
        """Squared per-example norms per parameter, [B, P] in float32; the columns of the parameters in
        ``skip`` are left zero."""
        self._check_alive()
        self._settle()
        wanted = [j for j, ts in enumerate(self.terms) if j not in skip and ts]
        combinations = {j: c for j in wanted if (c := self._combination(j)) is not None}
        captures = [t for j in wanted for _, t in self.terms[j]] + list(combinations.values())
        norms = iter(sq_norms_of(captures))  # the captures' norms, one host synchronisation for all of them
        of = {j: [next(norms) for _ in self.terms[j]] for j in wanted}
        combined = {j: next(norms) for j in combinations}
        cols = []
        for j, (p, ts) in enumerate(zip(self.engine.params, self.terms)):
            if j not in of:
                cols.append(torch.zeros(self.batch_size, device=p.device, dtype=torch.float32))
            elif self._combined(j):
                if j in combined:
                    sq = combined[j]
                else:
                    flats = (self._flat(j, s) for s in self._chunks(j))
                    sq = torch.cat([inner_dense(g, g) for g in flats])
                size = sum(abs(c) * n.sqrt() for (c, _), n in zip(ts, of[j])) ** 2
                self._benign[j] = (size <= BENIGN * sq).all()  # read in ``_sums``, with the others
                cols.append(sq)
            else:
                c, _ = ts[0]
                cols.append(c * c * of[j][0])
        return torch.stack(cols, 1)

    def weighted_sum(self, weights: torch.Tensor, release: bool = False,
                     into: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """sum_i w_i g_i per parameter; ``weights`` is [B] or [B, P]. Examples of weight 0 are left out
        entirely, so a non-finite gradient given weight 0 contributes exactly zero. Parameters are summed
        last to first; ``release`` drops each parameter's captures as soon as its sum exists (the object is
        spent afterwards), so the sums of the first parameters — an embedding table's, say — are allocated
        when the other captures are already gone and the step's peak memory stays near a plain backward's.
        ``into``: running sums (a logical step's, over its physical batches) that each parameter's sum is added
        to as soon as it exists, so at most one parameter's sum is held besides them."""
        self._check_alive()
        self._settle()
        if weights.dim() == 1:
            weights = weights.unsqueeze(1).expand(-1, len(self.terms))
        sums = self._sums(weights, range(len(self.terms)), release, into)
        if release:
            self.released = True
        return sums

    def clipped_sum(self, weigh: Callable[[torch.Tensor], torch.Tensor], release: bool = False,
                    into: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """sum_i w_i g_i per parameter with weights w = ``weigh``(squared norms) [n, P], computed for rows of
        examples (the clip stage). The parameters normed from materialised per-example vectors (convolutions,
        combinations) are materialised once, a chunk of examples at a time, when they are small enough to be
        held together for a chunk: the chunk's norms complete its rows, ``weigh`` turns them into its weights,
        and the same vectors are summed with them at once. Otherwise norms and sums are two chunked passes."""
        self._check_alive()
        self._settle()
        direct = [j for j in range(len(self.terms)) if self._materialized(j)]
        per_example = sum(self.shapes[j].numel() for j in direct)
        if not direct or per_example > chunk_elements(self.device) // 2:
            return self.weighted_sum(weigh(self.sq_norms()), release, into)
        sq = self.sq_norms(skip=direct)
        sums: dict[int, torch.Tensor | None] = {j: None for j in direct}
        unflat = {j: self._unflat(j) for j in direct}
        weights = []
        for s in chunks(self.batch_size, 2 * per_example, self.device, DIRECT_ROWS):
            grads = {j: self._flat(j, s) for j in direct}
            for j, g in grads.items():
                sq[s, j] = inner_dense(g, g)
            w = weigh(sq[s])
            weights.append(w)
            for j, g in grads.items():
                part = _weighted_rows(w[:, j], g)
                sums[j] = part if sums[j] is None else sums[j].add_(part)
        if release:
            for j in direct:
                self.terms[j] = []
        out = self._sums(torch.cat(weights), [j for j in range(len(self.terms)) if j not in sums], release, into)
        for j, total in sums.items():
            total = unflat[j](total)
            out[j] = total if into is None else into[j].add_(total)
        if release:
            self.released = True
        return out

    def _chunks(self, j: int) -> list[slice]:
        return chunks(self.batch_size, 2 * self.shapes[j].numel(), self.device)

    def _flat(self, j: int, s: slice) -> torch.Tensor:
        """Per-example vectors sum_k c_k G_k of parameter ``j`` for the examples in ``s``, [n, numel] in float32
        at least, in its captures' shared ``flat_order`` (the parameter's own order if they differ)."""
        (c, t), *more = self.terms[j]
        own = len({t.flat_order for _, t in self.terms[j]}) > 1
        form = (lambda t: t.materialize(s).flatten(1)) if own else (lambda t: t.flat(s))
        g = form(t)
        g = g.to(self._sum_dtype(j)) * c if c != 1.0 or more or g.dtype != self._sum_dtype(j) else g
        for c, t in more:
            g.add_(form(t), alpha=c)
        return g

    def _unflat(self, j: int) -> Callable[[torch.Tensor], torch.Tensor]:
        """Maps a [numel] sum in ``_flat``'s order to the parameter's (statistic's) shape."""
        ts = self.terms[j]
        if len({t.flat_order for _, t in ts}) == 1:
            return ts[0][1].unflat
        return lambda t: t.view(self.shapes[j])

    def _sum_dtype(self, j: int) -> torch.dtype:
        dtype = self.engine.params[j].dtype
        return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype

    def _sums(self, weights: torch.Tensor, params: Iterable[int], release: bool,
              into: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """``weighted_sum`` for the parameters in ``params`` (last to first), added to ``into`` if given; the
        others' entries are empty."""
        params = sorted(params, reverse=True)
        keep = (weights != 0).any(1)
        # one host synchronisation for the whole sum: whether rows are dropped, and which combined parameters
        # are benign (their flags, set by ``sq_norms``, are read here all at once)
        flagged = [j for j in params if isinstance(self._benign.get(j), torch.Tensor)]
        everyone, *benign = torch.stack([keep.all(), *(self._benign[j] for j in flagged)]).tolist()
        self._benign.update(zip(flagged, benign))
        rows = None if everyone else keep.nonzero().squeeze(1)
        sums: list[torch.Tensor] = [torch.empty(0)] * len(self.terms)
        for j in params:
            p, shape, ts = self.engine.params[j], self.shapes[j], self.terms[j]
            dtype = self._sum_dtype(j)
            w = weights[:, j] if rows is None else weights[rows, j]
            acc = None
            if self._combined(j) and not self._benign.get(j, False):
                unflat = self._unflat(j)
                for s in self._chunks(j):
                    part = _weighted_rows(weights[s, j], self._flat(j, s))
                    acc = part if acc is None else acc.add_(part)
                acc = unflat(acc)
            else:
                for c, t in ts if rows is None or rows.numel() else []:
                    part = (t if rows is None else t.subset(rows)).weighted_sum(w).to(dtype)  # a fresh tensor
                    if c != 1.0:
                        part.mul_(c)
                    acc = part if acc is None else acc.add_(part)
            if release:
                self.terms[j] = []
                del ts
            if into is not None:
                sums[j] = into[j] if acc is None else into[j].add_(acc.view(shape))
            else:
                sums[j] = torch.zeros(shape, device=p.device, dtype=dtype) if acc is None else acc.view(shape)
            del acc
        return sums

    def _check_alive(self) -> None:
        if self.released:
            raise RuntimeError("these per-example gradients were released by weighted_sum or clipped_sum "
                               "(release=True); compute them again")

    def materialize(self) -> list[torch.Tensor]:
        """Per-example gradients [B, *shape] per parameter (for tests and small models)."""
        self._check_alive()
        out = []
        for p, shape, ts in zip(self.engine.params, self.shapes, self.terms):
            acc = torch.zeros(self.batch_size, *shape, device=p.device, dtype=p.dtype)
            for c, t in ts:
                acc += c * t.materialize().reshape(acc.shape)
            out.append(acc)
        return out


class PerExampleEngine:
    """Per-example gradients of ``loss_fn(model, batch) -> [B]`` for every trainable parameter.

    ``strategy`` decides per layer whether an ``Outer`` capture is kept factored (ghost norms and the
    book-keeping sum) or materialised at once: "auto" keeps whichever form holds fewer elements.
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
        self.loss_scale = FP16_LOSS_SCALE  # fp16 only: fixed, never adjusted (docs/design.md)
        self._wrapper = _LossModule(model, loss_fn)
        self._index = {id(p): i for i, p in enumerate(self.params)}
        # Every place a parameter is registered, each module once (a module registered under two names is
        # one place), for ``functional_call`` without its weight tying, which would restore such a module's
        # parameter to the substituted tensor.
        self._slots = {"model." + n: i for n, i in _slots(model, self._index).items()}
        self.units: list[_Unit] = []
        self._collect_units(model, "", set())
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
    def _collect_units(self, module: nn.Module, name: str, seen: set[int]) -> None:
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
                self.units.append(_Unit(name, module, None, _slots(module, self._index)))
                return
            self.units.append(_Unit(name, module, rule, direct))
        for child_name, child in module.named_children():
            self._collect_units(child, f"{name}.{child_name}" if name else child_name, seen)

    def _layers(self, j: int) -> str:
        """The units that capture parameter ``j``, for error messages."""
        return ", ".join(f"layer {u.name!r} ({type(u.module).__name__})" for u in self.units if j in u.params.values())

    def _layer_groups(self) -> list[int]:
        """Group id of each parameter for per-layer clipping: the module that owns it."""
        owners: dict[str, int] = {}
        return [owners.setdefault(n.rpartition(".")[0], len(owners)) for n in self.names]

    def check_no_mixing(self) -> None:
        for name, m in self.model.named_modules():
            if isinstance(m, _MIXING) and (m.training or any(p.requires_grad for p in m.parameters(recurse=False))):
                raise ExampleMixingError(
                    f"layer {name or '<root>'!r} ({type(m).__name__}) computes batch statistics, so one example "
                    "changes the others' outputs and per-example clipping cannot bound its influence. Replace "
                    "it with GroupNorm (dpopt.models.replace_batchnorm(model)) or freeze it "
                    "(dpopt.models.freeze_batchnorm(model)).")

    def verify(self, batch: Any, examples: int = 3, rtol: float = 1e-3) -> None:
        """Refuse a model or loss that mixes examples (``check_per_example``) or uses a parameter where no
        hook sees it (``_check_uses``), then compare the engine's per-example gradients on the first
        ``examples`` (at least 3) examples of ``batch`` with one autograd backward per example (in eval mode,
        so dropout cannot differ). A mismatch means some layer's gradient was attributed to the wrong
        example, which would void the clipping bound. Reads the batch, releases nothing."""
        size = batch_size_of(batch)
        if not 3 <= examples <= size:
            raise ValueError(f"attribution is verified on at least 3 examples, and the batch holds {size} "
                             f"for {examples} to compare")
        leaves, spec = tree_flatten(batch)
        pick = lambda idx: tree_unflatten([t[idx] if isinstance(t, torch.Tensor) and t.dim() > 0  # noqa: E731
                                           and t.shape[0] == size else t for t in leaves], spec)
        check_per_example(self.model, self.loss_fn, pick(slice(0, max(examples, min(8, size)))))
        was_training, projection, precision = self.model.training, self.projection, self.precision
        self.model.eval()
        self.projection = None  # attribution is checked on the unprojected gradients, in full precision
        self.precision = "fp32"
        try:
            if self.mode == "hooks":
                self._check_uses(pick(slice(0, examples)))
            got = self.gradients(pick(slice(0, examples))).materialize()
            for i in range(examples):
                grads = torch.autograd.grad(self.loss_fn(self.model, pick(slice(i, i + 1))).sum(), self.params,
                                            allow_unused=True)
                ref = [torch.zeros_like(p) if g is None else g for p, g in zip(self.params, grads)]
                if not all(torch.isfinite(r).all() for r in ref):  # non-finite: the clip stage gives it weight 0
                    continue
                total = float(torch.cat([r.flatten() for r in ref]).norm())
                errors = [float((g[i] - r).norm()) for g, r in zip(got, ref)]
                if not sum(e * e for e in errors) ** 0.5 <= rtol * total + 1e-6:
                    j = max(range(len(errors)), key=errors.__getitem__)
                    raise ExampleMixingError(
                        f"the per-example gradients of {self._layers(j)} do not match single-example backward "
                        f"passes (parameter {self.names[j]!r}, relative error {errors[j] / max(total, 1e-12):.2e}): "
                        "this layer's batch dimension is not dimension 0 of its input (sequence-first inputs, "
                        "rows in sequence-major order, a table shared by the batch such as wpe(torch.arange(T)) "
                        "or a [1, T, d] buffer), so its gradient cannot be attributed to examples. Keep every "
                        "layer's batch dimension first, or use mode='vmap'.")
        finally:
            self.model.train(was_training)
            self.projection, self.precision = projection, precision

    @torch.no_grad()
    def _check_uses(self, batch: Any) -> None:
        """Refuse a parameter that an operation uses outside the forward of every layer capturing it (weight
        tying written as ``F.linear(h, self.emb.weight)``): the hooks would miss that use of it."""
        owners = {id(p): {id(u.module) for u in self.units if i in u.params.values()}
                  for i, p in enumerate(self.params)}
        running: list[tuple[str, nn.Module]] = []
        engine = self

        class Uses(TorchFunctionMode):
            def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
                out = func(*args, **(kwargs or {}))
                if any(isinstance(t, torch.Tensor) for t in tree_flatten(out)[0]):
                    for t in tree_flatten((args, kwargs))[0]:
                        mods = owners.get(id(t))
                        if mods is not None and not any(id(m) in mods for _, m in running):
                            j = engine._index[id(t)]
                            user = (f"layer {running[-1][0] or '<root>'!r} ({type(running[-1][1]).__name__})"
                                    if running else "the loss function")
                            raise ExampleMixingError(
                                f"{user} uses parameter {engine.names[j]!r} of {engine._layers(j)} outside that "
                                "layer's forward, where the engine's hooks cannot see it (weight tying written as "
                                "F.linear(h, self.emb.weight), say). Share the parameter with a layer instead "
                                "(head.weight = emb.weight, then call head), or use mode='vmap'.")
                return out

        def leave(*_: Any) -> None:
            running.pop()

        handles = [h for name, m in self.model.named_modules()
                   for h in (m.register_forward_pre_hook(lambda m, a, name=name: running.append((name, m))),
                             m.register_forward_hook(leave))]
        try:
            with Uses():
                self.loss_fn(self.model, batch)
        finally:
            for h in handles:
                h.remove()

    # --- evaluation --------------------------------------------------------------------------------
    def gradients(self, batch: Any, at: Sequence[torch.Tensor] | None = None) -> PerExampleGradients:
        """Per-example gradients of the loss on ``batch`` at the current parameters, or at ``at``
        (one tensor per trainable parameter, in ``self.params`` order). Parameters are not modified."""
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
            return Dense(c.materialize(), c.shape)
        return c

    def _hook_gradients(self, batch: Any, b: int, point: dict[str, torch.Tensor],
                        detached: list[torch.Tensor]) -> PerExampleGradients:
        sink = torch.zeros((), device=self.params[0].device, requires_grad=True)
        recording = _Recording(self, b, detached, 1.0 / self._scale, sink)
        try:
            with torch.enable_grad(), self.autocast():
                losses = self._check_losses(functional_call(self._wrapper, point, (batch,), tie_weights=False), b)
        finally:
            recording.remove()
        if not recording.sink_used or not losses.requires_grad:
            raise ValueError("the loss does not depend on any trainable parameter through the model's layers "
                             "(or the batch holds tensors that require grad, which is not supported)")
        torch.autograd.grad(losses.sum() * self._scale, [sink])
        return recording.gradients(losses.detach())

    def record(self, batch_size: int, mean: bool = True) -> "_Recording":
        """Hooks that record the per-example gradients of the next forward and backward the caller runs
        itself (``loss.backward()`` of a plain training loop), for a batch of ``batch_size`` examples whose
        loss is the mean (``mean``) or the sum of per-example losses. ``remove()`` the recording after the
        backward, then ``gradients()``. Forwards without gradients (evaluation) are not recorded."""
        detached = [p.detach() for p in self.params]
        return _Recording(self, batch_size, detached, (batch_size if mean else 1.0) / self._scale, None)


class _Recording:
    """The layer hooks of one forward and backward over ``b`` examples. A rule unit captures its input and
    output gradient; a fallback unit its inputs and output gradients, differentiated per example with
    ``torch.func`` in ``gradients``; every capture enters with ``coefficient`` (1 / the fp16 loss scale; times
    b for a mean loss). With a ``sink`` (the engine's own backward, parameters passed as constants), a zero
    scalar is added to first-layer outputs so that they require grad; without one (a caller's backward) an
    output that does not require grad is not recorded."""

    def __init__(self, engine: "PerExampleEngine", b: int, detached: list[torch.Tensor], coefficient: float,
                 sink: torch.Tensor | None) -> None:
        self.engine, self.b, self.detached, self.coefficient, self.sink = engine, b, detached, coefficient, sink
        self.sink_used = False
        self.terms: list[list[tuple[float, Capture]]] = [[] for _ in engine.params]
        self.calls: list[tuple[_Unit, tuple, dict, list[torch.Tensor], list[torch.Tensor | None]]] = []
        self.inside = 0  # fallback forwards running: torch.func recomputes every call made within them
        self.handles = [u.module.register_forward_hook(self._rule_hook(u) if u.rule else self._fallback_hook(u),
                                                       with_kwargs=True) for u in engine.units]
        self.handles += [u.module.register_forward_pre_hook(self._enter) for u in engine.units if u.rule is None]

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
        return t + self.sink.to(t.dtype)

    def _enter(self, module: nn.Module, args: tuple) -> None:
        self.inside += 1

    def _rule_hook(self, unit: _Unit):
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

    def _fallback_hook(self, unit: _Unit):
        b = self.b

        def hook(module: nn.Module, args: tuple, kwargs: dict, out: Any) -> Any:
            self.inside -= 1
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
            self.calls.append((unit, args, kwargs, [leaves[i] for i in floats], grads))
            return tree_unflatten(leaves, spec)

        return hook

    def gradients(self, losses: torch.Tensor | None) -> PerExampleGradients:
        """The recorded per-example gradients, once the backward has run."""
        b, engine = self.b, self.engine
        for unit, args, kwargs, outs, grads in self.calls:
            cot = {k: g for k, g in enumerate(grads) if g is not None}  # the outputs the loss depends on
            for k, g in cot.items():
                if g.dim() == 0 or g.shape[0] != b:
                    raise ValueError(
                        f"layer {unit.name!r} ({type(unit.module).__name__}) is differentiated per example with "
                        f"torch.func, and its output {k} has shape {tuple(g.shape)}, whose dimension 0 is not the "
                        f"batch of {b} examples, so it cannot be attributed to examples; keep the batch as "
                        "dimension 0 of its inputs and outputs (batch_first=True), or use mode='vmap'")
            if not cot:
                continue
            sub = {n: self.detached[i] for n, i in unit.params.items()}
            with engine.autocast():
                per_example = module_gradients(unit.module, sub, args, kwargs, cot, b)
            for n, i in unit.params.items():
                self.terms[i].append((self.coefficient, Dense(per_example[n], engine.params[i].shape)))
        return PerExampleGradients(engine, b, self.terms, losses)


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
