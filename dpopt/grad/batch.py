"""What the engine takes as a batch: a pytree of tensors whose dimension 0 is the batch, or the caller's
``Closure`` (``PrivateOptimizer.step(closure)``), and the per-example loss function it evaluates on one."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

LossFn = Callable[[nn.Module, Any], torch.Tensor]


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

