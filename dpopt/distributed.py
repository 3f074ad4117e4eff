"""Data-parallel private training on torch.distributed: one private step computed by W processes.

Per step (the five stages of DESIGN.md, split across the processes of a process group):

1. sample — rank 0 draws the step's *global* batch from the secret sampling stream (Poisson over the
   whole dataset, or the shuffled / fixed batch) and broadcasts its indices; rank r keeps the r-th of W
   contiguous shares (``torch.tensor_split``: sizes differ by at most one, empty shares are fine).
2-3. per-example statistic and clip — each rank on its own share, summed locally.
4. sum + noise — the clipped sums are reduced to rank 0, which adds the noise **once** to the global
   sum (the very call a single process makes, so any noise mechanism works unchanged, whatever the
   statistic's shapes) and broadcasts the noisy sum; every rank divides by the global expected batch.
5. update — every rank applies the same update to the same (bitwise) gradient: parameters, optimizer
   state and ledgers stay identical on all ranks without further communication.

Why this way. Noise added on every rank before the sum would add W draws (W times the variance, or, with
a shared seed, W times the same draw: a wrong sensitivity to noise ratio either way). Every rank adding
the same draw after an all-reduce depends on all ranks generating identical secret randomness, which
secure mode (OS entropy, per process) cannot do. Here all secret randomness — batch and noise — is drawn
on rank 0 only, and a reduce plus a broadcast move about as many bytes as one all-reduce.

Trust: the ranks are one operator's processes (like one process's memory, they see clipped sums of
each other's shares). Mutually distrusting parties are the federated setting, not this one.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from dpopt.data.samplers import Sampler
from dpopt.flat import flat_view, views


class DataParallel:
    """This process's part of a data-parallel private run, over the default process group."""

    def __init__(self) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("data-parallel training needs an initialised torch.distributed process group: start "
                             "the processes with torchrun, call torch.distributed.init_process_group, or use "
                             "`dpopt train --nproc N`")
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.sharded = False  # True: the ranks shard the model (dpopt.sharded) instead of each holding all of it
        config = dist.get_backend_config()
        self._carries = device_types(config)
        if not self._carries & {"cpu", "cuda"}:
            raise ValueError(f"the process group's backends ({config}) carry neither CPU nor CUDA tensors; "
                             "initialise it with backend 'gloo' (CPU), 'nccl' (CUDA) or 'cpu:gloo,cuda:nccl'")
        # Small messages (indices, counts) travel as CPU tensors where the group carries them.
        self._small = self._carrier(torch.device("cpu"))

    def _carrier(self, device: torch.device) -> torch.device:
        """Where a tensor on ``device`` travels: its own device if the group carries that type, else the one the
        group carries (the CPU for a gloo group, the current GPU for an NCCL group)."""
        if device.type in self._carries:
            return device
        return torch.device("cpu") if "cpu" in self._carries else torch.device("cuda", torch.cuda.current_device())

    @property
    def lead(self) -> bool:
        """Rank 0: draws the secret randomness, writes checkpoints and logs."""
        return self.rank == 0

    def share(self, sampler: Sampler, step: int) -> torch.Tensor:
        """This rank's share of step ``step``'s global batch, drawn by rank 0 from ``sampler``."""
        return torch.tensor_split(self.global_batch(sampler, step), self.world_size)[self.rank]

    def global_batch(self, sampler: Sampler, step: int) -> torch.Tensor:
        """Step ``step``'s global batch (on the CPU), drawn by rank 0 from ``sampler`` and sent to every rank."""
        index = sampler.batch(step).to(torch.int64) if self.lead else None
        size = torch.tensor([0 if index is None else index.numel()], dtype=torch.int64, device=self._small)
        dist.broadcast(size, 0)
        buf = index.to(self._small) if index is not None else torch.empty(int(size), dtype=torch.int64,
                                                                           device=self._small)
        if int(size):
            dist.broadcast(buf, 0)
        return buf.cpu()

    def sum_and_noise(self, sums: list[torch.Tensor],
                      add_noise: Callable[[list[torch.Tensor]], list[torch.Tensor]]) -> list[torch.Tensor]:
        """The global sum of every rank's ``sums`` with ``add_noise`` applied once, on rank 0; every rank
        gets the same result (one flat buffer: a reduce to rank 0, then a broadcast), as views of one flat
        buffer. Sums that are views of one flat buffer (``dpopt.flat.zeros``) are reduced in it, not copied."""
        home = sums[0].device
        comm = self._carrier(home)
        shapes = [s.shape for s in sums]
        flat = flat_view(sums)
        flat = (torch.cat([s.reshape(-1) for s in sums]) if flat is None else flat).to(comm)
        dist.reduce(flat, 0)
        parts = views(flat, shapes)
        if self.lead:
            for v, noisy in zip(parts, add_noise(parts)):
                if noisy is not v:
                    v.copy_(noisy)
        dist.broadcast(flat, 0)
        return views(flat.to(home), shapes)

    def total(self, values: Sequence[float]) -> list[float]:
        """Element-wise sum over the ranks of a few numbers (counts, losses)."""
        t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=self._small)
        dist.all_reduce(t)
        return t.tolist()

    @torch.no_grad()
    def broadcast_(self, tensors: Sequence[torch.Tensor]) -> None:
        """Overwrite ``tensors`` on every rank with rank 0's values."""
        for t in tensors:
            buf = t.detach().to(self._carrier(t.device))
            dist.broadcast(buf, 0)
            if buf is not t:
                t.copy_(buf)

    def close(self) -> None:
        """Leave the process group (at the end of a run)."""
        dist.destroy_process_group()

    def from_lead(self, compute: Callable[[], Any]) -> Any:
        """Rank 0 runs ``compute()``; every rank returns its result or raises its exception (e.g. rank 0 reads
        a checkpoint that the other machines cannot see)."""
        box: list[Any] = [None]
        if self.lead:
            try:
                box[0] = (compute(), None)
            except Exception as e:  # re-raised on every rank below
                box[0] = (None, e)
        dist.broadcast_object_list(box, 0, device=self._small)
        value, error = box[0]
        if error is not None:
            raise error
        return value


