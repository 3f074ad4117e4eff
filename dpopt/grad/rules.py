"""Per-layer rules: a layer's per-example gradients from its input and its output gradient.

Each rule maps (module, input x, output gradient g, the parameter names wanted) to one ``Capture`` per
parameter. The batch is dimension 0 of x and g. A rule applies only to modules whose ``forward`` is the
stock one (a subclass that overrides ``forward`` goes to the generic fallback), so the input the hook sees
is the input the layer formula assumes.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from dpopt.grad.captures import Capture, ConvOuter, Dense, Outer

Rule = Callable[[nn.Module, torch.Tensor, torch.Tensor, set[str]], dict[str, Capture]]


def _sum(t: torch.Tensor, dims: int | tuple[int, ...]) -> torch.Tensor:
    """``t`` summed over ``dims``, accumulated and kept in float32 for a low-precision ``t``: the norms and sums
    of the result need no cast of it. Over dimensions of size 1 in float32 or float64 it is a view of ``t`` (a
    Linear layer's bias on one step per example: its output gradient), which launches nothing."""
    low = t.dtype in (torch.float16, torch.bfloat16)
    if not low and all(t.shape[d] == 1 for d in ((dims,) if isinstance(dims, int) else dims)):
        return t.squeeze(dims)
    return t.sum(dims, dtype=torch.float32 if low else None)


def _linear(module: nn.Linear, x: torch.Tensor, g: torch.Tensor, wanted: set[str]) -> dict[str, Capture]:
    b = x.shape[0]
    gy = g.reshape(b, -1, module.out_features)
    out: dict[str, Capture] = {}
    if "weight" in wanted:
        out["weight"] = Outer(gy, x.reshape(b, -1, module.in_features), module.out_features, module.weight.shape)
    if "bias" in wanted:
        out["bias"] = Dense(_sum(gy, 1), (module.out_features,))
    return out


def _transposed_linear(module: nn.Module, x: torch.Tensor, g: torch.Tensor, wanted: set[str]) -> dict[str, Capture]:
    """GPT-2's ``transformers.pytorch_utils.Conv1D``: y = x W + b with W of shape [in, out], a Linear whose
    weight is stored transposed, so its per-example gradient is sum_t x_t (x) g_t."""
    b, (fan_in, fan_out) = x.shape[0], module.weight.shape
    gy = g.reshape(b, -1, fan_out)
    out: dict[str, Capture] = {}
    if "weight" in wanted:
        out["weight"] = Outer(x.reshape(b, -1, fan_in), gy, fan_in, module.weight.shape)
    if "bias" in wanted:
        out["bias"] = Dense(_sum(gy, 1), (fan_out,))
    return out


def _conv(module: nn.Conv1d | nn.Conv2d, x: torch.Tensor, g: torch.Tensor, wanted: set[str]) -> dict[str, Capture]:
    b, c_out = g.shape[:2]
    kernel, stride, dilation = module.kernel_size, module.stride, module.dilation
    if module.padding_mode == "zeros" and not isinstance(module.padding, str):
        padding = module.padding
    else:  # padding modes, or "same" (possibly asymmetric): pad explicitly
        mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
        x, padding = F.pad(x, module._reversed_padding_repeated_twice, mode=mode), (0,) * len(kernel)
    if x.dim() == 3:  # Conv1d as a Conv2d of height 1
        x, g = x.unsqueeze(2), g.unsqueeze(2)
        kernel, stride, dilation, padding = (1, *kernel), (1, *stride), (1, *dilation), (0, *padding)
    out: dict[str, Capture] = {}
    if "weight" in wanted:
        cap = ConvOuter(x, g, kernel, stride, dilation, padding, module.groups, module.weight.shape)
        # with groups the gradient is block-diagonal, which the factored (ghost) form does not express: held in
        # the layer's precision, its one source for norms and sums
        out["weight"] = cap if module.groups == 1 else Dense(cap.materialize().to(g.dtype), module.weight.shape)
    if "bias" in wanted:
        out["bias"] = Dense(_sum(g.reshape(b, c_out, -1), -1), (c_out,))
    return out


def _embedding(module: nn.Embedding, x: torch.Tensor, g: torch.Tensor, wanted: set[str]) -> dict[str, Capture]:
    b = x.shape[0]
    rows = x.reshape(b, -1)
    right = g.reshape(b, rows.shape[1], module.embedding_dim)
    if module.padding_idx is not None:  # F.embedding never updates the padding row
        right = right.masked_fill((rows == module.padding_idx).unsqueeze(-1), 0)
    return {"weight": Outer(rows, right, module.num_embeddings, module.weight.shape)} if "weight" in wanted else {}


def _affine(g: torch.Tensor, xhat: torch.Tensor, param_dims: int, shape: torch.Size,
            wanted: set[str], channel_dim: int | None = None) -> dict[str, Capture]:
    """Per-example gradients of an elementwise affine y = xhat * weight + bias."""
    if channel_dim is None:  # parameters cover the trailing ``param_dims`` dimensions
        reduce = tuple(range(1, g.dim() - param_dims))
    else:  # parameters index the channel dimension only
        reduce = tuple(d for d in range(1, g.dim()) if d != channel_dim)
    out: dict[str, Capture] = {}
    if "weight" in wanted:
        out["weight"] = Dense(_sum(g * xhat, reduce) if reduce else g * xhat, shape)
    if "bias" in wanted:
        out["bias"] = Dense(_sum(g, reduce) if reduce else g, shape)
    return out


def _layer_norm(module: nn.LayerNorm, x: torch.Tensor, g: torch.Tensor, wanted: set[str]) -> dict[str, Capture]:
    xhat = F.layer_norm(x, module.normalized_shape, eps=module.eps)
    return _affine(g, xhat, len(module.normalized_shape), torch.Size(module.normalized_shape), wanted)


def _rms_norm(module: nn.RMSNorm, x: torch.Tensor, g: torch.Tensor, wanted: set[str]) -> dict[str, Capture]:
    xhat = F.rms_norm(x, module.normalized_shape, eps=module.eps)
    return _affine(g, xhat, len(module.normalized_shape), torch.Size(module.normalized_shape), wanted)


def _group_norm(module: nn.GroupNorm, x: torch.Tensor, g: torch.Tensor, wanted: set[str]) -> dict[str, Capture]:
    xhat = F.group_norm(x, module.num_groups, eps=module.eps)
    return _affine(g, xhat, 1, torch.Size((module.num_channels,)), wanted, channel_dim=1)


RULES: dict[type[nn.Module], Rule] = {
    nn.Linear: _linear,
    nn.Conv1d: _conv,
    nn.Conv2d: _conv,
    nn.Embedding: _embedding,
    nn.LayerNorm: _layer_norm,
    nn.RMSNorm: _rms_norm,
    nn.GroupNorm: _group_norm,
}


# Layers of optional libraries, by qualified class name: looked up without importing the library.
RULES_BY_NAME: dict[str, Rule] = {"transformers.pytorch_utils.Conv1D": _transposed_linear}

# Rules that treat every leading dimension after the batch as tokens: a layer fed [B*k, ...] rows can be
# regrouped as [B, k, ...] for them.
TOKENWISE: set[Rule] = {_linear, _embedding, _layer_norm, _rms_norm, _transposed_linear}

# Rules registered by users (``register_rule``): a layer of theirs that fails the attribution check is refused,
# naming it, rather than taken with torch.func (``routing.py``), so that a wrong rule is fixed, not bypassed.
REGISTERED: set[Rule] = set()


def register_rule(layer: type[nn.Module], tokenwise: bool = False) -> Callable[[Rule], Rule]:
    """Decorator: ``rule(module, x, g, wanted) -> {parameter name: Capture}`` computes the per-example
    gradients of the parameters of ``layer`` named in ``wanted`` from its input ``x`` and output gradient ``g``
    (batch first; ``Outer`` for sums of outer products, ``Dense`` for per-example tensors). It applies to modules
    whose class is ``layer`` or a subclass that keeps its ``forward``; every model is still verified against
    single-example backward passes before its first release, so a wrong rule is refused, not trusted.
    ``tokenwise``: the rule accepts [B, k, ...] inputs, so a layer fed B*k flattened rows can be regrouped."""

    def register(rule: Rule) -> Rule:
        RULES[layer] = rule
        REGISTERED.add(rule)
        if tokenwise:
            TOKENWISE.add(rule)
        return rule

    return register


def rule_for(module: nn.Module) -> Rule | None:
    """The layer rule for ``module``, or None when the generic fallback must handle it."""
    name = f"{type(module).__module__}.{type(module).__qualname__}"
    if name in RULES_BY_NAME:
        return RULES_BY_NAME[name]
    for base, rule in RULES.items():
        if isinstance(module, base) and type(module).forward is base.forward:
            if isinstance(module, nn.Embedding) and (module.sparse or module.scale_grad_by_freq):
                return None  # sparse gradients / batch-frequency scaling: leave to the generic path
            return rule
    return None
