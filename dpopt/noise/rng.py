"""Public and secret randomness are different streams (DESIGN principle 3).

* Public randomness (model initialisation, projection matrices, zeroth-order directions) may be
  published: it comes from ``public_generator(seed, *labels)``.
* Secret randomness (privacy noise, Poisson sampling, batch shuffles) comes from a ``SecretStream``. In
  reproducible mode it is derived from the run's seed through SHA-256 under a "secret" label, so no public
  seed (even a published projection seed) reveals it; in secure mode it is read from the OS entropy pool
  and nothing about it is stored. Streams are counter-based: the draw for step t depends only on (key, t),
  so a resumed run reproduces an uninterrupted one without saving generator states.
"""

from __future__ import annotations

import hashlib
import math
import os
from typing import Iterator

import torch


def derive_seed(seed: int, *labels: object) -> int:
    """A 63-bit seed that depends on ``seed`` and the labels and on nothing else."""
    text = "/".join([str(int(seed)), *map(str, labels)]).encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "little") >> 1


def public_generator(seed: int, *labels: object, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator for public randomness (init, projections, directions); safe to regenerate anywhere."""
    g = torch.Generator(device=device)
    g.manual_seed(derive_seed(seed, "public", *labels))
    return g


class SecretStream:
    """Secret randomness for one purpose (``label``), indexed by step.

    ``seed=None`` selects secure mode: every draw comes from ``os.urandom`` and cannot be replayed.
    """

    def __init__(self, seed: int | None, label: str) -> None:
        self.secure = seed is None
        self._key = None if seed is None else derive_seed(seed, "secret", label)

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

    def iter_normals(self, shapes: list[torch.Size], step: int, device: torch.device | str = "cpu",
                     dtype: torch.dtype = torch.float32) -> Iterator[torch.Tensor]:
        """Standard normal tensors of the given shapes, all for one step, drawn in a fixed order, one at a
        time (so a caller that consumes each before the next holds one model-sized draw at most)."""
        g = None if self.secure else self.generator(step, device)
        for s in shapes:
            if g is None:
                yield _os_normal(math.prod(s)).view(s).to(device=device, dtype=dtype)
            else:
                yield torch.randn(s, generator=g, device=device, dtype=dtype)

    def normals(self, shapes: list[torch.Size], step: int, device: torch.device | str = "cpu",
                dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
        return list(self.iter_normals(shapes, step, device, dtype))


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
