"""Models for DP training: no BatchNorm anywhere, Tanh where the DP literature found it better.

``cnn`` is the small Tanh CNN for 28x28 images of Papernot et al. (2021), "Tempered sigmoid activations
for deep learning with differential privacy", used by Tramèr & Boneh (2021) as the end-to-end baseline.
"""

from __future__ import annotations

import math
from typing import Callable

from torch import nn


def logreg(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), num_classes))


def mlp(input_shape: tuple[int, ...], num_classes: int, hidden: int = 128) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), hidden), nn.Tanh(),
                         nn.Linear(hidden, num_classes))


def cnn(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    if tuple(input_shape) != (1, 28, 28):
        raise ValueError(f"the cnn model is built for 1x28x28 images (MNIST, Fashion-MNIST), got {input_shape}; "
                         "use --model mlp or logreg for other inputs")
    return nn.Sequential(
        nn.Conv2d(1, 16, 8, stride=2, padding=3), nn.Tanh(), nn.MaxPool2d(2, 1),
        nn.Conv2d(16, 32, 4, stride=2), nn.Tanh(), nn.MaxPool2d(2, 1),
        nn.Flatten(), nn.Linear(32 * 4 * 4, 32), nn.Tanh(), nn.Linear(32, num_classes))


MODELS: dict[str, Callable[[tuple[int, ...], int], nn.Module]] = {"logreg": logreg, "mlp": mlp, "cnn": cnn}


def build_model(name: str, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")
    return MODELS[name](input_shape, num_classes)


def replace_batchnorm(model: nn.Module, groups: int = 32) -> nn.Module:
    """Replace every BatchNorm with a GroupNorm of min(groups, channels) groups (in place)."""
    for name, child in model.named_children():
        if isinstance(child, nn.modules.batchnorm._BatchNorm):
            c = child.num_features
            setattr(model, name, nn.GroupNorm(math.gcd(groups, c), c, affine=child.affine))
        else:
            replace_batchnorm(child, groups)
    return model


class FrozenBatchNorm(nn.Module):
    """A BatchNorm turned into the fixed per-channel affine map of its running statistics."""

    def __init__(self, bn: nn.modules.batchnorm._BatchNorm) -> None:
        super().__init__()
        scale = (bn.running_var + bn.eps).rsqrt()
        if bn.affine:
            scale = scale * bn.weight.detach()
        shift = -bn.running_mean * scale + (bn.bias.detach() if bn.affine else 0.0)
        self.register_buffer("scale", scale.clone())
        self.register_buffer("shift", shift.clone())

    def forward(self, x):
        shape = (1, -1) + (1,) * (x.dim() - 2)
        return x * self.scale.view(shape) + self.shift.view(shape)


def freeze_batchnorm(model: nn.Module) -> nn.Module:
    """Replace every BatchNorm (with running statistics) by ``FrozenBatchNorm`` (in place): it then
    treats each example alone and trains nothing."""
    for name, child in model.named_children():
        if isinstance(child, nn.modules.batchnorm._BatchNorm):
            if child.running_mean is None:
                raise ValueError(f"BatchNorm {name!r} keeps no running statistics to freeze; use replace_batchnorm")
            setattr(model, name, FrozenBatchNorm(child))
        else:
            freeze_batchnorm(child)
    return model
