"""The generic path: per-example gradients with ``torch.func`` (vmap of vjp / grad).

Used for any module that has trainable parameters but no layer rule (the whole subtree below it is then
handled here, since such a module may use its children's parameters without calling them), and, in
``vmap`` mode, for the whole model. Random operations (dropout) draw independently per example
(``randomness="different"``); the recomputation inside a fallback module therefore sees fresh dropout
masks, which changes the gradient sample but never its clipping bound.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from torch.func import functional_call, grad, vjp, vmap
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten


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
                     cotangents: dict[int, torch.Tensor], batch_size: int) -> dict[str, torch.Tensor]:
    """Per-example vector-Jacobian products of ``module``'s floating outputs with ``cotangents`` (by the
    output's position among them; the others do not reach the loss), with respect to ``params`` (every
    place a parameter is registered, names relative to ``module``): {name: [B, *shape]}."""
    dims = batch_dims((args, kwargs), batch_size)

    def one(p: dict[str, torch.Tensor], inputs: tuple, cot: dict[int, torch.Tensor]) -> dict[str, torch.Tensor]:
        a, kw = _unsqueeze(inputs, dims)

        def outputs(q: dict[str, torch.Tensor]) -> list[torch.Tensor]:
            leaves = float_leaves(functional_call(module, q, a, kw, tie_weights=False))
            return [leaves[k] for k in cot]

        _, pullback = vjp(outputs, p)
        return pullback([c.unsqueeze(0) for c in cot.values()])[0]

    return vmap(one, in_dims=(None, dims, 0), randomness="different")(params, (args, kwargs), cotangents)


def loss_gradients(loss_of: Callable[[dict[str, torch.Tensor], Any], torch.Tensor],
                   params: dict[str, torch.Tensor], batch: Any, batch_size: int) -> dict[str, torch.Tensor]:
    """Per-example gradients of a per-example loss ``loss_of(params, batch) -> [B]`` by vmap of grad."""
    dims = batch_dims(batch, batch_size)

    def one(p: dict[str, torch.Tensor], example: Any) -> torch.Tensor:
        return loss_of(p, _unsqueeze(example, dims)).sum()

    return vmap(grad(one), in_dims=(None, dims), randomness="different")(params, batch)
