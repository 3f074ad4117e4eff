"""``dpopt bench``: the same training step with non-private PyTorch, dpopt and Opacus, each system in its
own process, timed and measured side by side.

* time: median seconds per step over ``steps`` steps after ``warmup`` steps (with ``--repeats R``, the
  fastest of R such medians, the systems taking turns); ``cpu_s_per_step``: the same median in process
  CPU time, which other processes' load disturbs far less (with ``--threads 1``);
* memory, ``peak_mb``: the peak of live tensor memory during one more step, like CUDA's
  ``max_memory_allocated``: the tensors alive when the step starts (model, optimizer state, data) plus the
  peak of the running sum of the allocator's records (every allocation and free) in time order. It counts
  what the step needs, independent of allocator caching and of the libraries a system imports;
* ``rss_mb``: the process's peak resident set size over the timed steps (Linux VmHWM), for reference;
  ``data_mb``: the bytes of the data set the steps sample from (part of ``peak_mb``);
* ``interleaved_cpu_s`` (unless ``--no-interleave``): median CPU seconds per step with every system that ran
  built in one more process and stepped in turn, so that other processes' load falls on all of them alike;
* ``faults_per_step``: minor page faults per timed step. Under glibc's default heap heuristics a process
  often returns the memory a step freed to the OS and faults it back in the next step (about 3,000 faults,
  4 ms of system time per step for the CNN at batch 256), or not, by luck of its allocation history: the
  same system then runs in two speeds. ``--steady-heap`` runs every system (all alike) with a heap that keeps
  what it freed (``STEADY_HEAP``), which leaves the compute alone to compare.

Systems: ``pytorch`` (non-private), ``inference`` (the forward pass and per-example losses alone, in eval mode
under ``torch.no_grad``: the floor of any step's memory, DPZero's reference), ``dpopt`` (DP, ghost norms and
book-keeping sums where cheaper),
``dpopt-materialize`` (DP, every Linear/Conv per-example gradient materialised; embedding rows stay sparse),
``opacus-hooks`` (every per-example gradient materialised) and ``opacus-ghost``, ``dp-grape`` (projected
per-example gradients of rank ``--rank``, projected Adam), ``dp-galore`` (naive DP-GaLore) and ``galore``
(non-private GaLore); the last three use their own projected Adam whatever ``--optimizer`` says; ``dpzero``
(DPZero: two forward passes, no backward, no optimizer state); ``disk-sgd`` and ``disk-adam`` (DiSK's
two-point statistic, kappa 0.7, gamma 0.5, on SGD or Adam), ``dp-srg-memf`` (the SRG difference g(x_t) -
g(x_t-1); iid noise here) and
``accel-dp-srgd`` (the weighted difference eta g(x_t) - (eta - 1) g(x_t-1), eta = t + 1; iid noise here).

``--device`` (default cpu) puts every system's model, data and step on that device (on CUDA a step is timed to
its ``torch.cuda.synchronize`` and ``peak_mb`` is ``max_memory_allocated``); ``--precision bf16|fp16`` autocasts
every system's forward (dpopt's norms, clipped sums and noise stay fp32; fp16 needs CUDA).

Workloads: ``cnn`` — the 28x28 Tanh CNN (dpopt.models.cnn) on random images; ``mlp`` — the MNIST MLP
(dpopt.models.mlp: 784 -> 128 -> 10, one row per example) on random images; ``vit`` — ``vit-tiny`` (dpopt.models,
a Hugging Face ViT: patches of 7, 4 layers, hidden 64; 72 small parameter tensors) on random images; ``bert`` — a BERT-shaped
Hugging Face model (6 layers, hidden 384, 12 heads, intermediate 1536: MiniLM's shape, random weights) on
random token ids; ``bert-base`` — BERT-base's shape (12 layers, hidden 768, 12 heads, intermediate 3072) the
same way; ``opt-125m`` ... ``opt-30b``, ``gpt2`` (small, its output layer tied to its token table), ``llama-1b``,
``llama-3b``, ``llama-7b`` — causal language models of those checkpoints' shapes with random weights
(``dpopt.model_shapes``; batch 8, sequence 128 by default) on random token ids, each example's loss its sequence's mean next-token cross-entropy. Every DP system
uses noise multiplier 1 and clip norm 1 with fixed-size batches.
Opacus gets explicit ``position_ids`` and ``token_type_ids`` on BERT (without them its hooks fail on a
stock model); dpopt gets the stock inputs.

``--count-ops`` times nothing: it counts, in this one process, each system's aten operations of its third step,
those of them that launch a kernel on a GPU and its host syncs (``dpopt.launches``: with the accelerator's chunk
budget and ``foreach`` optimizers), and the ratio of its launches to PyTorch's, which predicts the GPU time ratio
of a step bound by kernel launches.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import importlib.util
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_flatten

from dpopt import model_shapes
from dpopt.device import add_device_arguments, autocast, autocast_dtype, resolve_device, to_device
from dpopt.extras import require
from dpopt.grad.graphs import GRAPH_CHOICES
from dpopt.names import did_you_mean

SYSTEMS = ("pytorch", "inference", "dpopt", "dpopt-materialize", "opacus-hooks", "opacus-ghost", "dp-grape",
           "dp-galore", "galore", "dpzero", "disk-sgd", "disk-adam", "dp-srg-memf", "accel-dp-srgd")
DEFAULT_SYSTEMS = ("pytorch", "dpopt", "opacus-hooks", "opacus-ghost")
TEXT_WORKLOADS = ("bert", "bert-base", "minilm")  # BERT-shaped classifiers of random token ids
WORKLOADS = ("cnn", "mlp", "vit", *TEXT_WORKLOADS)  # and the causal language models of model_shapes.SHAPES
# A workload's batch where --batch is not given; with no flags, the bench times the CNN (about a minute).
DEFAULT_BATCH = {"cnn": 256, "mlp": 256, "vit": 64, "bert": 32, "bert-base": 32, "minilm": 32}
LM_BATCH, LM_SEQ = 8, 128  # a causal language model's batch and sequence length where not given
DEFAULT_WORKLOAD = "cnn"
# glibc: no trimming of the heap's top, and allocations up to 32 MiB (glibc's cap) from the heap, not mmap.
STEADY_HEAP = {"MALLOC_TRIM_THRESHOLD_": str(1 << 30), "MALLOC_MMAP_THRESHOLD_": str(1 << 25)}


@dataclass(frozen=True)
class Case:
    """One measurement: a workload (``minilm`` = the pretrained all-MiniLM-L6-v2 with its [CLS] head, ``bert`` =
    its shape with random weights, ``bert-base`` = BERT-base's), its batch and sequence length, and the base
    optimizer every system uses."""

    workload: str
    batch: int
    seq: int = 64
    optimizer: str = "sgd"
    rank: int = 16  # dp-grape, dp-galore, galore
    threads: int = 1
    physical: int | None = None  # dpopt's physical batch size (None: the whole batch in one pass)
    device: str = "cpu"  # model, data and every step on it (dpopt.device.resolve_device)
    precision: str = "fp32"  # every system's forward autocast to it; dpopt's norms, sums and noise stay fp32
    graph: str = "off"  # dpopt's systems: capture the clip stage as CUDA graphs (dpopt.grad.graphs)

    @property
    def label(self) -> str:
        seq = f" s{self.seq}" if self.workload in TEXT_WORKLOADS or is_language_model(self.workload) else ""
        physical = f" p{self.physical}" if self.physical else ""
        extra = "".join(f" {v}" for v, d in ((self.device, "cpu"), (self.precision, "fp32")) if v != d)
        extra += f" graph {self.graph}" if self.graph != "off" else ""
        return f"{self.workload} b{self.batch}{seq}{physical} {self.optimizer}{extra}"


def is_language_model(workload: str) -> bool:
    """Whether ``workload`` is a causal language model of ``model_shapes.SHAPES``."""
    return workload in model_shapes.SHAPES


def check_workload(name: str) -> str:
    """``name`` if it is a workload.

    :raises ValueError: one line with a "did you mean", naming the workloads and model sizes.
    """
    if name not in WORKLOADS and not is_language_model(name):
        kind = "model size" if name.startswith(("opt", "llama")) else "workload"
        raise ValueError(f"unknown {kind} {name!r}{did_you_mean(name, [*WORKLOADS, *model_shapes.SHAPES])} "
                         f"(workloads: {', '.join(WORKLOADS)}; model sizes: {', '.join(model_shapes.SHAPES)})")
    return name


def _rss_mb(key: str) -> float:
    return int(re.search(key + r":\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) / 1024


def _live_tensor_bytes() -> int:
    storages = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor):
            st = obj.untyped_storage()
            storages[st.data_ptr()] = st.nbytes()
    return sum(storages.values())


def peak_tensor_mb(step: Callable[[], None]) -> float:
    """Peak live tensor memory (MB) while ``step`` runs: live tensors at its start plus the peak of the
    running sum of the allocator's records (one per allocation, bytes > 0, and per free, bytes < 0) in the
    order they happened. (Before 2026-11-25 the bench summed each operation's net memory at the moment the
    operation started; an operation that frees more than it allocates, autograd's backward say, then hid
    the allocations made inside it.)"""
    from torch.profiler import ProfilerActivity, profile

    gc.collect()
    start = _live_tensor_bytes()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    records = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    running = peak = 0
    for record in sorted(records, key=lambda e: e.start_ns()):
        running += record.nbytes()
        peak = max(peak, running)
    return (start + peak) / 2**20


def _workload(case: Case, system: str) -> tuple[nn.Module, Any, Callable]:
    """The model, data and per-example loss of ``case``, on its device."""
    model, data, loss = _cpu_workload(case, system)
    device = resolve_device(case.device)
    return model.to(device), to_device(data, device), loss


def _cpu_workload(case: Case, system: str) -> tuple[nn.Module, Any, Callable]:
    check_workload(case.workload)
    torch.manual_seed(0)
    batch, seq = case.batch, case.seq
    if is_language_model(case.workload):
        model = model_shapes.build(case.workload)
        ids = torch.randint(0, model.config.vocab_size, (batch, seq))
        return model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, model_shapes.causal_lm_loss
    if case.workload in ("cnn", "mlp"):
        from dpopt.models import cnn, mlp

        model = (cnn if case.workload == "cnn" else mlp)((1, 28, 28), 10)
        data = (torch.randn(batch, 1, 28, 28), torch.randint(0, 10, (batch,)))
        return model, data, lambda m, b: F.cross_entropy(m(b[0]), b[1], reduction="none")
    from dpopt.data.datasets import Dataset
    if case.workload == "vit":
        from dpopt.models import vit_tiny

        images = torch.randn(batch, 1, 28, 28)
        model = vit_tiny(Dataset("bench", (images, torch.zeros(batch)), None, 10))
        data = (images, torch.randint(0, 10, (batch,)))
        return model, data, lambda m, b: F.cross_entropy(m(b[0]).logits, b[1], reduction="none")
    from dpopt.models import bert_base_random, minilm_cls, minilm_random

    build = {"minilm": minilm_cls, "bert": minilm_random, "bert-base": bert_base_random}[case.workload]
    model = build(Dataset("bench", {"labels": torch.zeros(1)}, None, 2))
    model.train()  # from_pretrained returns eval mode; fine-tuning (and Opacus) runs in training mode
    data = {"input_ids": torch.randint(0, 30522, (batch, seq)), "attention_mask": torch.ones(batch, seq, dtype=torch.long),
            "labels": torch.randint(0, 2, (batch,))}
    if system.startswith("opacus"):  # the workaround Opacus needs on a stock HF BERT
        data["position_ids"] = torch.arange(seq).expand(batch, seq).contiguous()
        data["token_type_ids"] = torch.zeros(batch, seq, dtype=torch.long)

    def loss(m, b):
        inputs = {k: v for k, v in b.items() if k != "labels"}
        return F.cross_entropy(m(**inputs).logits, b["labels"], reduction="none")

    return model, data, loss


def _optimizer(case: Case, params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.01) if case.optimizer == "sgd" else torch.optim.Adam(params, lr=1e-4)


def _step_fn(system: str, case: Case, model: nn.Module, dataset: Any, loss: Callable) -> Callable[[], None]:
    """One training step. Every system gathers its batch from the dataset each step, as a data loader
    would (dpopt's sampler does it inside the step)."""
    from dpopt.data.samplers import take

    n = len(dataset[1]) if isinstance(dataset, tuple) else len(next(iter(dataset.values())))
    device = resolve_device(case.device)
    index = torch.arange(n, device=device)
    cast = functools.partial(autocast, device, autocast_dtype(case.precision, device))
    if system == "pytorch":
        opt = _optimizer(case, model.parameters())

        def step() -> None:
            with cast():
                out = loss(model, take(dataset, index)).mean()
            out.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        return step
    if system == "inference":  # the forward pass alone: the least memory any step of this model can take
        model.eval()

        @torch.no_grad()
        def forward() -> None:
            with cast():
                loss(model, take(dataset, index))

        return forward
    if system == "galore":  # non-private GaLore (SVD projections of the batch gradient, projected Adam)
        from dpopt.algorithms.grape import GaLore

        galore = GaLore(model, case.rank, every=100, lr=1e-4)

        def galore_step() -> None:
            with cast():
                out = loss(model, take(dataset, index)).mean()
            out.backward()
            galore.step()
            galore.zero_grad()

        return galore_step
    if system in ("dpopt", "dpopt-materialize", "dp-grape", "dp-galore", "dpzero", "disk-sgd", "disk-adam",
                  "dp-srg-memf", "accel-dp-srgd"):
        from dpopt.algorithms import CONFIGS, Privatizer, build_algorithm, settings_of
        from dpopt.clipping import Clipping
        from dpopt.data.samplers import FixedOrderSampler
        from dpopt.grad import PerExampleEngine
        from dpopt.noise.gaussian import GaussianNoise
        from dpopt.noise.rng import SecretStream
        from dpopt.privacy import PrivacyLedger

        privatizer = Privatizer(Clipping(1.0), GaussianNoise(1.0, 1.0, SecretStream(0, "noise")),
                                FixedOrderSampler(n, n, SecretStream(0, "sampling")), PrivacyLedger())
        algorithm = system if system not in ("dpopt", "dpopt-materialize") else f"dp-{case.optimizer}"
        engine = PerExampleEngine(model, loss, strategy="materialize" if system == "dpopt-materialize" else "auto",
                                  precision=case.precision)
        hp = CONFIGS[algorithm](lr=0.01, **({"rank": case.rank} if "rank" in settings_of(algorithm) else {}))
        opt = build_algorithm(algorithm, engine, privatizer, hp, case.physical)
        opt.capture(case.graph)
        if not opt.verified:
            opt.verify(dataset)  # the one-time self-check, outside the timed step
        return lambda: opt.step(dataset)
    from opacus import PrivacyEngine
    from torch.utils.data import DataLoader, TensorDataset

    loader = DataLoader(TensorDataset(torch.zeros(n)), batch_size=n)
    opt = _optimizer(case, model.parameters())
    mode = system.split("-")[1]
    engine = PrivacyEngine()
    if mode == "ghost":
        model, opt, criterion, _ = engine.make_private(module=model, optimizer=opt, data_loader=loader,
                                                       criterion=nn.CrossEntropyLoss(), noise_multiplier=1.0,
                                                       max_grad_norm=1.0, poisson_sampling=False,
                                                       grad_sample_mode="ghost")
    else:
        model, opt, _ = engine.make_private(module=model, optimizer=opt, data_loader=loader, noise_multiplier=1.0,
                                            max_grad_norm=1.0, poisson_sampling=False, grad_sample_mode="hooks")
        criterion = nn.CrossEntropyLoss()

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        data = take(dataset, index)
        with cast():
            if isinstance(data, tuple):  # a Hugging Face image model (vit) returns an output with logits
                output, labels = model(data[0]), data[1]
                logits = getattr(output, "logits", output)
            else:
                logits, labels = model(**{k: v for k, v in data.items() if k != "labels"}).logits, data["labels"]
            out = criterion(logits, labels)
        out.backward()
        opt.step()

    return step


def _synchronized(step: Callable[[], None], device: torch.device) -> Callable[[], None]:
    """``step`` that returns when the device has finished it (GPU work is asynchronous)."""
    if device.type != "cuda":
        return step

    def synced() -> None:
        step()
        torch.cuda.synchronize(device)

    return synced


def peak_mb(step: Callable[[], None], device: torch.device) -> float:
    """``peak_tensor_mb`` on CPU; CUDA's ``max_memory_allocated`` during the step on a GPU."""
    if device.type != "cuda":
        return peak_tensor_mb(step)
    torch.cuda.reset_peak_memory_stats(device)
    step()
    return torch.cuda.max_memory_allocated(device) / 2**20


def worker(system: str, case: Case, warmup: int, steps: int) -> dict[str, float]:
    """Measure one system in this process. With ``steps`` 0 the one step whose peak memory is measured is also the
    one timed (under the profiler: for steps of seconds or more, where its per-operation cost is negligible)."""
    torch.set_num_threads(case.threads)
    device = resolve_device(case.device)
    model, data, loss = _workload(case, system)
    step = _synchronized(_step_fn(system, case, model, data, loss), device)
    for _ in range(warmup):
        step()
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak RSS
    times, cpu = [], []
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt

    def timed() -> None:
        start, start_cpu = time.perf_counter(), time.process_time()
        step()
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)

    if steps:
        for _ in range(steps):
            timed()
        faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / steps
        peak = peak_mb(step, device)
    else:  # the step whose peak is measured is the one timed
        peak = peak_mb(timed, device)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    rss = _rss_mb("VmHWM")
    data_mb = sum(t.numel() * t.element_size() for t in tree_flatten(data)[0] if isinstance(t, torch.Tensor)) / 2**20
    return {"s_per_step": statistics.median(times), "cpu_s_per_step": statistics.median(cpu),
            "peak_mb": peak, "rss_mb": rss, "faults_per_step": faults, "data_mb": data_mb}


def cpu_medians_in_turn(calls: dict[str, Callable[[], object]], rounds: int, warmup: int = 0) -> dict[str, float]:
    """Median CPU seconds per call of each function, the functions called in turn (``warmup`` untimed rounds,
    then ``rounds`` timed ones), so that load from other processes falls on all of them alike."""
    for _ in range(warmup):
        for f in calls.values():
            f()
    cpu: dict[str, list[float]] = {k: [] for k in calls}
    for _ in range(rounds):
        for k, f in calls.items():
            start = time.process_time()
            f()
            cpu[k].append(time.process_time() - start)
    return {k: statistics.median(v) for k, v in cpu.items()}


def interleaved_worker(systems: tuple[str, ...], case: Case, warmup: int, steps: int) -> dict[str, float]:
    """Median CPU seconds per step of every system, built in this one process and stepped in turn (for shared
    machines)."""
    torch.set_num_threads(case.threads)
    device = resolve_device(case.device)
    return cpu_medians_in_turn({s: _synchronized(_step_fn(s, case, *_workload(case, s)), device) for s in systems},
                               steps, warmup)


def _address_space_limit(limit: int) -> Callable[[], None]:
    """A ``preexec_fn`` capping the child's address space at ``limit`` bytes: past it an allocation fails in
    that process alone (MemoryError or a refused allocation), not the machine."""

    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    return apply


def measure(system: str, case: Case, warmup: int = 3, steps: int = 10, timeout: float = 3600,
            steady_heap: bool = False, memory_limit: int | None = None) -> dict[str, Any]:
    """Run ``worker`` in a fresh process (``system`` "a+b+...": ``interleaved_worker``), with ``STEADY_HEAP`` if
    ``steady_heap`` and its address space capped at ``memory_limit`` bytes if given (CPU only: CUDA reserves
    far more address space than it uses); a failure becomes {"error": ...}."""
    cmd = [sys.executable, "-m", "dpopt.bench", "--worker", system, "--case", json.dumps(dataclasses.asdict(case)),
           "--warmup", str(warmup), "--steps", str(steps)]
    env = {**os.environ, **STEADY_HEAP} if steady_heap else None
    limit = _address_space_limit(memory_limit) if memory_limit else None
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, preexec_fn=limit)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    if done.returncode != 0:
        lines = [ln for ln in done.stderr.strip().splitlines() if ln.strip()]
        return {"error": lines[-1] if lines else f"exit code {done.returncode}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def compare(case: Case, systems: tuple[str, ...] = DEFAULT_SYSTEMS, warmup: int = 3, steps: int = 10,
            repeats: int = 1, interleave: bool = False, steady_heap: bool = False) -> dict[str, dict[str, Any]]:
    """All systems on one case, with ratios to non-private PyTorch. With ``repeats`` > 1 the systems run in
    turn that many times (a fresh process each) and each keeps its fastest run, so a burst of load from
    another process slows one sample rather than one system. ``interleave`` adds ``interleaved_cpu_s``: the
    systems that ran, stepped in turn in one more process (``interleaved_worker``). ``steady_heap``: see
    ``measure``."""
    results: dict[str, dict[str, Any]] = {}
    for _ in range(repeats):
        for s in systems:
            r = measure(s, case, warmup, steps, steady_heap=steady_heap)
            if s not in results or "error" in results[s] or r.get("s_per_step", float("inf")) < results[s]["s_per_step"]:
                results[s] = r
    ran = tuple(s for s, r in results.items() if "error" not in r)
    if interleave and "pytorch" in ran:
        together = measure("+".join(ran), case, warmup, steps, steady_heap=steady_heap)
        for s in ran:
            results[s]["interleaved_cpu_s"] = together.get(s)
    base = results.get("pytorch", {})
    for r in results.values():
        if "error" not in r and "error" not in base and base:
            r["time_ratio"] = r["s_per_step"] / base["s_per_step"]
            r["cpu_ratio"] = r["cpu_s_per_step"] / base["cpu_s_per_step"]
            r["peak_ratio"] = r["peak_mb"] / base["peak_mb"]
            if r.get("interleaved_cpu_s") and base.get("interleaved_cpu_s"):
                r["interleaved_ratio"] = r["interleaved_cpu_s"] / base["interleaved_cpu_s"]
    return results


