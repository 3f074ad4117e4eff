"""Counting a training step's operations on the CPU, as a GPU would launch them.

On a GPU dpopt's step is bound by the host: one small kernel launch after another, so the ratio of two steps'
kernel-launching aten operations predicts the ratio of their GPU times (docs/performance.md, "Counting launches on
the CPU"). They can be counted without a GPU: ``count_step`` runs a step under a ``TorchDispatchMode`` that sees
every aten operation and classifies it:

* launching: every aten operation but those that launch no kernel on a GPU, read from its schema: views (the
  output aliases the input: ``is_view``; view, expand, t, permute, select, slice, split, unbind, detach, alias,
  lift_fresh, ...), in-place metadata changes (the ``inplace_view`` tag: unsqueeze_, resize_, set_), operations
  that neither return a tensor nor write one (host metadata: promote_types, result_type; reads of a value:
  ``_local_scalar_dense``, ``equal``, host syncs counted as such), and by name ``NO_KERNEL``: allocations
  without a fill (empty, empty_like, new_empty, ...) and ``_unsafe_view`` (a view its schema does not declare).
  Operations outside aten (the profiler's record-function markers) are not counted as launches either;
* host syncs: operations that make the host wait for the device: reads of a value (the ``data_dependent_output``
  tag: ``_local_scalar_dense``, behind ``item``, ``float``, ``int``, ``bool``; ``equal``), outputs whose shape
  depends on the data (the ``dynamic_output_shape`` tag: nonzero, unique, masked_select, repeat_interleave without
  ``output_size``; ``index`` only with a boolean index, and ``index_put_`` with one), and the ``Tensor`` methods
  that reach no aten operation on a CPU run: ``tolist``, ``cpu`` and ``numpy``, counted as if every tensor lived
  on the device. A ``.to("cpu")`` copy is not seen: on a CPU run it is the no-op ``.to(device)``.

``tracing`` records the launching operations and host syncs in order, with the shapes of what each returns: two
steps with equal traces run the same kernels on tensors of the same shapes, so one CUDA graph could replay both
(capture-readiness; ``tests/test_launch_counts.py``).

``accelerator_settings`` makes the step take the decisions it would take on a GPU: the chunk budget
``ACCELERATOR_CHUNK_ELEMENTS`` (``chunk_elements`` of the CPU) and ``foreach`` optimizers (PyTorch's default for
parameters on CUDA: the CPU joins the device types that get it); with one torch thread, so that the noise (drawn by
a thread pool on a CPU with several) is drawn on the thread that counts it (a dispatch mode is per thread).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch.optim import optimizer as torch_optimizer
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from dpopt.grad import captures

# Not views by their schema, yet no kernel: allocations without a fill (the caching allocator works on the host)
# and ``_unsafe_view`` (a view).
NO_KERNEL = frozenset({"empty", "empty_like", "empty_strided", "empty_permuted", "new_empty", "new_empty_strided",
                       "_unsafe_view"})
# Indexing whose output shape depends on the data only with a boolean index.
MASKABLE = frozenset({"index", "index_put_", "_index_put_impl_"})
# Tensor methods that make the host wait for a device but reach no aten operation on a CPU run.
HOST_METHODS = ("tolist", "cpu", "numpy")


@dataclass
class StepCount:
    """One step's aten operations by name, those of them that launch a kernel, its host syncs by name, and its
    upcasts: copies of a 16-bit float tensor into float32 (``_to_copy``, ``copy_``), the cost of keeping a bf16
    step's norms and sums in float32."""

    ops: Counter[str] = field(default_factory=Counter)
    launching: Counter[str] = field(default_factory=Counter)
    syncs: Counter[str] = field(default_factory=Counter)
    upcasts: Counter[str] = field(default_factory=Counter)

    @property
    def aten_ops(self) -> int:
        return sum(self.ops.values())

    @property
    def launching_ops(self) -> int:
        return sum(self.launching.values())

    @property
    def host_syncs(self) -> int:
        return sum(self.syncs.values())

    @property
    def fp32_copies(self) -> int:
        return sum(self.upcasts.values())


def _tensor(t: torch._C.Type) -> bool:
    return isinstance(t, torch.TensorType) or (isinstance(t, (torch.ListType, torch.OptionalType))
                                               and _tensor(t.getElementType()))


def is_launching(func: torch._ops.OpOverload) -> bool:
    """Whether ``func`` launches a kernel on a GPU."""
    schema = func._schema
    makes_data = (any(_tensor(r.type) for r in schema.returns)
                  or any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments))
    return (func.namespace == "aten" and makes_data and not func.is_view and torch.Tag.inplace_view not in func.tags
            and func.overloadpacket.__name__ not in NO_KERNEL)


HALF = (torch.float16, torch.bfloat16)


