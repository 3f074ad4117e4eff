"""Matrix factorizations of the prefix-sum workload, their sensitivity under fixed-order participation,
and their optimisation. Public and data-independent: everything here is computed before training.

Notation (Choquette-Choo et al. 2024, "Optimal rates for DP-SCO with a single epoch and large batches",
Sec. 2.2 and 5; spec ``dp_srgd.md`` §2): a run of T steps releases C·X + Z, where row t of X is step t's
clipped sum and Z is iid Gaussian. In gradient space step t receives noise (C⁻¹Z)_t, so the iterates see
the prefix-sum workload W = A (lower-triangular ones) times C⁻¹. With momentum and the SRG running sum the
iterates see W = M·A·L, the paper's "true" workload (L473), where M[t, s] = momentum^(t-s) and
L[t, s] = decay^(t-s); every workload here is lower-triangular Toeplitz.

Sensitivity. One example contributes at most 1 (the clip bound) to the rows of X of its participations;
with fixed-order batches of ``period`` steps these are the columns of one *group* {j, j+b, j+2b, ...}.
When the columns of each group have non-negative inner products (C ≥ 0 suffices; groups whose columns
never share a row need nothing), the worst case aligns the contributions and the sensitivity is
max_j ‖Σ_i C[:, ib + j]‖₂ (spec §2.2; [15] L445). Otherwise that formula does not hold and is refused.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

F64 = torch.float64


# --- workloads --------------------------------------------------------------------------------------------
def geometric(n: int, rate: float) -> torch.Tensor:
    """rate^k for k < n (rate 0: the unit impulse)."""
    k = torch.arange(n, dtype=F64)
    return torch.where(k == 0, torch.ones_like(k), torch.tensor(rate, dtype=F64) ** k)


def causal_convolve(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """First len(a) coefficients of a * b: the product of two lower-triangular Toeplitz matrices."""
    n = a.shape[-1]
    size = 1 << (2 * n - 1).bit_length()
    return torch.fft.irfft(torch.fft.rfft(a, size) * torch.fft.rfft(b, size), size)[..., :n]


def workload_coefficients(steps: int, momentum: float = 0.0, decay: float = 0.0) -> torch.Tensor:
    """First column of W = M·A·L: prefix sums (A) after the SRG decay (L) and heavy-ball momentum (M).
    momentum = decay = 0 is the "ones" workload A (spec §2.4)."""
    w = torch.ones(steps, dtype=F64)
    for rate in (momentum, decay):
        if rate:
            w = causal_convolve(w, geometric(steps, rate))
    return w


def toeplitz(coefficients: torch.Tensor, steps: int) -> torch.Tensor:
    """The steps x steps lower-triangular Toeplitz matrix whose first column starts with ``coefficients``."""
    col = torch.zeros(steps, dtype=F64)
    m = min(steps, coefficients.shape[0])
    col[:m] = coefficients[:m]
    idx = torch.arange(steps)
    diff = idx[:, None] - idx[None, :]
    return torch.where(diff >= 0, col[diff.clamp_min(0)], torch.zeros((), dtype=F64))


def sqrt_coefficients(n: int) -> torch.Tensor:
    """r_k = binom(2k, k) / 4^k: the lower-triangular Toeplitz square root of A (spec §2.4)."""
    k = torch.arange(1, n, dtype=F64)
    return torch.cat([torch.ones(1, dtype=F64), torch.cumprod((2 * k - 1) / (2 * k), 0)])


def tree_nodes(steps: int, full: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The binary tree as a factorization: one 0/1 row per node (the indicator of its interval of steps) and
    the step at which each node is complete (its release step), rows in release order.

    ``full=False`` keeps the nodes a prefix is ever decomposed into: at step t (0-based) the one node of
    level k = trailing zeros of t+1, covering [t+1-2^k, t] (Lemma 4.3, L182: odd j only); it is square.
    ``full=True`` keeps every dyadic node (levels 0..k end at step t), as the least-squares decoder uses."""
    rows, release = [], []
    for t in range(steps):
        top = trailing_zeros(t + 1)
        for level in range(0 if full else top, top + 1):
            row = torch.zeros(steps, dtype=F64)
            row[t + 1 - (1 << level):t + 1] = 1.0
            rows.append(row)
            release.append(t)
    return torch.stack(rows), torch.tensor(release)


def trailing_zeros(n: int) -> int:
    return (n & -n).bit_length() - 1


