"""What the clients optimise: local stochastic gradients ∇f_i(x, ξ_i) of many clients at once.

The federated core works on flat vectors (x, v_i, g_i, c_i ∈ R^d); ``FlatLayout`` maps them to a model's
parameter tensors and back. ``ModelOracle`` evaluates k clients' mini-batch gradients at the broadcast
point in one ``torch.func.vmap`` call over clients (the parameters are shared, each client's batch is a
slice of a [k, b, ...] stack with per-example weights, so unequal or padded batches cost nothing extra).
Mini-batches are drawn without replacement from each client's own secret stream, indexed by round, so a
client computes the same gradient in the in-process simulator and in a Flower ClientApp.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from dpopt.federated.privacy import client_stream


class GradientOracle(Protocol):
    def __call__(self, x: torch.Tensor, clients: Sequence[int], round: int) -> torch.Tensor:
        """Stochastic gradients [k, d] of the listed clients' objectives at the flat point ``x``."""


@dataclass(frozen=True)
class FlatLayout:
    """The trainable parameters of a model as one flat vector (in ``named_parameters`` order)."""

    names: tuple[str, ...]
    shapes: tuple[torch.Size, ...]

    @classmethod
    def of(cls, model: nn.Module) -> "FlatLayout":
        named = [(n, p.shape) for n, p in model.named_parameters() if p.requires_grad]
        return cls(tuple(n for n, _ in named), tuple(s for _, s in named))

    @property
    def sizes(self) -> list[int]:
        return [s.numel() for s in self.shapes]

    def flatten(self, model: nn.Module) -> torch.Tensor:
        params = dict(model.named_parameters())
        return torch.cat([params[n].detach().reshape(-1) for n in self.names])

    def unflatten(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        return {n: p.view(s) for n, s, p in zip(self.names, self.shapes, flat.split(self.sizes))}

    def flatten_rows(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """[k, *shape] per parameter -> [k, d]."""
        return torch.cat([tensors[n].reshape(tensors[n].shape[0], -1) for n in self.names], 1)


ExampleLoss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class ModelOracle:
    """f_i(x) = mean over client i's examples of ``example_loss(model(inputs), targets)`` (+ ``regulariser``).

    ``batch_size=None`` uses each client's whole local data (the exact local gradient); ``gradient_noise``
    adds N(0, s² I) per coordinate to every gradient (the paper's Gaussian-added stochastic oracle, §6.1).
    """

    def __init__(self, model: nn.Module, example_loss: ExampleLoss, inputs: torch.Tensor, targets: torch.Tensor,
                 parts: Sequence[torch.Tensor], batch_size: int | None, key: int | bytes | None,
                 regulariser: Callable[[dict[str, torch.Tensor]], torch.Tensor] | None = None,
                 gradient_noise: float = 0.0, examples_per_call: int = 8192) -> None:
        if batch_size is not None and batch_size < 1:
            raise ValueError(f"the per-client batch size must be an integer >= 1 (or None for all local data), "
                             f"got {batch_size}")
        self.model, self.layout = model, FlatLayout.of(model)
        self.inputs, self.targets, self.parts = inputs, targets, [torch.as_tensor(p) for p in parts]
        self.batch_size, self.gradient_noise = batch_size, float(gradient_noise)
        self.examples_per_call = examples_per_call
        self.batch_streams = [client_stream(key, i, "batch") for i in range(len(parts))]
        self.noise_streams = [client_stream(key, i, "gradient-noise") for i in range(len(parts))]
        buffers = dict(model.named_buffers())

        def client_loss(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor,
                        w: torch.Tensor) -> torch.Tensor:
            loss = (w * example_loss(functional_call(model, {**params, **buffers}, (x,)), y)).sum()
            return loss + regulariser(params) if regulariser is not None else loss

        self._grads = vmap(grad(client_loss), in_dims=(None, 0, 0, 0))

    def batch(self, client: int, round: int) -> torch.Tensor:
        """Indices (into the training set) of the client's mini-batch in this round."""
        part = self.parts[client]
        if self.batch_size is None or self.batch_size >= len(part):
            return part
        order = self.batch_streams[client].uniform(len(part), round).argsort()
        return part[order[:self.batch_size]]

    def __call__(self, x: torch.Tensor, clients: Sequence[int], round: int) -> torch.Tensor:
        if not clients:
            return x.new_zeros(0, x.numel())
        batches = [self.batch(i, round) for i in clients]
        width = max(len(b) for b in batches)
        params = self.layout.unflatten(x)
        rows = []
        per_call = max(1, self.examples_per_call // width)
        for start in range(0, len(batches), per_call):
            chunk = batches[start:start + per_call]
            index = torch.stack([torch.cat([b, b.new_zeros(width - len(b))]) for b in chunk])
            weight = torch.stack([torch.cat([torch.full((len(b),), 1.0 / len(b)), torch.zeros(width - len(b))])
                                  for b in chunk]).to(x.device)
            rows.append(self.layout.flatten_rows(self._grads(params, self.inputs[index], self.targets[index], weight)))
        grads = torch.cat(rows)
        if self.gradient_noise > 0:
            for row, i in zip(grads, clients):
                row.add_(self.noise_streams[i].normals([row.shape], round)[0], alpha=self.gradient_noise)
        return grads


@dataclass
class Problem:
    """A federated problem: the oracle, the starting point, the parameter blocks (for layer-wise
    clipping), each client's data size, an evaluation of the server model, and the model whose trainable
    parameters the flat point holds (None for problems without one, which cannot be exported)."""

    oracle: GradientOracle
    x0: torch.Tensor
    block_sizes: list[int]
    client_sizes: list[int]
    evaluate: Callable[[torch.Tensor], dict[str, float]]
    classes: int | None = None  # of a classification problem (its chance accuracy is 1 / classes)
    model: nn.Module | None = None

    @property
    def clients(self) -> int:
        return len(self.client_sizes)