def is_upcast(func: torch._ops.OpOverload, args: tuple, out: Any) -> bool:
    """Whether ``func`` copied a 16-bit float tensor into a float32 one."""
    name = func.overloadpacket.__name__
    source = args[0] if name == "_to_copy" else args[1] if name == "copy_" and len(args) > 1 else None
    return (isinstance(source, torch.Tensor) and source.dtype in HALF and isinstance(out, torch.Tensor)
            and out.dtype == torch.float32)


def _boolean(indices: Any) -> bool:
    return isinstance(indices, (list, tuple)) and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool
                                                      for i in indices)


def is_sync(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> bool:
    """Whether ``func`` on these arguments makes the host wait for a GPU."""
    name = func.overloadpacket.__name__
    if name in MASKABLE:
        return _boolean(args[1] if len(args) > 1 else kwargs.get("indices"))
    dynamic = torch.Tag.data_dependent_output in func.tags or torch.Tag.dynamic_output_shape in func.tags
    return dynamic and kwargs.get("output_size") is None  # repeat_interleave given its output size: no wait


Seen = Callable[[torch._ops.OpOverload, tuple, dict, Any], None]


class _Watching(TorchDispatchMode):
    """Runs every aten operation, then tells ``seen`` (the operation, its arguments, its result)."""

    def __init__(self, seen: Seen) -> None:
        super().__init__()
        self.seen = seen

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.seen(func, args, kwargs, out)
        return out


@contextlib.contextmanager
def _watching_host_methods(seen: Callable[[str], None]) -> Iterator[None]:
    """``HOST_METHODS`` reported by name to ``seen`` while in the context; torch restored after."""
    saved = {name: getattr(torch.Tensor, name) for name in HOST_METHODS}

    def watched(name: str, original: Callable) -> Callable:
        def method(*args, **kwargs):
            seen(name)
            return original(*args, **kwargs)

        return method

    try:
        for name, original in saved.items():
            setattr(torch.Tensor, name, watched(name, original))
        yield
    finally:
        for name, original in saved.items():
            setattr(torch.Tensor, name, original)


@contextlib.contextmanager
def counting() -> Iterator[StepCount]:
    """Counts the operations and host syncs run in the context (on this thread) into the ``StepCount`` it yields."""
    count = StepCount()

    def seen(func: torch._ops.OpOverload, args: tuple, kwargs: dict, out: Any) -> None:
        name = func.overloadpacket.__name__
        count.ops[name] += 1
        if is_launching(func):
            count.launching[name] += 1
        if is_sync(func, args, kwargs):
            count.syncs[name] += 1
        if is_upcast(func, args, out):
            count.upcasts[name] += 1

    def host(name: str) -> None:
        count.syncs[name] += 1

    with _watching_host_methods(host), _Watching(seen):
        yield count


@dataclass(frozen=True)
class Op:
    """One entry of a trace: an operation's name, the shapes of the tensors it returns, whether the host waits."""

    name: str
    shapes: tuple[tuple[int, ...], ...]
    sync: bool


@contextlib.contextmanager
def tracing() -> Iterator[list[Op]]:
    """The launching operations and host syncs run in the context (on this thread), in order, into the list it
    yields."""
    trace: list[Op] = []

    def seen(func: torch._ops.OpOverload, args: tuple, kwargs: dict, out: Any) -> None:
        sync = is_sync(func, args, kwargs)
        if sync or is_launching(func):
            shapes = tuple(tuple(t.shape) for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))
            trace.append(Op(func.overloadpacket.__name__, shapes, sync))

    with _watching_host_methods(lambda name: trace.append(Op(name, (), True))), _Watching(seen):
        yield trace


@contextlib.contextmanager
def accelerator_settings() -> Iterator[None]:
    """The chunk budget of an accelerator, ``foreach`` optimizers and one torch thread; restored after."""
    budget, devices, threads = captures.CHUNK_ELEMENTS, torch_optimizer._get_foreach_kernels_supported_devices, \
        torch.get_num_threads()
    captures.CHUNK_ELEMENTS = captures.ACCELERATOR_CHUNK_ELEMENTS
    torch_optimizer._get_foreach_kernels_supported_devices = lambda: [*devices(), "cpu"]
    torch.set_num_threads(1)
    try:
        yield
    finally:
        captures.CHUNK_ELEMENTS = budget
        torch_optimizer._get_foreach_kernels_supported_devices = devices
        torch.set_num_threads(threads)


def count_step(step: Callable[[], object], warmup: int = 2) -> StepCount:
    """The operations of ``step``'s call after ``warmup`` uncounted ones (by default the third: a run's steady
    state, past the first steps' one-time work such as an optimizer's lazy state). Build and run the step inside
    ``accelerator_settings`` to count it as a GPU would run it."""
    for _ in range(warmup):
        step()
    with counting() as count:
        step()
    return count