# --- sensitivity ------------------------------------------------------------------------------------------
def _grouped(c: torch.Tensor, period: int) -> torch.Tensor:
    """Columns of ``c`` arranged as [rows, participations, period] (zero-padded past the horizon)."""
    rows, steps = c.shape
    k = math.ceil(steps / period)
    padded = torch.zeros(rows, k * period, dtype=c.dtype)
    padded[:, :steps] = c
    return padded.view(rows, k, period)


def check_aligned(c: torch.Tensor, period: int, tol: float = 1e-12) -> None:
    """Refuse a factorization whose participation columns have a negative inner product: then the
    column-sum sensitivity formula does not bound the worst case ([15]; spec §2.2)."""
    g = _grouped(c, period)
    gram = torch.einsum("rib,rjb->bij", g, g)
    scale = gram.diagonal(dim1=1, dim2=2).max().clamp_min(1e-300)
    if bool((gram < -tol * scale).any()):
        raise ValueError("this factorization has participation columns with negative inner products, so its "
                         "multi-epoch sensitivity is not the column-sum norm; use a non-negative C")


def group_sensitivities(c: torch.Tensor, period: int) -> torch.Tensor:
    """‖Σ_i C[:, ib + j]‖₂ for each position j < period in the epoch (after ``check_aligned``)."""
    return _grouped(c, period).sum(1).norm(dim=0)


def sensitivity(c: torch.Tensor, period: int) -> float:
    """The L2 sensitivity of C·X when each example contributes at most 1 to the rows j, j+period, ... of X."""
    check_aligned(c, period)
    return float(group_sensitivities(c, period).max())


def normalize_columns(c: torch.Tensor, period: int) -> torch.Tensor:
    """C·D with D diagonal such that every position's sensitivity is exactly 1 (so the whole is 1). Never
    worse than dividing by the maximum: a group below the maximum gets less noise (rows of C⁻¹ shrink)."""
    check_aligned(c, period)
    s = group_sensitivities(c, period)
    scale = 1.0 / s.clamp_min(1e-300)
    return c * scale[torch.arange(c.shape[1]) % period]


def prefix_sensitivities(c: torch.Tensor, period: int, release: torch.Tensor | None = None) -> torch.Tensor:
    """out[s] = sensitivity of what the first s+1 steps release: the rows of C released by step s (row r at
    step ``release[r]``, default r), restricted to the participations at steps <= s. Non-decreasing; the
    last entry is ``sensitivity(c, period)``. This is what an early-stopped or interrupted run reports."""
    check_aligned(c, period)
    rows, steps = c.shape
    release = torch.arange(rows) if release is None else release
    bounds = torch.searchsorted(release, torch.arange(steps + 1))
    sums = torch.zeros(period, rows, dtype=F64)
    sq = torch.zeros(period, dtype=F64)
    out = torch.empty(steps, dtype=F64)
    for t in range(steps):
        sums[t % period] += c[:, t]
        a, b = int(bounds[t]), int(bounds[t + 1])
        sq += sums[:, a:b].square().sum(1)
        out[t] = sq.max().sqrt()
    return torch.cummax(out, 0).values


# --- banded storage: C by its diagonals, O(T p) memory ------------------------------------------------------
# bands[t, j] = C[t, t - p + 1 + j] for a lower-triangular C of bandwidth p (entries left of column 0 are 0);
# bands[:, -1] is the diagonal. The functions below equal their dense counterparts above (tests) without
# forming T x T matrices, which at T = 9,380 steps cost seconds and gigabytes.
def _band_columns(steps: int, p: int) -> torch.Tensor:
    """The column of C each entry of a [steps, p] band storage holds (negative: left of column 0)."""
    return torch.arange(steps)[:, None] - p + 1 + torch.arange(p)[None, :]


def to_bands(c: torch.Tensor) -> torch.Tensor:
    """The band storage of a dense lower-triangular C, p its bandwidth."""
    nonzero = (c != 0).nonzero()
    p = int((nonzero[:, 0] - nonzero[:, 1]).max()) + 1 if nonzero.numel() else 1
    cols = _band_columns(c.shape[0], p)
    return torch.where(cols >= 0, c.gather(1, cols.clamp_min(0)), torch.zeros((), dtype=c.dtype))


