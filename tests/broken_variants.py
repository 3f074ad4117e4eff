"""The deliberately broken variants of the first-order audit (issue 9: they exist only under tests/), as
(owner, attribute, replacement) patches of the library's clipping, noise and sampler; tests/test_audit.py
applies them with monkeypatch, experiments/audit_table.py with mock.patch.object."""

import torch

from dpopt.clipping import Clipping
from dpopt.data.samplers import PoissonSampler
from dpopt.noise.gaussian import GaussianNoise
from dpopt.privacy import PoissonSampling


def no_clipping(self: Clipping, sq_norms: torch.Tensor, groups: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Every weight 1: ``Clipping._weights`` is where both ``Clipping.weights`` and the clip stage's ``Weighing``
    turn squared norms into weights."""
    return torch.ones_like(sq_norms), torch.isfinite(sq_norms.sum(1))


_sampler_init = PoissonSampler.__init__


def _undercounting_sampler(self: PoissonSampler, dataset_size: int, rate: float, stream) -> None:
    """Samples at ``rate`` but tells the ledger (and the calibration) a quarter of it."""
    _sampler_init(self, dataset_size, rate, stream)
    self.participation = PoissonSampling(rate / 4)


BROKEN = {
    "clipping-off": (Clipping, "_weights", no_clipping),
    "noise-halved": (GaussianNoise, "std", property(lambda self: self.noise_multiplier * self.sensitivity / 2)),
    "wrong-sampling-rate": (PoissonSampler, "__init__", _undercounting_sampler),
}


# Sharded training's two classic bugs (tests/test_sharded.py): each must make a sharded run differ from the
# unsharded one.
from dpopt import sharded  # noqa: E402

_release = sharded.ShardedStep._release


def _noise_on_every_rank(self: sharded.ShardedStep, grads: list[torch.Tensor]) -> None:
    """Every rank noises its whole clipped sum before the reduce-scatter adds them: W draws per coordinate (the
    same draw W times under one secret key)."""
    noise = self.privatizer.noise
    for _ in range(self.parallel.world_size - 1):
        noise.stream.add_normal_segments_(self.ownership.segments(grads), self.ownership.total, self.steps, noise.std)
    _release(self, grads)


_add = sharded._ShardSum.add_


def _averaging_reduce_scatter(self: sharded._ShardSum, whole: torch.Tensor) -> sharded._ShardSum:
    """The reduce-scatter of each parameter's clipped sum averages over the W ranks (ReduceOp.AVG): the clipped
    sum, and so the signal against the noise, divided by W."""
    return _add(self, whole / self.total.device_mesh.size())


SHARDED_BROKEN = {
    "averaging-left-on": (sharded, "summing", lambda model: None),  # FSDP2's default: its backward divided by W
    "averaging-reduce-scatter": (sharded._ShardSum, "add_", _averaging_reduce_scatter),
    "noise-on-every-rank": (sharded.ShardedStep, "_release", _noise_on_every_rank),
}
