"""The generic path: per-example gradients with ``torch.func`` (vmap of vjp / grad).

Used for any module that has trainable parameters but no layer rule (the whole subtree below it is then
handled here, since such a module may use its children's parameters without calling them), for the parameters
routed to a module around layers hooks cannot attribute (``routing.py``), and, in ``vmap`` mode, for the whole
model. Random operations (dropout) draw independently per example (``randomness="different"``); the
recomputation inside a fallback module therefore sees fresh dropout masks, which changes the gradient sample but
never its clipping bound. A module that vmap cannot run (an LSTM in float64 writes into a state it creates itself)
is differentiated one example at a time instead: the same vector-Jacobian products, in a loop.
"""

from __future__ import annotations

import logging
import warnings
import weakref
from typing import Any, Callable

import torch
from torch import nn
from torch.func import functional_call, grad, vjp, vmap
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

_log = logging.getLogger("dpopt")
_LOOPED: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # modules vmap could not run: looped over examples


def batch_dims(tree: Any, batch_size: int) -> Any:
    """in_dims for vmap: 0 for tensors whose leading dimension is the batch, None otherwise."""
    return tree_map(lambda t: 0 if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == batch_size
                    else None, tree)


def _unsqueeze(tree: Any, dims: Any) -> Any:
    """Give each per-example slice back its batch dimension of size 1."""
    leaves, spec = tree_flatten(tree)
    dim_leaves, _ = tree_flatten(dims)
    return tree_unflatten([x.unsqueeze(0) if d == 0 else x for x, d in zip(leaves, dim_leaves)], spec)


def float_leaves(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]


def module_gradients(module: nn.Module, params: dict[str, torch.Tensor], args: tuple, kwargs: dict,
                     cotangents: dict[int, torch.Tensor], batch_size: int,
                     fixed: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Per-example vector-Jacobian products of ``module``'s floating outputs with ``cotangents`` (by the
    output's position among them; the others do not reach the loss), with respect to ``params`` (every
    place a parameter is registered, names relative to ``module``): {name: [B, *shape]}. ``fixed``: the
    values of its other parameters, held constant."""
    dims = batch_dims((args, kwargs), batch_size)
    fixed = fixed or {}

    def one(p: dict[str, torch.Tensor], inputs: tuple, cot: dict[int, torch.Tensor]) -> dict[str, torch.Tensor]:
        a, kw = _unsqueeze(inputs, dims)

        def outputs(q: dict[str, torch.Tensor]) -> list[torch.Tensor]:
            leaves = float_leaves(functional_call(module, {**fixed, **q}, a, kw, tie_weights=False))
            return [leaves[k] for k in cot]

        _, pullback = vjp(outputs, p)
        return pullback([c.unsqueeze(0) for c in cot.values()])[0]

    failure = None
    if module not in _LOOPED:
        try:
            with warnings.catch_warnings():  # operations without a batching rule run in vmap's loop: the same values
                warnings.filterwarnings("ignore", "There is a performance drop because we have not yet implemented")
                return vmap(one, in_dims=(None, dims, 0), randomness="different")(params, (args, kwargs), cotangents)
        except RuntimeError as e:  # retried one example at a time, which raises if the module itself fails
            failure = e
    rows = [one(params, _example((args, kwargs), dims, k), {i: c[k] for i, c in cotangents.items()})
            for k in range(batch_size)]
    if failure is not None:
        _LOOPED.add(module)
        _log.info("torch.func cannot vectorise %s over examples (%s); its per-example gradients are taken one "
                  "example at a time from now on: one forward and backward of it per example",
                  type(module).__name__, str(failure).splitlines()[0])
    return {n: torch.stack([r[n] for r in rows]) for n in params}


def _example(tree: Any, dims: Any, k: int) -> Any:
    """Example ``k`` of the leaves whose dimension 0 is the batch (what vmap hands ``one``)."""
    leaves, spec = tree_flatten(tree)
    dim_leaves, _ = tree_flatten(dims)
    return tree_unflatten([x[k] if d == 0 else x for x, d in zip(leaves, dim_leaves)], spec)


def loss_gradients(loss_of: Callable[[dict[str, torch.Tensor], Any], torch.Tensor],
                   params: dict[str, torch.Tensor], batch: Any, batch_size: int) -> dict[str, torch.Tensor]:
    """Per-example gradients of a per-example loss ``loss_of(params, batch) -> [B]`` by vmap of grad."""
    dims = batch_dims(batch, batch_size)

    def one(p: dict[str, torch.Tensor], example: Any) -> torch.Tensor:
        return loss_of(p, _unsqueeze(example, dims)).sum()

    return vmap(grad(one), in_dims=(None, dims), randomness="different")(params, batch)
