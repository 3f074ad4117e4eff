"""Stage 4 (sum + noise) with noise correlated across steps: binary-tree aggregation and matrix
factorizations, behind the interface of ``GaussianNoise`` (``sensitivity``, ``release(participation)``,
``__call__(sums, step)``), so the Privatizer and every recipe use them unchanged.

Gradient-space form (spec ``dp_srgd.md`` §2.2, Alg. 2 line 4): step t's clipped sum receives std · n_t,
where n = N·ζ for iid standard normal draws ζ from the secret stream. Prefix sums of the noisy steps are
then the mechanism's estimates of the prefix sums of the clipped sums. ``std`` = z · clip · sens, where sens
is the sensitivity of the factorization under the run's participation, so the whole run is one Gaussian
mechanism with noise multiplier z (``CorrelatedRelease``).

* ``TreeNoise``: binary-tree continual counting (Lemma 4.3, L176-L186), streaming with O(d log T) memory.
  ``decoder="sum"`` adds the <= log T nodes of a prefix's dyadic decomposition (the paper's estimator; only
  the nodes with odd j exist); ``"least-squares"`` keeps every node and estimates each completed node by
  combining it with its children's estimates (Honaker 2015), the lowest-variance unbiased causal decoder.
* ``MatrixNoise``: n = C⁻¹Z for a lower-triangular C by forward substitution; with p bands it keeps p-1
  past rows, O(p d) memory (dense C: p = T).

Draws are counter-based (``SecretStream``: the draw for key k depends on the seed and k only), so a resumed
run regenerates the state by replaying its keys; a secure-mode (OS entropy) stream cannot be replayed and
its state is saved in the checkpoint instead (``state_dict``).
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from dpopt.noise import factorizations as fz
from dpopt.noise.rng import SecretStream
from dpopt.privacy.correlated import CorrelatedRelease, amplified, check_correlated_participation, whole_run
from dpopt.privacy.ledger import GaussianRelease, Participation

Shapes = list[torch.Size]


class CorrelatedNoise:
    """Base of the correlated mechanisms. ``profile[s]`` is the (unnormalised) factorization's sensitivity
    over the first s+1 steps; its last entry scales the noise."""

    bands: int | None = None  # rows of C an example's step reaches (None: unbounded, as the tree's)

    def __init__(self, noise_multiplier: float, sensitivity: float, stream: SecretStream, horizon: int,
                 period: int, factorization: str, profile: torch.Tensor) -> None:
        if noise_multiplier < 0:
            raise ValueError(f"noise multiplier must be >= 0, got {noise_multiplier}")
        if horizon < 1 or period < 1:
            raise ValueError(f"horizon and period must be >= 1 step, got {horizon} and {period}")
        self.noise_multiplier = float(noise_multiplier)
        self.sensitivity = float(sensitivity)
        self.stream, self.horizon, self.period, self.factorization = stream, horizon, period, factorization
        self.scale = float(profile[-1])
        self.prefix = (profile / profile[-1]).tolist()
        self._reset()

    @property
    def std(self) -> float:
        """Std of each draw: z times the clip bound times the factorization's sensitivity."""
        return self.noise_multiplier * self.sensitivity * self.scale

    # --- accounting -------------------------------------------------------------------------------------------
    def release(self, participation: Participation) -> CorrelatedRelease | GaussianRelease:
        """What the last noised step releases, for the ledger (refuses a participation it does not cover):
        under cyclic Poisson sampling, one amplified Gaussian release (``privacy.correlated.amplified``)."""
        if amplified(participation, self.horizon, self.period, self.bands):
            return GaussianRelease(self.noise_multiplier, participation)
        check_correlated_participation(participation, self.horizon, self.period)
        step = 0 if self._last is None else self._last
        return CorrelatedRelease(self.noise_multiplier, self.factorization, self.horizon, self.period,
                                 participation, min(1.0, self.prefix[step]), step, 1)

    def whole_run(self, noise_multiplier: float, participation: Participation) -> CorrelatedRelease | GaussianRelease:
        """The complete run's release at another multiplier: what calibration targets."""
        if amplified(participation, self.horizon, self.period, self.bands):
            return GaussianRelease(noise_multiplier, participation, self.horizon)
        check_correlated_participation(participation, self.horizon, self.period)
        return whole_run(noise_multiplier, self.factorization, self.horizon, self.period, participation)

    def calibrated(self, noise_multiplier: float) -> "CorrelatedNoise":
        """The same mechanism (sharing its factorization) at another noise multiplier, from step 0."""
        if noise_multiplier < 0:
            raise ValueError(f"noise multiplier must be >= 0, got {noise_multiplier}")
        other = copy.copy(self)
        other.noise_multiplier = float(noise_multiplier)
        other._reset()
        return other

    # --- noise ------------------------------------------------------------------------------------------------
    def __call__(self, sums: list[torch.Tensor], step: int) -> list[torch.Tensor]:
        """Adds step ``step``'s noise to ``sums`` in place. Steps are streamed in order; any other step is
        reached by replaying the counter-based draws from step 0."""
        if not 0 <= step < self.horizon:
            raise ValueError(f"step {step} is outside the horizon of {self.horizon} steps this correlated noise "
                             "was built for; build it for the run's full length")
        if self.std > 0.0 and sums:
            shapes, device = [s.shape for s in sums], sums[0].device
            if step != self._next:
                self._replay(step, shapes, device)
            for s, n in zip(sums, self._advance(step, shapes, device)):
                s.add_(n.to(s.dtype), alpha=self.std)
            self._next = step + 1
        self._last = step
        return sums

    def unit_noise(self, step: int, shapes: Shapes, device: torch.device | str = "cpu") -> list[torch.Tensor]:
        """n_step at unit std (the noise operator, for tests); advances the stream like ``__call__``."""
        if step != self._next:
            self._replay(step, shapes, device)
        out = self._advance(step, shapes, device)
        self._next = step + 1
        return out

    def _replay(self, step: int, shapes: Shapes, device: torch.device | str) -> None:
        if self.stream.secure:
            raise RuntimeError("correlated noise from a secure (OS-entropy) stream cannot be replayed; resume "
                               "it from the state saved in its checkpoint (state_dict)")
        self._reset()
        for t in range(step):
            self._advance(t, shapes, device)

    def _reset(self) -> None:
        self._next, self._last = 0, None
        self._state: Any = None

    def _advance(self, step: int, shapes: Shapes, device: torch.device | str) -> list[torch.Tensor]:
        """Unit-std noise of ``step`` (the step after the last one), updating the streaming state."""
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """Empty when the stream is replayable (the state is regenerated); the secret state otherwise."""
        return {} if not self.stream.secure else {"next": self._next, "last": self._last, "state": self._state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._reset()
        if state:
            self._next, self._last, self._state = state["next"], state["last"], state["state"]


class TreeNoise(CorrelatedNoise):
    """Binary-tree aggregation (see the module docstring). Node draws are keyed by (end step, level)."""

    DECODERS = ("sum", "least-squares")

    def __init__(self, noise_multiplier: float, sensitivity: float, stream: SecretStream, horizon: int,
                 period: int, decoder: str = "sum") -> None:
        if decoder not in self.DECODERS:
            raise ValueError(f"unknown tree decoder {decoder!r}; choose one of {', '.join(self.DECODERS)}")
        self.decoder = decoder
        full = decoder == "least-squares"
        profile = fz.tree_prefix_sensitivities(horizon, period, full)
        # Variance v_l of a level-l node's estimate from its subtree at unit node variance: v_0 = 1,
        # v_l = 1 / (1 + 1/(2 v_{l-1})); the node's own draw gets weight v_l (inverse-variance weighting).
        self._weights = [1.0]
        for _ in range(1, max(1, horizon).bit_length() + 1):
            self._weights.append(1.0 / (1.0 + 1.0 / (2.0 * self._weights[-1])))
        super().__init__(noise_multiplier, sensitivity, stream, horizon, period, f"tree-{decoder}", profile)

    def _draw(self, step: int, level: int, shapes: Shapes, device) -> list[torch.Tensor]:
        return self.stream.normals(shapes, step * 64 + level, device)

    def _advance(self, step: int, shapes: Shapes, device) -> list[torch.Tensor]:
        stack = self._state if self._state is not None else []
        top = fz.trailing_zeros(step + 1)  # the new node has this level; the stack's lower levels retire
        if self.decoder == "sum":
            node = self._draw(step, top, shapes, device)
            out = [x.clone() for x in node]
            while stack and stack[-1][0] < top:
                for o, old in zip(out, stack.pop()[1]):
                    o.sub_(old)
        else:
            node = self._draw(step, 0, shapes, device)
            out = [torch.zeros_like(x) for x in node]
            for level in range(1, top + 1):
                _, left = stack.pop()  # the sibling, completed earlier: its estimate retires from the prefix
                w = self._weights[level]
                for o, x, sib, fresh in zip(out, node, left, self._draw(step, level, shapes, device)):
                    o.sub_(sib)
                    x.add_(sib).mul_(1.0 - w).add_(fresh, alpha=w)
            for o, x in zip(out, node):
                o.add_(x)
        stack.append((top, node))
        self._state = stack
        return out


class MatrixNoise(CorrelatedNoise):
    """n = C⁻¹Z for a lower-triangular C (rows: the steps) with ``bands`` bands, normalised to sensitivity 1
    under the participation (``factorizations.normalize_bands``), given in band storage
    (``factorizations.to_bands``: ``bands[t, -1]`` = C[t, t]). Forward substitution keeps the last bands - 1
    rows of n: W_t = (Z_t - Σ_{0 < t-s < bands} C[t, s] W_s) / C[t, t]. Never forms the T x T matrix."""

    def __init__(self, noise_multiplier: float, sensitivity: float, stream: SecretStream, bands: torch.Tensor,
                 period: int, factorization: str) -> None:
        if bands.dim() != 2 or not bool((bands[:, -1] > 0).all()):
            raise ValueError("a matrix factorization needs a lower-triangular C with a positive diagonal, given by "
                             "its bands (factorizations.to_bands)")
        steps, self.bands = bands.shape
        self._band = bands.to(torch.float32)  # band[t, j] = C[t, t - bands + 1 + j]; band[t, -1] = C[t, t]
        super().__init__(noise_multiplier, sensitivity, stream, steps, period, factorization,
                         fz.band_prefix_sensitivities(bands, period))

    def matrix(self) -> torch.Tensor:
        """C (T x T, float64) rebuilt from the bands the noise is drawn with: for audits of short runs."""
        return fz.from_bands(self._band.double())

    def _advance(self, step: int, shapes: Shapes, device) -> list[torch.Tensor]:
        ring = self.bands - 1
        draws = self.stream.normals(shapes, step, device)
        coef = self._band[step].to(device)
        if ring == 0:
            return [z.div_(coef[-1]) for z in draws]
        buffers = self._state if self._state is not None else [None] * len(shapes)
        lo = max(0, step - ring)
        slots = torch.tensor([s % ring for s in range(lo, step)], dtype=torch.long, device=device)
        out = []
        for i, z in enumerate(draws):
            w = z.reshape(-1)
            buf = buffers[i]
            if buf is None or (buf.shape[0] <= step and buf.shape[0] < ring):  # grow by doubling up to `ring`
                grown = torch.zeros(min(ring, max(8, 2 * (step + 1))), w.numel(), device=device, dtype=w.dtype)
                if buf is not None:
                    grown[:buf.shape[0]] = buf
                buf = buffers[i] = grown
            if step > 0:
                weights = torch.zeros(buf.shape[0], device=device, dtype=w.dtype)
                weights[slots] = coef[ring - (step - lo):ring].to(w.dtype)
                w = w - buf.t() @ weights
            w = w / coef[-1]
            buf[step % ring] = w
            out.append(w.view(z.shape))
        self._state = buffers
        return out