def count_ops(system: str, case: Case) -> dict[str, Any]:
    """The third step's counts of ``system`` on ``case`` (``dpopt.launches``), built and run in this process with
    the accelerator's settings; a failure becomes {"error": ...}."""
    from dpopt import launches

    try:
        with launches.accelerator_settings():
            count = launches.count_step(_step_fn(system, case, *_workload(case, system)))
    except Exception as e:  # as ``measure``: one system's failure is a row of the table
        return {"error": f"{type(e).__name__}: {e}"}
    return {"aten_ops": count.aten_ops, "launching_ops": count.launching_ops, "host_syncs": count.host_syncs,
            "fp32_copies": count.fp32_copies, "syncs": dict(count.syncs),
            "most_launched": dict(count.launching.most_common(10))}


def count_all(case: Case, systems: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """``count_ops`` of every system, with ``launch_ratio``: its launching operations over PyTorch's."""
    results = {s: count_ops(s, case) for s in systems}
    base = results.get("pytorch", {}).get("launching_ops")
    for r in results.values():
        if "error" not in r and base:
            r["launch_ratio"] = r["launching_ops"] / base
    return results


def count_markdown(label: str, results: dict[str, dict[str, Any]]) -> str:
    lines = ["| workload | system | aten ops | launching ops | launches / PyTorch | host syncs | fp32 copies of 16-bit "
             "tensors |", "|---|---|---|---|---|---|---|"]
    for system, r in results.items():
        if "error" in r:
            lines.append(f"| {label} | {system} | error: {r['error'][:80]} | | | | |")
            continue
        ratio = f"{r['launch_ratio']:.2f}" if "launch_ratio" in r else "—"
        lines.append(f"| {label} | {system} | {r['aten_ops']} | {r['launching_ops']} | {ratio} | {r['host_syncs']} "
                     f"| {r['fp32_copies']} |")
    return "\n".join(lines)


def markdown(rows: list[tuple[str, dict[str, dict[str, Any]]]]) -> str:
    lines = ["| workload | system | s/step | time / PyTorch | CPU s/step | CPU time / PyTorch | CPU time / PyTorch, "
             "interleaved | peak tensor MB | memory / PyTorch | peak RSS MB | page faults / step |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for label, results in rows:
        for system, r in results.items():
            if "error" in r:
                lines.append(f"| {label} | {system} | error: {r['error'][:80]} | | | | | | | | |")
                continue
            ratio = lambda k: f"{r[k]:.2f}" if r.get(k) is not None else "—"  # noqa: E731
            lines.append(f"| {label} | {system} | {r['s_per_step']:.3f} | {ratio('time_ratio')} | "
                         f"{r['cpu_s_per_step']:.3f} | {ratio('cpu_ratio')} | {ratio('interleaved_ratio')} | "
                         f"{r['peak_mb']:.1f} | {ratio('peak_ratio')} | {r['rss_mb']:.0f} | {r['faults_per_step']:.0f} |")
    return "\n".join(lines)


SUITE = [Case("cnn", 256), Case("cnn", 1024), Case("bert", 32), Case("bert", 64)]
SCALING = ([Case("cnn", b) for b in (64, 256, 1024, 2048)] + [Case("bert", b) for b in (8, 16, 32, 64)]
           + [Case("bert", 16, s) for s in (32, 64, 128, 256)])


def _workload_argument(text: str) -> str:
    """``check_workload`` as an argparse type."""
    try:
        return check_workload(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", type=_workload_argument, metavar="NAME",
                   help=f"the model and data shape: {', '.join(WORKLOADS)}, or a causal language model's size: "
                        f"{', '.join(model_shapes.SHAPES)} (default: {DEFAULT_WORKLOAD}, unless --suite or --scaling)")
    p.add_argument("--batch", type=int, help="examples per step (default: " +
                   ", ".join(f"{w} {b}" for w, b in DEFAULT_BATCH.items()) + f", language models {LM_BATCH})")
    p.add_argument("--seq", type=int, help=f"sequence length (default: bert, bert-base, minilm 64; language models "
                                           f"{LM_SEQ})")
    p.add_argument("--optimizer", choices=["sgd", "adam"], default="sgd", help="base optimizer of every system")
    p.add_argument("--rank", type=int, default=16, help="projection rank of dp-grape, dp-galore and galore")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads of each measured process (1: fair on a shared machine, where waiting "
                        "OpenMP threads slow some systems more than others)")
    p.add_argument("--physical-batch-size", type=int, metavar="N",
                   help="dpopt systems: process the batch in chunks of N examples (one release per step)")
    add_device_arguments(p, precision="fp32")
    p.add_argument("--graph", choices=GRAPH_CHOICES, default="off",
                   help="dpopt's systems: capture the forward, backward and clip stage as CUDA graphs (on, auto, off)")
    p.add_argument("--systems", nargs="+", choices=SYSTEMS,
                   help=f"what to time (default: {' '.join(DEFAULT_SYSTEMS)}; Opacus's where it is installed)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--steps", type=int, default=10, help="timed steps, whose median is reported")
    p.add_argument("--repeats", type=int, default=1, help="run the systems in turn this many times; keep each one's fastest")
    p.add_argument("--interleave", action=argparse.BooleanOptionalAction, default=True,
                   help="also time the systems stepped in turn in one process (CPU time: the fair comparison on a "
                        "shared machine)")
    p.add_argument("--steady-heap", action="store_true",
                   help="run every system with a glibc heap that keeps freed memory (few page faults from step to step)")
    p.add_argument("--suite", action="store_true", help="the issue's table: cnn 256/1024, bert 32/64 (seq 64)")
    p.add_argument("--scaling", action="store_true", help="pytorch vs dpopt over batch size and sequence length")
    p.add_argument("--count-ops", action="store_true",
                   help="time nothing: count each system's third step's aten operations, kernel-launching ones and "
                        "host syncs, on the CPU with the accelerator's settings (one workload)")
    p.add_argument("--json", action="store_true", help="print one JSON object (single workload)")
    p.add_argument("--out", help="folder for bench.json and bench.md")


COUNTED = ("counted: each system's third step (after 2 warm-up steps), in one process on the CPU with the "
           "accelerator's settings (chunk budget 2^24 elements, foreach optimizers, 1 thread); launching ops: those "
           "that launch a kernel on a GPU (dpopt/launches.py)")


def method(args: argparse.Namespace) -> str:
    """How this bench measures, for its output."""
    if args.count_ops:
        return COUNTED
    line = (f"measured: {args.threads} torch thread{'s' * (args.threads > 1)} per system, each system in its own "
            f"process (median of {args.steps} steps after {args.warmup} warm-up)")
    if args.interleave:
        return line + ("; then all systems stepped in turn in one process: the 'interleaved' CPU-time ratio is the "
                       "fair comparison on a shared machine (docs/performance.md)")
    return line + "; not interleaved (--no-interleave): on a shared machine, load from other processes may fall on " \
                  "one system more than another"


def _installed(systems: tuple[str, ...]) -> tuple[str, ...]:
    """``systems`` without Opacus's where Opacus is not installed, saying so."""
    if importlib.util.find_spec("opacus") is not None:
        return systems
    print("opacus-hooks and opacus-ghost left out: Opacus is not installed (pip install 'dpopt[experiments]')",
          file=sys.stderr)
    return tuple(s for s in systems if not s.startswith("opacus"))


def run(args: argparse.Namespace) -> int:
    device = resolve_device(args.device)
    autocast_dtype(args.precision, device)  # bad input: one line, before anything is printed
    if args.graph == "on" and device.type != "cuda":
        raise ValueError("--graph on captures CUDA graphs: it needs --device cuda")
    if args.batch is not None and args.batch < 1:
        raise ValueError(f"--batch must be at least 1, got {args.batch}")
    if args.count_ops and (args.suite or args.scaling or args.out):
        raise ValueError("--count-ops counts one workload and prints its counts: not with --suite, --scaling or --out")
    if args.suite or args.scaling:
        cases = [dataclasses.replace(c, threads=args.threads, device=args.device, precision=args.precision,
                                     graph=args.graph) for c in (SUITE if args.suite else SCALING)]
    else:
        workload = args.workload or DEFAULT_WORKLOAD
        language_model = is_language_model(workload)
        batch = args.batch or (LM_BATCH if language_model else DEFAULT_BATCH[workload])
        seq = args.seq or (LM_SEQ if language_model else Case.seq)
        cases = [Case(workload, batch, seq, args.optimizer, args.rank, args.threads, args.physical_batch_size,
                      args.device, args.precision, args.graph)]
    scaling = args.scaling and not args.suite
    systems = ("pytorch", "dpopt") if scaling else tuple(args.systems or _installed(DEFAULT_SYSTEMS))
    if any(s.startswith("opacus") for s in systems):
        require("opacus", "experiments", f"--systems {' '.join(s for s in systems if s.startswith('opacus'))}")
    print(method(args), file=sys.stderr if args.json else sys.stdout, flush=True)
    if args.count_ops:
        counts = count_all(cases[0], systems)
        print(json.dumps(counts) if args.json else count_markdown(cases[0].label, counts))
        return 0
    rows = []
    for case in cases:
        rows.append((case.label, compare(case, systems, args.warmup, args.steps, args.repeats, args.interleave,
                                         args.steady_heap)))
        if not args.json:
            print(markdown(rows[-1:]).split("\n", 2)[-1] if len(rows) > 1 else markdown(rows[-1:]), flush=True)
    if args.json:
        print(json.dumps(rows[0][1] if len(rows) == 1 else {label: r for label, r in rows}))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench.json").write_text(json.dumps({label: r for label, r in rows}, indent=2))
        (out / "bench.md").write_text(f"{method(args)}\n\n{markdown(rows)}\n")
    return 0


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--worker", required=True, help="a system, or systems joined by + (interleaved)")
    p.add_argument("--case", required=True)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    a = p.parse_args()
    case = Case(**json.loads(a.case))
    if "+" in a.worker:
        print(json.dumps(interleaved_worker(tuple(a.worker.split("+")), case, a.warmup, a.steps)))
    else:
        print(json.dumps(worker(a.worker, case, a.warmup, a.steps)))
