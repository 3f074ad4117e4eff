"""Stage 1 (sample): who is in each step's batch, and what that lets the accountant assume.

Every sampler states its ``participation``; the ledger accounts exactly that and nothing more. Only the
Poisson sampler claims amplification by subsampling. Samplers are counter-based (the batch of step t is a
function of the secret key and t), so a resumed run draws the same batches.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Protocol

import torch
from torch.utils._pytree import tree_flatten, tree_map

from dpopt.noise.rng import SecretStream
from dpopt.privacy.ledger import (CyclicPoissonSampling, FixedOrderParticipation, FixedParticipation, Participation,
                                  PoissonSampling)


class Sampler(Protocol):
    participation: Participation
    dataset_size: int

    @property
    def normalizer(self) -> float: ...

    @property
    def steps_per_epoch(self) -> int: ...

    def batch(self, step: int) -> torch.Tensor: ...


def take(data: Any, index: torch.Tensor) -> Any:
    """The batch of ``data`` at ``index``: ``data(index)`` if callable, else every tensor indexed on dim 0."""
    if callable(data):
        return data(index)
    return tree_map(lambda t: t[index] if isinstance(t, torch.Tensor) else t, data)


def distinct_examples(data: Any, dataset_size: int, count: int = 3, scan: int = 4096) -> Any:
    """The first ``count`` pairwise-distinct examples of ``data`` (as ``take`` reads them; distinct as tensors)
    among its first ``scan``, as one batch: what the engine's attribution check runs on. Refused when there
    are fewer."""
    chosen: list[int] = []
    kept: list[list[torch.Tensor]] = []
    end = min(scan, dataset_size)
    for start in range(0, end, 256):
        index = torch.arange(start, min(start + 256, end))
        leaves = [t for t in tree_flatten(take(data, index))[0]
                  if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == len(index)]
        for k in range(len(index)):
            example = [t[k] for t in leaves]
            if all(not all(torch.equal(a, b) for a, b in zip(example, other)) for other in kept):
                chosen.append(start + k)
                kept.append(example)
                if len(chosen) == count:
                    return take(data, torch.tensor(chosen))
    raise ValueError(f"the first {end} examples of the dataset hold {len(chosen)} distinct examples; the per-example "
                     f"engine is verified on {count} distinct examples before anything is released")


class PoissonSampler:
    """Each example is in each step's batch independently with probability ``rate``. Batch sizes vary,
    empty batches happen and still count; the clipped sum is divided by the *expected* batch size. This is the
    sampling that Poisson amplification (``PoissonSampling`` in the ledger) assumes.

    :param dataset_size: the number of examples (>= 1).
    :param rate: each example's probability of being in a step's batch, in (0, 1].
    :param stream: the secret stream the draws come from (``SecretStream(key, "sampling")``).
    :raises ValueError: for an empty dataset or a rate outside (0, 1].
    """

    def __init__(self, dataset_size: int, rate: float, stream: SecretStream) -> None:
        if dataset_size < 1:
            raise ValueError("the dataset is empty")
        self.dataset_size, self.stream = dataset_size, stream
        self.participation: Participation = PoissonSampling(rate)
        self.rate = rate

    @classmethod
    def with_batch_size(cls, dataset_size: int, batch_size: int, stream: SecretStream) -> "PoissonSampler":
        """The sampler whose expected batch is ``batch_size``: rate ``batch_size / dataset_size``.

        :param dataset_size: the number of examples.
        :param batch_size: the expected batch, in [1, dataset_size].
        :param stream: the secret stream of the draws.
        :returns: the sampler.
        :raises ValueError: for a batch size outside [1, dataset_size].
        """
        if not 1 <= batch_size <= dataset_size:
            raise ValueError(f"batch size must lie in [1, {dataset_size}] (the dataset size), got {batch_size}")
        return cls(dataset_size, batch_size / dataset_size, stream)

    @property
    def normalizer(self) -> float:
        """The expected batch size, which the noisy sum is divided by."""
        return self.rate * self.dataset_size

    @property
    def steps_per_epoch(self) -> int:
        """The steps of one epoch: ``round(1 / rate)`` (at least 1)."""
        return max(1, round(1 / self.rate))

    def batch(self, step: int) -> torch.Tensor:
        """The indices of step ``step``'s batch (secret: drawn from the stream at that step).

        :param step: the step's number, from 0.
        :returns: the sorted indices of the examples in the batch (possibly none).
        """
        return (self.stream.uniform(self.dataset_size, step) < self.rate).nonzero().squeeze(1)


class CyclicPoissonSampler(PoissonSampler):
    """Poisson sampling within ``period`` groups by position: step t samples only the examples at positions
    j = t mod period, j + period, ..., each independently with probability rate = period · batch_size / n,
    so a step's expected batch is batch_size (``CyclicPoissonSampling``). Amplified like Poisson sampling, and
    an example joins at most one of every ``period`` steps, as banded noise with at most ``period`` bands
    needs (Choquette-Choo et al. 2023, Sec. 4)."""

    def __init__(self, dataset_size: int, batch_size: int, period: int, stream: SecretStream) -> None:
        if period < 1:
            raise ValueError(f"cyclic sampling period must be >= 1 step, got {period}")
        if not 1 <= batch_size * period <= dataset_size:
            raise ValueError(f"cyclic Poisson sampling over {period} groups samples batches of {batch_size} from "
                             f"{dataset_size // period} examples or fewer: batch size times the period must lie in "
                             f"[1, {dataset_size}] (the dataset size), got {batch_size} x {period}")
        super().__init__(dataset_size, batch_size * period / dataset_size, stream)
        self.period = period
        self.participation = CyclicPoissonSampling(self.rate, period)

    @property
    def normalizer(self) -> float:
        return self.rate * self.dataset_size / self.period

    @property
    def steps_per_epoch(self) -> int:
        return max(1, round(self.period / self.rate))

    def batch(self, step: int) -> torch.Tensor:
        group = torch.arange(step % self.period, self.dataset_size, self.period)
        return group[self.stream.uniform(self.dataset_size, step)[group] < self.rate]


class ShuffleSampler:
    """Disjoint batches of ``batch_size`` from a fresh secret permutation every epoch (the last batch of an
    epoch may be smaller). Accounted without amplification: one release per example per epoch."""

    def __init__(self, dataset_size: int, batch_size: int, stream: SecretStream, shuffle: bool = True) -> None:
        if not 1 <= batch_size <= dataset_size:
            raise ValueError(f"batch size must lie in [1, {dataset_size}] (the dataset size), got {batch_size}")
        self.dataset_size, self.batch_size, self.stream, self.shuffle = dataset_size, batch_size, stream, shuffle
        self.participation: Participation = (FixedParticipation if shuffle else FixedOrderParticipation)(
            self.steps_per_epoch)

    @property
    def normalizer(self) -> float:
        return float(self.batch_size)

    @property
    def steps_per_epoch(self) -> int:
        return math.ceil(self.dataset_size / self.batch_size)

    def batch(self, step: int) -> torch.Tensor:
        epoch, k = divmod(step, self.steps_per_epoch)
        order = (self.stream.uniform(self.dataset_size, epoch).argsort() if self.shuffle
                 else torch.arange(self.dataset_size))
        return order[k * self.batch_size:(k + 1) * self.batch_size]


def FixedOrderSampler(dataset_size: int, batch_size: int, stream: SecretStream) -> ShuffleSampler:
    """Consecutive batches in dataset order, cycling over epochs: the example at position j of an epoch is in
    the steps j, j + b, j + 2b, ... (b = ``steps_per_epoch``; ``FixedOrderParticipation``), as correlated
    noise (tree, matrix factorizations) over several epochs requires; one epoch is single participation."""
    return ShuffleSampler(dataset_size, batch_size, stream, shuffle=False)


def sampler_state(sampler: Sampler, next_step: int) -> dict[str, Any]:
    """What a checkpoint records of a sampler: everything the accounting and the batches depend on, and
    the step whose batch comes next (counter-based samplers need no generator state)."""
    part = sampler.participation
    stream = getattr(sampler, "stream", None)
    return {"type": type(sampler).__name__, "dataset_size": getattr(sampler, "dataset_size", None),
            "participation": {"kind": type(part).__name__, **dataclasses.asdict(part)},
            "normalizer": float(sampler.normalizer), "steps_per_epoch": int(sampler.steps_per_epoch),
            "shuffle": getattr(sampler, "shuffle", None), "secure": None if stream is None else stream.secure,
            "next_step": int(next_step)}


SAMPLINGS = ("poisson", "cyclic", "shuffle", "fixed")


def make_sampler(kind: str, dataset_size: int, batch_size: int, stream: SecretStream, period: int = 1) -> Sampler:
    """The sampler ``kind`` (``period``: the groups of ``cyclic`` Poisson sampling)."""
    if kind == "poisson":
        return PoissonSampler.with_batch_size(dataset_size, batch_size, stream)
    if kind == "cyclic":
        return CyclicPoissonSampler(dataset_size, batch_size, period, stream)
    if kind == "shuffle":
        return ShuffleSampler(dataset_size, batch_size, stream)
    if kind == "fixed":
        return FixedOrderSampler(dataset_size, batch_size, stream)
    raise ValueError(f"unknown sampling {kind!r}; choose one of {', '.join(SAMPLINGS)}")
