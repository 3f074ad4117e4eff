"""Public and secret randomness are different streams (DESIGN principle 3).

* Public randomness (model initialisation, projection matrices, zeroth-order directions) may be
  published: it comes from ``public_generator(seed, *labels)``.
* Secret randomness (privacy noise, Poisson sampling, batch shuffles) comes from a ``SecretStream``, keyed
  by the run's secret key (``secret_key``): by default 256 bits of OS entropy drawn once per run and kept
  only in the run's checkpoint; with an explicit secret seed (for reproductions and tests) the key is that
  seed and the noise is replayable by anyone who knows it. The public seed never enters a secret stream. In
  secure mode (no key) every draw is read from the OS entropy pool and nothing about it is stored. Streams
  are counter-based: the draw for step t depends only on (key, label, t), so a resumed run reproduces an
  uninterrupted one without saving generator states.
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
import secrets
from concurrent.futures import ThreadPoolExecutor

import torch


def derive_seed(seed: int | bytes, *labels: object) -> int:
    """A 63-bit seed that depends on ``seed`` (an integer or a key) and the labels and on nothing else."""
    text = "/".join([seed.hex() if isinstance(seed, bytes) else str(int(seed)), *map(str, labels)]).encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "little") >> 1


def public_generator(seed: int, *labels: object, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator for public randomness (init, projections, directions); safe to regenerate anywhere."""
    g = torch.Generator(device=device)
    g.manual_seed(derive_seed(seed, "public", *labels))
    return g


def secret_key(secret_seed: int | None = None) -> int | bytes:
    """The root of a run's secret streams: 256 bits of OS entropy, or the replayable ``secret_seed`` if given."""
    return secrets.token_bytes(32) if secret_seed is None else secret_seed


class SecretStream:
    """Secret randomness for one purpose (``label``), indexed by step.

    ``key``: a run's ``secret_key`` (bytes: OS entropy; each step's generators are seeded through SHA-256 of
    the whole key, so recovering one step's 63-bit generator seed tells nothing about another step's), an
    integer secret seed (replayable), or None for secure mode: every draw comes from ``os.urandom`` and
    cannot be replayed.
    """

    def __init__(self, key: int | bytes | None, label: str) -> None:
        self.secure = key is None
        self._key: int | bytes | None
        if isinstance(key, bytes):
            self._key = hashlib.sha256(b"/".join([key, b"secret", label.encode()])).digest()
        else:
            self._key = None if key is None else derive_seed(key, "secret", label)

    def generator(self, step: int, device: torch.device | str = "cpu") -> torch.Generator:
        if self.secure:
            raise RuntimeError("a secure stream has no replayable generator; use normal()/uniform()")
        g = torch.Generator(device=device)
        g.manual_seed(derive_seed(self._key, step))
        return g

    def uniform(self, n: int, step: int) -> torch.Tensor:
        """``n`` iid U[0, 1) float64 draws for this step."""
        if self.secure:
            return _os_uniform(n)
        return torch.rand(n, generator=self.generator(step), dtype=torch.float64)

    def add_normal_(self, tensors: list[torch.Tensor], step: int, std: float = 1.0) -> list[torch.Tensor]:
        """Adds ``std`` times standard normal noise to each tensor in place and returns them.

        The draw is cut into chunks of ``NOISE_CHUNK`` elements, chunk j of tensor i drawn from its own
        generator keyed by (step, i, j): the values depend on nothing else (not on the thread count), the
        chunks are drawn in parallel on CPU, and no model-sized temporary is ever allocated."""
        if self.secure:  # float64 noise added in float64, then rounded once (floating-point attacks: docs/design.md)
            for t in tensors:  # non_blocking: the host copy is staged at once; no wait for the device per tensor
                t.add_(_os_normal(t.numel()).view(t.shape).to(t.device, non_blocking=True), alpha=std)
            return tensors
        jobs = [(i, j, t.view(-1)[a:a + NOISE_CHUNK]) for i, t in enumerate(tensors)
                for j, a in enumerate(range(0, t.numel(), NOISE_CHUNK))]

        def draw(part: list[tuple[int, int, torch.Tensor]]) -> None:
            for i, j, view in part:
                g = torch.Generator(device=view.device)
                g.manual_seed(derive_seed(self._key, step, i, j))
                view.add_(torch.randn(view.shape, generator=g, device=view.device, dtype=torch.float32).to(view.dtype),
                          alpha=std)

        workers = min(torch.get_num_threads(), len(jobs))
        if workers > 1 and all(t.device.type == "cpu" for t in tensors):
            list(_pool(workers).map(draw, [jobs[k::workers] for k in range(workers)]))
        else:
            draw(jobs)
        return tensors

    def normals(self, shapes: list[torch.Size], step: int, device: torch.device | str = "cpu",
                dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
        """Standard normal tensors of the given shapes: exactly what ``add_normal_`` adds at this step."""
        return self.add_normal_([torch.zeros(s, device=device, dtype=dtype) for s in shapes], step)


# Elements per independently seeded noise chunk (part of the stream's definition: changing it changes the draws).
NOISE_CHUNK = 1 << 20


@functools.lru_cache(maxsize=4)
def _pool(workers: int) -> ThreadPoolExecutor:
    """Threads for drawing noise chunks (torch releases the GIL while it draws)."""
    return ThreadPoolExecutor(workers, thread_name_prefix="dpopt-noise")


os.register_at_fork(after_in_child=_pool.cache_clear)  # a forked child has none of the parent's threads


def _os_uniform(n: int) -> torch.Tensor:
    """U[0, 1) with 53 random bits each, from the OS CSPRNG."""
    words = torch.frombuffer(bytearray(os.urandom(8 * n)), dtype=torch.int64) if n else torch.empty(0, dtype=torch.int64)
    return ((words >> 11) & ((1 << 53) - 1)).to(torch.float64) * (2.0 ** -53)


def _os_normal(n: int) -> torch.Tensor:
    """N(0, 1) by the Box-Muller transform in float64 from OS-CSPRNG uniforms."""
    m = (n + 1) // 2
    u1 = 1.0 - _os_uniform(m)  # (0, 1]: log is finite
    u2 = _os_uniform(m)
    r = torch.sqrt(-2.0 * torch.log(u1))
    z = torch.cat([r * torch.cos(2 * math.pi * u2), r * torch.sin(2 * math.pi * u2)])
    return z[:n]
