"""The classification task ``dpopt train`` and ``dpopt federated`` train and evaluate: per-example cross-entropy
and accuracy."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dpopt.data.datasets import labels_of
from dpopt.data.samplers import take
from dpopt.device import to_device
from dpopt.distributed import DataParallel


def logits_of(model: nn.Module, batch: Any) -> torch.Tensor:
    """Class scores for a batch of (inputs, labels) or of a dict of model inputs with "labels"."""
    out = model(**{k: v for k, v in batch.items() if k != "labels"}) if isinstance(batch, dict) else model(batch[0])
    return out.logits if hasattr(out, "logits") else out


def classification_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    return F.cross_entropy(logits_of(model, batch), labels_of(batch), reduction="none")


@torch.no_grad()
def accuracy(model: nn.Module, data: Any, batch_size: int = 1024, parallel: DataParallel | None = None) -> float:
    """Accuracy on ``data``; with ``parallel``, each rank evaluates its share and the counts are summed."""
    was_training = model.training
    model.eval()
    n = len(labels_of(data))
    index = torch.arange(n)
    if parallel is not None:
        index = torch.tensor_split(index, parallel.world_size)[parallel.rank]
    correct = 0
    device = next(model.parameters()).device
    for chunk in index.split(batch_size):
        batch = to_device(take(data, chunk), device)
        correct += int((logits_of(model, batch).argmax(-1) == labels_of(batch)).sum())
    model.train(was_training)
    if parallel is not None:
        correct = int(parallel.total([correct])[0])
    return correct / n