def toeplitz_bands(coefficients: torch.Tensor, steps: int) -> torch.Tensor:
    """The band storage of ``toeplitz(coefficients, steps)``: every row holds the coefficients reversed."""
    p = min(steps, coefficients.shape[0])
    cols = _band_columns(steps, p)
    return torch.where(cols >= 0, coefficients[:p].to(F64).flip(0), torch.zeros((), dtype=F64))


def from_bands(bands: torch.Tensor) -> torch.Tensor:
    """The dense C (T x T) of a band storage."""
    steps, p = bands.shape
    cols = _band_columns(steps, p)
    rows = torch.arange(steps)[:, None].expand(steps, p)
    keep = cols >= 0
    c = torch.zeros(steps, steps, dtype=bands.dtype)
    c[rows[keep], cols[keep]] = bands[keep]
    return c


def _check_bands_aligned(bands: torch.Tensor, period: int) -> None:
    """``check_aligned`` in O(T p) where it is implied: with p <= period an example's columns never share a
    row, and a non-negative C has non-negative inner products; otherwise the dense check."""
    if bands.shape[1] > period and bool((bands < 0).any()):
        check_aligned(from_bands(bands), period)


def _group_squares(bands: torch.Tensor, period: int) -> Iterator[torch.Tensor]:
    """After each row t (released at step t): Σ over rows <= t of the square of the row's sum over each group's
    columns, per group (one tensor, updated in place). Its last value is ``group_sensitivities`` squared."""
    _check_bands_aligned(bands, period)
    steps, p = bands.shape
    groups = _band_columns(steps, p).remainder(period)  # entries left of column 0 are 0: any group will do
    sq = torch.zeros(period, dtype=F64)
    for t in range(steps):
        sq += torch.zeros(period, dtype=F64).index_add_(0, groups[t], bands[t].to(F64)).square()
        yield sq


def band_prefix_sensitivities(bands: torch.Tensor, period: int) -> torch.Tensor:
    """``prefix_sensitivities(from_bands(bands), period)`` in O(T (p + period)) time and O(T p) memory."""
    return torch.stack([sq.max() for sq in _group_squares(bands, period)]).sqrt()


def normalize_bands(bands: torch.Tensor, period: int) -> torch.Tensor:
    """``normalize_columns`` on the band storage: every position's sensitivity exactly 1."""
    *_, sq = _group_squares(bands, period)
    groups = _band_columns(*bands.shape).remainder(period)
    return bands / sq.sqrt().clamp_min(1e-300)[groups]


