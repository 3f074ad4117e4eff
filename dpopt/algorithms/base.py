"""The private step every first-order method shares, with the parts a recipe plugs in.

    sample ─► per-example statistic ─► clip ─► sum + noise (+ ledger) ─► transforms ─► base update

``Privatizer`` is stages 3-4 and the only code that releases information: it clips, adds the noise,
records the release in the ledger and divides by the batch normaliser, in that order, every step
(an empty batch included). It reads the participation and the normaliser from the sampler it was built
with, so sampling and accounting cannot disagree. ``PrivateStep.step(data)`` draws the batch from that
sampler itself (stage 1), then runs the rest; a method changes ``statistic`` (which per-example vector is
privatized), ``transforms`` (post-processing, free under DP) or the base update.

With ``parallel`` (a ``dpopt.distributed.DataParallel``) the step is split across processes: each takes
its share of the global batch, clips and sums it, and the sums meet between the clip and the noise stage
(``DataParallel.sum_and_noise``): noise is added once, to the global sum, whatever its shape.

The release costs a few operations (GPU kernel launches) whatever the number of statistic tensors: the noise is
one draw per chunk of the flat statistic, added to the chunk's pieces by one ``torch._foreach_add_``, the division
is one ``_foreach_div_`` (one ``div_`` for views of one flat buffer, ``dpopt.flat``), and the gradients reach the
base optimizer as they are (one ``_foreach_copy_`` where their dtype is not their parameter's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from dpopt.names import renamed_attributes
from dpopt.clipping import Clipping, ClipStats, PerExampleStatistic, clip_and_sum, loss_totals
from dpopt.data.buckets import Padding, bucket_size, pad
from dpopt.data.samplers import PoissonSampler, Sampler, distinct_examples, take
from dpopt.device import to_device
from dpopt.flat import flat_view, zeros
from dpopt.grad.engine import PerExampleEngine
from dpopt.grad.graphs import CapturedClip, check_choice, why_not_captured
from dpopt.noise.correlated import CorrelatedNoise
from dpopt.noise.gaussian import GaussianNoise
from dpopt.privacy.ledger import PoissonSampling, PrivacyLedger
from dpopt.transforms.base import Transform

if TYPE_CHECKING:
    from dpopt.distributed import DataParallel


@dataclass
class Privatizer:
    """The privacy of a step's statistic: draws each logical batch, clips each example's contribution, adds the
    noise once per logical batch and records the release in the ledger. ``PrivacyPlan.make`` builds the one of a
    run; built by hand, its parts must agree, which is checked here.

    ```python
    import torch
    import torch.nn.functional as F
    from dpopt import DiSKAdam, PrivacyLedger
    from dpopt.algorithms import Privatizer, build_algorithm
    from dpopt.clipping import Clipping
    from dpopt.data.samplers import PoissonSampler
    from dpopt.grad import PerExampleEngine
    from dpopt.noise.gaussian import GaussianNoise
    from dpopt.noise.rng import SecretStream, secret_key

    x, y = torch.randn(80, 4), torch.randint(0, 2, (80,))
    model = torch.nn.Linear(4, 2)
    loss = lambda model, batch: F.cross_entropy(model(batch[0]), batch[1], reduction="none")  # one per example
    key = secret_key()                  # 256 bits of OS entropy
    sampler = PoissonSampler.with_batch_size(80, 4, SecretStream(key, "sampling"))
    noise = GaussianNoise(1.0, 1.0, SecretStream(key, "noise"))    # z = 1 (noise_multiplier_for: z of a target)
    privatizer = Privatizer(Clipping(1.0), noise, sampler, PrivacyLedger())
    step = build_algorithm("disk-adam", PerExampleEngine(model, loss), privatizer, DiSKAdam(lr=0.01),
                           physical_batch_size=2)
    for _ in range(4):
        step.step((x, y))               # samples its Poisson batch, clips, adds the noise once, records, updates
    assert privatizer.ledger.steps == 4
    ```

    :param clipping: the per-example clipping; its bound is the sensitivity.
    :param noise: the noise mechanism (``GaussianNoise``, or correlated noise), calibrated to that sensitivity.
    :param sampler: draws each step's batch from its secret stream (``PoissonSampler``, ...).
    :param ledger: where each release is recorded.
    :param parallel: a ``DataParallel`` group whose processes share each step (None: one process).
    :raises ValueError: for noise of another sensitivity than the clipping's, a sampler that claims Poisson
        amplification without being dpopt's ``PoissonSampler``, a batch normaliser <= 0, or a sampling the noise
        mechanism cannot account (``AccountingError``).
    """

    clipping: Clipping
    noise: GaussianNoise | CorrelatedNoise
    sampler: Sampler
    ledger: PrivacyLedger
    parallel: DataParallel | None = None

    def __post_init__(self) -> None:
        if abs(self.noise.sensitivity - self.clipping.sensitivity) > 1e-12 * self.clipping.sensitivity:
            raise ValueError("the noise must be calibrated to the clipping's sensitivity")
        if isinstance(self.sampler.participation, PoissonSampling) and not isinstance(self.sampler, PoissonSampler):
            raise ValueError(f"{type(self.sampler).__name__} claims Poisson amplification, which only "
                             "dpopt's PoissonSampler provides; account it with FixedParticipation instead")
        if not self.sampler.normalizer > 0:
            raise ValueError(f"the batch normaliser must be > 0, got {self.sampler.normalizer}")
        self.noise.release(self.sampler.participation)  # a mechanism refuses a sampling it cannot account

    def __call__(self, grads: PerExampleStatistic | None, shapes: Sequence[torch.Size], device: torch.device,
                 step: int) -> tuple[list[torch.Tensor], ClipStats]:
        """(sum_i clip(g_i) + N(0, sigma^2 C^2 I)) / normaliser of one whole batch, for statistics of the given
        shapes; ``grads=None`` is an empty batch (noise alone)."""
        if grads is None:
            sums, stats = zeros(shapes, torch.float32, device), ClipStats(0, 0)
        else:
            sums, stats = self.clip(grads)
        return self.release(sums, step), stats

    def clip(self, grads: PerExampleStatistic, into: list[torch.Tensor] | None = None,
             padding: Padding | None = None) -> tuple[list[torch.Tensor], ClipStats]:
        """Stage 3 for one physical batch: sum_i clip(g_i), added to the running sums ``into`` if given. The
        statistic is used up (its storage is freed as it is summed). Releases nothing: a logical step adds up
        the sums of its physical batches, then calls ``release`` once. ``padding``: the batch's padding rows
        (weight 0, counted nowhere)."""
        return clip_and_sum(grads, self.clipping, release=True, into=into, padding=padding)

    def release(self, sums: list[torch.Tensor], step: int) -> list[torch.Tensor]:
        """Stage 4, once per logical step: (sums + noise) / normaliser, recorded in the ledger (in place). Sums
        that are views of one flat buffer (``dpopt.flat.zeros``) are noised and divided as that buffer."""
        if self.parallel is None:
            noisy = self.noise(sums, step)
        else:
            noisy = self.parallel.sum_and_noise(sums, lambda s: self.noise(s, step))
        self.ledger.record(self.noise.release(self.sampler.participation))
        flat = flat_view(noisy)
        if flat is None:
            torch._foreach_div_(noisy, self.sampler.normalizer)
        else:
            flat.div_(self.sampler.normalizer)
        return noisy

    def batch(self, step: int) -> torch.Tensor:
        """The indices of this process's examples in the step's batch (all of them without ``parallel``)."""
        return self.sampler.batch(step) if self.parallel is None else self.parallel.share(self.sampler, step)

    def total(self, values: Sequence[float]) -> list[float]:
        """Per-process counts summed over all processes (diagnostics: examples, losses; not released)."""
        return list(values) if self.parallel is None else self.parallel.total(values)


Statistic = Callable[[PerExampleEngine, Any], PerExampleStatistic]


def check_physical_batch_size(size: int | None) -> int | None:
    """``size`` if it is a valid physical batch size (an integer >= 1, or None: the whole batch)."""
    if size is not None and not (isinstance(size, int) and size >= 1):
        raise ValueError(f"the physical batch size must be an integer >= 1, got {size}")
    return size


@dataclass(frozen=True)
class StepResult:
    loss: float | None  # mean training loss of the batch (not private: for progress display only)
    examples: int
    nonfinite: int
    clipped: int = 0  # examples whose statistic the clip stage scaled down


class PrivateStep:
    """The private step a recipe runs, once per call of ``step(batch)``: first-order by default; zeroth-order with a
    recipe's scalar statistic, shapes and directional update (DPZero). It draws its own batch and is no torch
    optimizer: ``make_private`` and ``PrivateTrainer`` drive it through a ``PrivateOptimizer``."""

    def __init__(self, engine: PerExampleEngine, privatizer: Privatizer, base: torch.optim.Optimizer,
                 transforms: Sequence[Transform] = (), statistic: Statistic | None = None,
                 shapes: Sequence[torch.Size] | None = None, verify: bool = True,
                 physical_batch_size: int | None = None) -> None:
        """``shapes``: of the privatized statistic, if not the engine's (e.g. one scalar for DPZero);
        ``verify=False`` for a statistic that does not come from the engine's per-example gradients;
        ``physical_batch_size``: the most examples sent through one forward/backward (None: the whole batch)."""
        self.engine, self.privatizer, self.base = engine, privatizer, base
        self.transforms = list(transforms)
        self._statistic = statistic
        self._shapes = None if shapes is None else list(shapes)
        self.steps = 0
        self.schedule: Callable[[int], float] | None = None  # the learning rate's factor at a step (schedules.py)
        self._initial_lr: float | None = None
        self.verified = not verify
        self.physical_batch_size = physical_batch_size
        # pad every physical batch to one of a few sizes (``dpopt.data.buckets``): static shapes for a captured step
        self.static_shapes = False
        self.captured: CapturedClip | None = None  # see ``capture``

    @property
    def params(self) -> list[torch.Tensor]:
        return self.engine.params

    @property
    def device(self) -> torch.device:
        """The model's device: every batch is moved there, and everything the step allocates lives there."""
        return self.params[0].device

    @property
    def shapes(self) -> list[torch.Size]:
        """The shapes of the privatized statistic (and of the noise)."""
        return self.engine.shapes if self._shapes is None else self._shapes

    def statistic(self, batch: Any) -> PerExampleStatistic:
        """The per-example vectors to privatize this step: by default the gradients at the current point;
        a recipe may pass another (e.g. DiSK's two-point mixture)."""
        if self._statistic is not None:
            return self._statistic(self.engine, batch)
        return self.engine.gradients(batch)

    @property
    def physical_batch_size(self) -> int | None:
        return self._physical

    @physical_batch_size.setter
    def physical_batch_size(self, size: int | None) -> None:
        self._physical = check_physical_batch_size(size)

    def verify(self, data: Any) -> None:
        """Check once, before the first release, that the engine attributes every layer's gradient to the
        right example, on 3 distinct examples of ``data`` that it picks itself (whatever the size of the
        sampled batches). Reads them, releases nothing."""
        self.engine.verify(to_device(distinct_examples(data, self.privatizer.sampler.dataset_size), self.device))
        self.verified = True

    def step(self, data: Any) -> StepResult:
        """One private step on a batch that this step samples from ``data`` (a tensor or a pytree of
        tensors indexed along dimension 0, or a callable mapping an index tensor to a batch). The batch (the
        logical batch: one release, one ledger event) goes through the engine in physical batches of at most
        ``physical_batch_size`` examples whose clipped sums are added before the noise: the same release as
        one pass over the whole batch, with memory set by the physical batch. ``data`` may stay on the CPU:
        each physical batch is moved to the model's device."""
        if not self.verified:
            self.verify(data)
        sums, stats = self._clipped_sums(data, self.privatizer.batch(self.steps))
        self.finish(sums)
        loss_sum, loss_count = stats.losses or (0.0, 0)
        examples, nonfinite, clipped, loss_sum, loss_count = self.privatizer.total(
            [stats.examples, stats.nonfinite, stats.clipped, loss_sum, loss_count])
        return StepResult(loss_sum / loss_count if loss_count else None, int(examples), int(nonfinite),
                          int(clipped))

    def clipped_sums(self, data: Any, index: torch.Tensor) -> tuple[list[torch.Tensor] | None, tuple[int, int, int],
                                                                    torch.Tensor | None]:
        """Stages 2-3 of a logical batch (the examples of ``data`` at ``index``), in physical batches: the clipped
        sums (None if ``index`` is empty), the (examples, non-finite, clipped) counts and the finite losses as
        [sum, count] (float64, on the CPU: read with the clip stage's counts; None without losses)."""
        sums, stats = self._clipped_sums(data, index)
        loss = None if stats.losses is None else torch.tensor(stats.losses, dtype=torch.float64)
        return sums, (stats.examples, stats.nonfinite, stats.clipped), loss

    def _clipped_sums(self, data: Any, index: torch.Tensor) -> tuple[list[torch.Tensor] | None, ClipStats]:
        """``clipped_sums``, its counts and losses added over the physical batches: one host synchronisation per
        physical batch, the clip stage's (which reads the losses too)."""
        sums, total = None, ClipStats(0, 0)
        for part in index.split(self.physical_batch_size or index.numel()) if index.numel() else ():
            part, padding = self._padded(part)
            batch = to_device(take(data, part), self.device)
            replayed = None if self.captured is None else self.captured.clip(batch, padding, sums)
            if replayed is not None:
                sums, stats = replayed
            else:
                grads = self.statistic(batch)
                losses = grads.losses
                sums, stats = self.privatizer.clip(grads, into=sums, padding=padding)
                if stats.losses is None and losses is not None:  # a clip stage that does not read them (no clipping)
                    loss_sum, loss_count = loss_totals(losses, padding and padding.mask).tolist()
                    stats = ClipStats(stats.examples, stats.nonfinite, stats.clipped, (loss_sum, int(loss_count)))
            losses = stats.losses
            if losses is not None and total.losses is not None:
                losses = (total.losses[0] + losses[0], total.losses[1] + losses[1])
            total = ClipStats(total.examples + stats.examples, total.nonfinite + stats.nonfinite,
                              total.clipped + stats.clipped, losses or total.losses)
        return sums, total

    def capture(self, choice: str, log: Callable[[str], None] = print,
                replayed: Callable[[Callable[[], Any]], Any] | None = None) -> None:
        """Capture the clip stage of each batch shape and replay it (``dpopt.grad.graphs``): ``on`` (refused where it
        cannot work), ``auto`` (on CUDA where it can work, else eager: with one log line on CUDA saying why) or
        ``off``. The batches are then padded to a few sizes (``static_shapes``). ``replayed``: how a function is
        recorded (the tests' CPU stand-in ``graphs.Rerun``; by default CUDA graphs).

        :raises ValueError: for an unknown choice, or ``on`` where capture cannot work (the reason named).
        """
        check_choice(choice)
        self.captured, self.static_shapes = None, False
        if choice == "off":
            return
        reason = None if replayed is not None else why_not_captured(self.engine, self._statistic is not None,
                                                                     self.privatizer.parallel is not None)
        if reason is not None:
            if choice == "on":
                raise ValueError(f"graph 'on' cannot work here: {reason}; use 'auto' or 'off'")
            if self.device.type == "cuda":
                log(f"dpopt: the step runs eager: {reason}")
            return
        self.captured = CapturedClip(self.engine, self.privatizer.clipping, self._eager_clip, strict=choice == "on",
                                     replayed=replayed, log=log)
        self.static_shapes = True

    def _eager_clip(self, batch: Any, padding: Padding | None) -> tuple[list[torch.Tensor], ClipStats]:
        """The eager clip stage of one (padded) physical batch: what a replay is checked against."""
        return self.privatizer.clip(self.statistic(batch), padding=padding)

    def _padded(self, part: torch.Tensor) -> tuple[torch.Tensor, Padding | None]:
        """A physical batch's indices, padded to its bucket with ``static_shapes`` (``dpopt.data.buckets``)."""
        if not self.static_shapes:
            return part, None
        size = bucket_size(part.numel(), self.privatizer.sampler.normalizer, self.physical_batch_size)
        return pad(part, size), Padding.of(part.numel(), size, self.device)

    def finish(self, sums: list[torch.Tensor] | None) -> None:
        """The end of a logical step: release its clipped sums (``None``: an empty batch, noise alone) once,
        post-process, update the parameters."""
        self.apply(self.released(sums))

    def released(self, sums: list[torch.Tensor] | None) -> list[torch.Tensor]:
        """Stages 4-5 of a logical step: its clipped sums (``None``: an empty batch, noise alone) released once
        (noise, ledger), then post-processed by the transforms."""
        if sums is None:
            sums = zeros(self.shapes, torch.float32, self.device)
        g = self.privatizer.release(sums, self.steps)
        for t in self.transforms:
            g = t(g)
        return g

    def apply(self, g: list[torch.Tensor]) -> None:
        """Stage 6: the base update with the released, post-processed statistic ``g``, at the schedule's learning
        rate; the step is over."""
        if self.schedule is not None:
            self.scale_lr(self.schedule(self.steps))
        for t in self.transforms:
            t.before_update(self.params)
        self.update(g)
        for t in self.transforms:
            t.after_update(self.params)
        self.steps += 1

    def scale_lr(self, factor: float) -> None:
        """Set the base update's learning rate to ``factor`` times its initial one (kept as a torch optimizer's
        groups keep it, in ``initial_lr``, so that a checkpoint holds it)."""
        if isinstance(self.base, torch.optim.Optimizer):
            for group in self.base.param_groups:
                group["lr"] = group.setdefault("initial_lr", group["lr"]) * factor
            return
        if self._initial_lr is None:
            self._initial_lr = self.base.lr
        self.base.lr = self._initial_lr * factor

    def update(self, grads: list[torch.Tensor]) -> None:
        """The base update: a torch optimizer reads the gradients from ``.grad``; any other base (e.g. a
        projected Adam, whose gradients have their own shapes) has ``apply(grads)``."""
        if not isinstance(self.base, torch.optim.Optimizer):
            self.base.apply(grads)
            return
        for p, g in zip(self.params, as_param_dtypes(grads, self.params)):
            p.grad = g
        self.base.step()
        self.base.zero_grad(set_to_none=True)

    def state_dict(self) -> dict[str, Any]:
        noise = getattr(self.privatizer.noise, "state_dict", None)  # correlated noise's secure-mode state
        return {"steps": self.steps, "base": self.base.state_dict(),
                "transforms": [t.state_dict() for t in self.transforms], "noise": noise() if noise else {}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a ``state_dict`` (read onto the CPU by ``load_checkpoint``): the transforms' and the noise's
        tensors are moved to the model's device (a torch optimizer places its own state)."""
        self.steps = state["steps"]
        torch_base = isinstance(self.base, torch.optim.Optimizer)
        self.base.load_state_dict(state["base"] if torch_base else to_device(state["base"], self.device))
        for t, s in zip(self.transforms, state["transforms"]):
            t.load_state_dict(to_device(s, self.device))
        if hasattr(self.privatizer.noise, "load_state_dict"):
            self.privatizer.noise.load_state_dict(to_device(state.get("noise", {}), self.device))


def as_param_dtypes(grads: list[torch.Tensor], params: list[torch.Tensor]) -> list[torch.Tensor]:
    """``grads`` in their parameters' dtypes: the same tensors where they match; the others converted by one
    ``_foreach_copy_``."""
    out = [g if g.dtype == p.dtype else torch.empty_like(g, dtype=p.dtype) for g, p in zip(grads, params)]
    todo = [(o, g) for o, g in zip(out, grads) if o is not g]
    if todo:
        torch._foreach_copy_([o for o, _ in todo], [g for _, g in todo])
    return out


__getattr__ = renamed_attributes(__name__, DPOptimizer="PrivateStep")