def device_types(config: str) -> set[str]:
    """The device types whose tensors a group's collectives take, from ``torch.distributed.get_backend_config()``
    ('cpu:gloo,cuda:nccl'; 'cuda:nccl' where ``init_process_group()`` with no backend found a GPU). Gloo's CUDA
    side is left out: it has no reduce for CUDA tensors."""
    pairs = (part.strip().split(":") for part in config.split(","))
    return {device for device, name in pairs if device == "cpu" or name != "gloo"}


def from_environment() -> DataParallel | None:
    """The group a launcher such as torchrun describes in the environment (RANK, WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT), initialised if needed: where there are GPUs with torch's default backend (NCCL alone), each
    process on its LOCAL_RANK's GPU (NCCL refuses two ranks on one GPU; with one GPU visible per process, that
    one); elsewhere with gloo (torch's default on a Mac, 'mps:gloo', carries no CPU tensors). None when
    WORLD_SIZE is unset or 1."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    gpus = torch.cuda.is_available()
    if gpus and "LOCAL_RANK" in os.environ:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
    if not dist.is_initialized():
        dist.init_process_group(None if gpus else "gloo")
    return DataParallel()


def launch(nproc: int, work: Callable[..., Any], *args: Any) -> None:
    """Run ``work(DataParallel(), *args)`` in ``nproc`` local processes joined by a gloo group (rendezvous
    through a temporary file, so no port is needed), each with its share of this machine's CPU threads."""
    if nproc < 1:
        raise ValueError(f"the number of processes must be >= 1, got {nproc}")
    with tempfile.TemporaryDirectory(prefix="dpopt-rendezvous-") as folder:
        torch.multiprocessing.spawn(_worker, args=(nproc, Path(folder) / "store", work, args), nprocs=nproc)


def _worker(rank: int, world_size: int, store: Path, work: Callable[..., Any], args: tuple[Any, ...]) -> None:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    torch.set_num_threads(max(1, cores // world_size))
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    parallel = DataParallel()
    try:
        work(parallel, *args)
        dist.barrier()  # no rank leaves the group while another still uses it
    finally:
        parallel.close()
    # A finished worker skips interpreter teardown: gloo's threads can abort the process there (SIGABRT,
    # "terminate called without an active exception", seen once in CI).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
