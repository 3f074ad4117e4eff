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

Noise (``SecretStream.add_normal_flat_``) is defined on the flat statistic: the concatenation of its tensors
in order, flattened, cut into chunks of ``NOISE_CHUNK`` elements, chunk j drawn from a generator keyed by
(key, label, step, j). A coordinate's noise therefore depends on the key, the step and its flat index (and the
statistic's length, which sets the last chunk's): a shard holding a coordinate range can draw exactly its part
by drawing only the chunks that overlap it, and the list form ``add_normal_`` is the same draw.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import math
import os
import secrets
from concurrent.futures import ThreadPoolExecutor

import torch

from dpopt.flat import flat_view, zeros


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
    """The root of a run's secret streams: 256 bits of OS entropy, or the replayable ``secret_seed`` if given.

    :param secret_seed: an integer that makes the run's sampling and noise replayable (tests, reproductions);
        None for a fresh key. Whoever knows the key can replay the noise: keep it private.
    :returns: the key, for ``SecretStream(key, label)``.
    """
    return secrets.token_bytes(32) if secret_seed is None else secret_seed


class SecretStream:
    """Secret randomness for one purpose (``label``), indexed by step.

    :param key: a run's ``secret_key`` (bytes: OS entropy; each step's generators are seeded through SHA-256 of
        the whole key, so recovering one step's 63-bit generator seed tells nothing about another step's), an
        integer secret seed (replayable), or None for secure mode: every draw comes from ``os.urandom`` and
        cannot be replayed.
    :param label: the stream's purpose (``"sampling"``, ``"noise"``): streams of one key with different labels
        are independent.
    """

    def __init__(self, key: int | bytes | None, label: str) -> None:
        self.secure = key is None
        self._key: int | bytes | None
        if isinstance(key, bytes):
            self._key = hashlib.sha256(b"/".join([key, b"secret", label.encode()])).digest()
        else:
            self._key = None if key is None else derive_seed(key, "secret", label)

    def generator(self, step: int, device: torch.device | str = "cpu") -> torch.Generator:
        """The generator of step ``step``'s draws, on ``device``.

        :raises RuntimeError: in secure mode (no key), which has no replayable generator.
        """
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
        """Adds ``std`` times the step's standard normal noise to ``tensors`` in place and returns them: the
        statistic is their concatenation in order (flattened), drawn as ``add_normal_flat_`` draws it: one draw
        per chunk, added to the chunk's pieces of the tensors by one operation (views of one flat buffer,
        ``dpopt.flat.zeros``, are one piece). No model-sized temporary."""
        flat = flat_view(tensors)
        if flat is not None:
            self.add_normal_flat_(flat, step, std)
            return tensors
        starts = itertools.accumulate((t.numel() for t in tensors), initial=0)
        self._add(list(zip(starts, (t.view(-1) for t in tensors))), sum(t.numel() for t in tensors), step, std)
        return tensors

    def add_normal_flat_(self, flat: torch.Tensor, step: int, std: float = 1.0, offset: int = 0,
                         total: int | None = None) -> torch.Tensor:
        """Adds ``std`` times the noise of coordinates [offset, offset + flat.numel()) of a flat statistic of
        ``total`` elements (default: offset + flat.numel()) to the 1-D tensor ``flat`` in place: exactly that
        slice of the whole statistic's draw (what a shard of the statistic needs), drawing only the chunks
        that overlap it.

        The statistic is cut into chunks of ``NOISE_CHUNK`` elements; chunk j, of min(NOISE_CHUNK, total -
        j * NOISE_CHUNK) elements, is drawn (float32) from its own generator keyed by (step, j): the values
        depend on nothing else (not on the thread count), and the chunks are drawn in parallel on CPU."""
        total = offset + flat.numel() if total is None else total
        if flat.dim() != 1 or offset < 0 or offset + flat.numel() > total:
            raise ValueError(f"a 1-D slice [{offset}, {offset + flat.numel()}) of a statistic of {total} elements "
                             f"is needed, got shape {tuple(flat.shape)}")
        self._add([(offset, flat)], total, step, std)
        return flat

    def add_normal_segments_(self, segments: list[tuple[int, torch.Tensor]], total: int, step: int,
                             std: float = 1.0) -> None:
        """Adds ``std`` times the noise of a flat statistic of ``total`` elements to pieces of it held apart: each
        (first coordinate, 1-D tensor) segment gets exactly its coordinates' part of the whole statistic's draw,
        each overlapping chunk drawn once for all the segments (a rank's shards of a sharded model).

        :raises ValueError: for a segment outside [0, total) or not 1-D."""
        for start, seg in segments:
            if seg.dim() != 1 or start < 0 or start + seg.numel() > total:
                raise ValueError(f"a 1-D segment within [0, {total}) is needed, got shape {tuple(seg.shape)} at "
                                 f"{start}")
        kept = sorted(((start, seg) for start, seg in segments if seg.numel()), key=lambda s: s[0])
        self._add(kept, total, step, std)

    def _add(self, segments: list[tuple[int, torch.Tensor]], total: int, step: int, std: float) -> None:
        """Adds the noise of each (start coordinate, 1-D tensor) segment of a statistic of ``total`` elements."""
        jobs: dict[int, list[tuple[int, torch.Tensor]]] = {}
        for start, seg in segments:
            for a in range(start - start % NOISE_CHUNK, start + seg.numel(), NOISE_CHUNK):
                lo, hi = max(a, start), min(a + NOISE_CHUNK, start + seg.numel())
                jobs.setdefault(a // NOISE_CHUNK, []).append((lo, seg[lo - start:hi - start]))

        def draw(part: list[tuple[int, list[tuple[int, torch.Tensor]]]]) -> None:
            for j, pieces in part:
                lo = pieces[0][0]
                noise = self._chunk(j, step, total, lo, pieces[-1][0] + pieces[-1][1].numel(), pieces[0][1].device)
                # one operation for the chunk's pieces; secure mode: float64 noise added in float64, rounded once
                parts = [noise[start - lo:start - lo + piece.numel()] for start, piece in pieces]
                torch._foreach_add_([piece for _, piece in pieces], parts, alpha=std)

        work = sorted(jobs.items())
        workers = min(torch.get_num_threads(), len(work))
        if workers > 1 and all(seg.device.type == "cpu" for _, seg in segments):
            list(_pool(workers).map(draw, [work[k::workers] for k in range(workers)]))
        else:
            draw(work)

    def _chunk(self, j: int, step: int, total: int, lo: int, hi: int, device: torch.device) -> torch.Tensor:
        """The noise of coordinates [lo, hi) of chunk ``j``: a slice of the chunk's keyed float32 draw, or, in
        secure mode, float64 OS-entropy normals (non_blocking: the host copy is staged, no wait for the device)."""
        if self.secure:
            return _os_normal(hi - lo).to(device, non_blocking=True)
        g = torch.Generator(device=device)
        g.manual_seed(derive_seed(self._key, step, j))
        a = j * NOISE_CHUNK
        noise = torch.randn(min(NOISE_CHUNK, total - a), generator=g, device=device, dtype=torch.float32)
        return noise[lo - a:hi - a]

    def normals(self, shapes: list[torch.Size], step: int, device: torch.device | str = "cpu",
                dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
        """Standard normal tensors of the given shapes (views of one flat buffer): exactly what ``add_normal_``
        adds at this step."""
        return self.add_normal_(zeros(shapes, dtype, device), step)


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