# --- optimisation -----------------------------------------------------------------------------------------
def _lbfgs(params: torch.Tensor, loss_fn, max_iter: int) -> None:
    opt = torch.optim.LBFGS([params], lr=1.0, max_iter=max_iter, history_size=10, tolerance_grad=1e-12,
                            tolerance_change=1e-13, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = loss_fn()
        loss.backward()
        return loss

    opt.step(closure)


def optimize_dense(workload: torch.Tensor, period: int, max_iter: int = 300) -> torch.Tensor:
    """A non-negative lower-triangular C minimising ‖W C⁻¹‖_F² at sensitivity 1 under fixed-order
    participation with ``period`` steps per epoch (the multi-epoch problem of [15], L472-L473).

    Parameterised as C = tril(θ⊙θ)·D, with D the column scaling that gives every position sensitivity
    exactly 1 (``normalize_columns``), so the objective is smooth; initialised at the square-root
    factorization; L-BFGS. Each evaluation is a T x T triangular solve (O(T³))."""
    steps = workload.shape[0]
    theta = toeplitz(sqrt_coefficients(steps), steps).sqrt().requires_grad_(True)
    mask = torch.ones(steps, steps, dtype=torch.bool).tril()
    pos = torch.arange(steps) % period

    def build(th: torch.Tensor) -> torch.Tensor:
        c = torch.where(mask, th * th, torch.zeros((), dtype=F64))
        return c / group_sensitivities(c, period)[pos]

    def loss() -> torch.Tensor:
        c = build(theta)
        y = torch.linalg.solve_triangular(c.T, workload.T, upper=True)  # (W C^-1)^T
        return y.square().sum()

    _lbfgs(theta, loss, max_iter)
    with torch.no_grad():
        return normalize_columns(build(theta), period)


def optimize_banded(workload: torch.Tensor, bands: int, period: int, max_iter: int = 500) -> torch.Tensor:
    """The first ``bands`` coefficients of a lower-triangular Toeplitz C minimising ‖W C⁻¹‖_F² · sens(C)²
    for the Toeplitz workload W whose first column is ``workload`` (banded MF, Choquette-Choo et al. 2023).
    Needs bands <= period, so that an example's participations never share a row and the sensitivity has the
    closed form sens² = Σ_i ‖c[:min(bands, T - i·period)]‖² (position 0 is the worst). O(T log T) per
    evaluation."""
    steps = workload.shape[0]
    if not 1 <= bands <= min(period, steps):
        raise ValueError(f"banded noise needs 1 <= bands <= steps per epoch ({min(period, steps)}) so that an "
                         f"example's participations never share a band; got {bands}")
    w = workload.to(F64)
    c = sqrt_coefficients(bands).clone().requires_grad_(True)
    lengths = [min(bands, steps - i * period) for i in range(math.ceil(steps / period))]
    weights = torch.arange(steps, 0, -1, dtype=F64)  # a Toeplitz coefficient k appears T - k times

    def loss() -> torch.Tensor:
        frob = (weights * causal_convolve(w, inverse_coefficients(c, steps)).square()).sum()
        sens = sum(c[:m].square().sum() for m in lengths)
        return frob * sens  # scale-invariant

    _lbfgs(c, loss, max_iter)
    with torch.no_grad():
        return c / c[0]


def expected_error(workload: torch.Tensor, c: torch.Tensor, period: int) -> float:
    """‖W C⁻¹‖_F · sens(C) / sqrt(T): the root-mean-square noise on the workload at unit noise multiplier
    (the quantity the factorizations minimise; iid noise, C = I, gives ‖W‖_F · sqrt(epochs) / sqrt(T))."""
    steps = c.shape[1]
    y = torch.linalg.solve_triangular(c.T, workload.T, upper=True)
    return float(y.norm() * sensitivity(c, period) / math.sqrt(steps))


def inverse_coefficients(c: torch.Tensor, steps: int) -> torch.Tensor:
    """The first ``steps`` coefficients of 1/c(x): the first column of C⁻¹ for the lower-triangular Toeplitz C
    whose first column starts with ``c`` (c[0] != 0), without forming C. Newton's iteration on power series,
    h ← h·(2 − c·h) mod x^2m, doubles the correct coefficients each round: O(steps log steps) by FFT, and
    differentiable, so ``optimize_banded`` can descend through it."""
    c = c.to(F64)
    h = (1.0 / c[:1])
    while h.shape[0] < steps:
        m = min(2 * h.shape[0], steps)
        h = torch.nn.functional.pad(h, (0, m - h.shape[0]))
        ch = causal_convolve(torch.nn.functional.pad(c[:m], (0, max(0, m - c.shape[0]))), h)
        h = 2.0 * h - causal_convolve(h, ch)
    return h[:steps]


def single_participation_error(workload: torch.Tensor, c: torch.Tensor) -> float:
    """``expected_error`` of the Toeplitz C starting with ``c`` for a Toeplitz workload with first column
    ``workload`` when each example joins at most one step of any len(c) consecutive ones (its columns then
    never share a row, so the sensitivity is one column's norm, ‖c‖), without forming T x T matrices."""
    steps = workload.shape[0]
    g = causal_convolve(workload.to(F64), inverse_coefficients(c, steps))  # first column of W C⁻¹
    weights = torch.arange(steps, 0, -1, dtype=F64)  # coefficient k appears T - k times
    return float((weights * g.square()).sum().sqrt() * c.to(F64).norm() / math.sqrt(steps))


def tree_prefix_sensitivities(steps: int, period: int, full: bool) -> torch.Tensor:
    """``prefix_sensitivities`` of ``tree_nodes(steps, full)`` without forming the node matrix (O(nodes ·
    period)): an example at position j is in node [a, b] as often as there are i with a <= ib + j <= b, and
    the node's row of the column sum is that count (the matrix is 0/1, so always aligned)."""
    j = torch.arange(period, dtype=torch.int64)
    sq = torch.zeros(period, dtype=F64)
    out = torch.empty(steps, dtype=F64)
    for t in range(steps):
        top = trailing_zeros(t + 1)
        for level in range(0 if full else top, top + 1):
            a = t + 1 - (1 << level)
            count = torch.div(t - j, period, rounding_mode="floor") - torch.div(a - j + period - 1, period,
                                                                               rounding_mode="floor") + 1
            sq += count.clamp_min(0).to(F64).square()
        out[t] = sq.max().sqrt()
    return out
