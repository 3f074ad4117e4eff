"""Small models covering every layer rule, a run whose first epoch is kept for resuming, and child processes forked
from a forkserver that has imported the library once, shared by the tests."""

import contextlib
import functools
import multiprocessing
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpopt.run import TrainConfig, train


class Scaled(nn.Module):
    """A module with a direct parameter and a child it calls: handled by the generic fallback."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.randn(dim))
        self.lin = nn.Linear(dim, dim)

    def forward(self, x):
        return torch.tanh(self.lin(x) * self.scale)


class Zoo(nn.Module):
    """Embedding, Conv1d, Conv2d (reflect padding, stride, dilation, groups), LayerNorm, RMSNorm, GroupNorm,
    3-D Linear, a fallback module, and a Linear used twice."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 8, padding_idx=0)
        self.conv1d = nn.Conv1d(8, 8, 3, padding=1)
        self.conv2d = nn.Conv2d(1, 4, 4, stride=2, padding=2, padding_mode="reflect")  # patches by phase
        self.dilated = nn.Conv2d(4, 4, 3, dilation=2, padding=2, bias=False)
        self.grouped = nn.Conv2d(4, 4, 3, groups=2)
        self.gn = nn.GroupNorm(2, 4)
        self.ln = nn.LayerNorm(8)
        self.rms = nn.RMSNorm(8)
        self.odd = Scaled(8)
        self.twice = nn.Linear(8, 8)
        self.head = nn.Linear(12, 3)

    def forward(self, batch):
        tokens, image = batch
        h = self.emb(tokens)
        h = self.conv1d(h.transpose(1, 2)).transpose(1, 2)
        h = self.twice(torch.tanh(self.twice(self.rms(self.ln(h)))))
        h = self.odd(h).mean(1)
        im = self.gn(self.grouped(self.dilated(torch.tanh(self.conv2d(image))))).mean((2, 3))
        return self.head(torch.cat([h, im], 1))


def zoo_batch(b: int = 5):
    tokens = torch.randint(0, 20, (b, 6))
    tokens[0, :2] = 0  # padding rows
    return tokens, torch.randn(b, 1, 9, 9), torch.randint(0, 3, (b,))


def zoo_loss(model, batch):
    tokens, image, y = batch
    return F.cross_entropy(model((tokens, image)), y, reduction="none")


class Tokens(nn.Module):
    """An embedding, a Linear layer over the tokens (ghost-normed: its norms may cancel) and a head."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.emb, self.lin, self.head = nn.Embedding(11, width), nn.Linear(width, width), nn.Linear(width, 3)

    def forward(self, tokens):
        return self.head(torch.tanh(self.lin(self.emb(tokens))).mean(1))


def weighted_loss(model, batch):
    """s_i * cross-entropy for a batch (tokens, labels, s, ...): a per-example scale in the data (a two-point
    statistic's second point may scale it)."""
    return batch[2] * F.cross_entropy(model(batch[0]), batch[1], reduction="none")


def quiet(_: str) -> None:
    """A run's log that prints nothing."""


def mlp_loss(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y, reduction="none")


def train_keeping_epoch_one(config: TrainConfig, folder: Path, copy: Path) -> dict:
    """Run ``train`` into ``folder`` to the end, copying the run folder to ``copy`` when epoch 1 ends (its
    checkpoint, which holds the run's secret key, written): ``resume(copy)`` must then end where the run did."""

    def keep(msg: str) -> None:
        if msg.startswith("epoch 1/"):
            shutil.copytree(folder, copy)

    return train(config, folder, progress=False, log=keep)


# What a child's first run imports (a missing one is skipped): torch's compiler stack (its optimizers import it),
# the accounting (dpopt imports it on first use), the digits data, the curves' plotting, the TensorBoard writer, the
# Hugging Face Trainer (dpopt.hf); imported once by the forkserver, not per child.
FORKSERVER_PRELOAD = ["torch", "torch._dynamo", "dpopt.run", "dp_accounting", "sklearn.datasets",
                      "sklearn.model_selection", "matplotlib.figure", "matplotlib.backends.backend_agg",
                      "torch.utils.tensorboard", "dpopt.hf"]


def forkserver() -> multiprocessing.context.BaseContext:
    """Child processes forked from the forkserver, a fresh process that imports ``FORKSERVER_PRELOAD`` once and runs
    no thread (fork is safe there, even on a GPU machine), instead of a spawned interpreter importing them again for
    every child."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(FORKSERVER_PRELOAD)  # kept by the server the first call starts
    return context


@contextlib.contextmanager
def forked_launches() -> Iterator[None]:
    """Within it, ``dpopt.distributed.launch`` starts its processes from the forkserver (``forkserver``)."""
    forkserver()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.multiprocessing, "spawn",
                      functools.partial(torch.multiprocessing.start_processes, start_method="forkserver"))
        yield
