"""Kernel launches per step, counted on the CPU (dpopt.launches; docs/performance.md "Counting launches on the CPU").

On a GPU dpopt's step is bound by kernel launches. These tests count the launching aten operations of the third
step with the accelerator's settings and ratchet them, with the host syncs: a change that adds launches or syncs fails
here. Lower a bound when a reduction lands. A step is capture-ready when data that differs only in its values (a
non-finite example, repeated tokens) leaves its trace unchanged up to the clip stage's one read, and after it where
every example is finite; a non-finite example or a cancelling ghost norm is handled by a rare eager pass after it."""

import functools
import importlib.util
import json
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpopt import bench, launches
from dpopt.algorithms.base import PrivateStep, Privatizer
from dpopt.cli import main
from dpopt.clipping import Clipping
from dpopt.data.samplers import FixedOrderSampler
from dpopt.grad import captures
from dpopt.grad.engine import PerExampleEngine
from dpopt.noise.gaussian import GaussianNoise
from dpopt.noise.rng import SecretStream
from dpopt.privacy import PrivacyLedger
from helpers import Tokens, weighted_loss

# dpopt's launching operations per step, at most: each bound is the measured count (docs/performance.md).
LAUNCH_BOUNDS = {
    "cnn b64": 82,  # PyTorch: 32
    "mlp depth 8 b64": 91,  # PyTorch: 55
    "bert b4 s16": 682,  # PyTorch: 452
}
# Extra launching operations per added Linear + Tanh (MLP of depth 8 vs 2, width 64), at most: the measured count
# (91 - 49) / 6 = 7 (PyTorch: 6).
PER_LAYER_BOUND = (91 - 49) / 6
# dpopt's host syncs per step: the clip stage's one read (Hugging Face's BERT adds its own attention-mask check).
SYNC_BOUNDS = {"cnn b64": 1, "mlp depth 8 b64": 1, "bert b4 s16": 2}
DEPTHS = (2, 8)
# float32 copies of 16-bit tensors per bf16 step that dpopt adds to PyTorch's own autocast copies, at most (measured:
# 2 on a 2-layer BERT and on the 6-layer BERT-shaped workload at b4 s16, whose PyTorch step makes 126).
UPCAST_BOUND = 10


def mlp(depth: int) -> nn.Module:
    layers = [nn.Flatten(), nn.Linear(784, 64), nn.Tanh()]
    for _ in range(depth - 2):
        layers += [nn.Linear(64, 64), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(64, 10))


def _loss(model, batch):
    return F.cross_entropy(model(batch[0]), batch[1], reduction="none")


@functools.lru_cache
def workload_count(workload: str, batch: int, seq: int = 64) -> launches.StepCount:
    """dpopt's third step on a bench workload, counted with the accelerator's settings."""
    case = bench.Case(workload, batch, seq)
    with launches.accelerator_settings():
        return launches.count_step(bench._step_fn("dpopt", case, *bench._workload(case, "dpopt")))


def small_bert_bf16_count(system: str) -> launches.StepCount:
    """A system's third step on a 2-layer BERT (hidden 32) with bf16 autocast, counted with the accelerator's
    settings."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2,
                                                     num_attention_heads=2, intermediate_size=64))
    data = {"input_ids": torch.randint(0, 100, (4, 16)), "labels": torch.randint(0, 2, (4,))}

    def loss(m, b):
        return F.cross_entropy(m(input_ids=b["input_ids"]).logits, b["labels"], reduction="none")

    with launches.accelerator_settings():
        return launches.count_step(bench._step_fn(system, bench.Case("bert", 4, 16, precision="bf16"), model, data,
                                                  loss))


@functools.lru_cache
def mlp_count(depth: int) -> launches.StepCount:
    torch.manual_seed(0)
    data = (torch.randn(64, 1, 28, 28), torch.randint(0, 10, (64,)))
    with launches.accelerator_settings():
        return launches.count_step(bench._step_fn("dpopt", bench.Case("mlp", 64), mlp(depth), data, _loss))


def _within(count: launches.StepCount, case: str) -> None:
    bound = LAUNCH_BOUNDS[case]
    assert count.launching_ops <= bound, \
        f"{count.launching_ops} launching ops per step, bound {bound}; most launched: {count.launching.most_common(8)}"
    assert count.host_syncs <= SYNC_BOUNDS[case], dict(count.syncs)


def test_cnn_launches_per_step_stay_within_the_bound():
    _within(workload_count("cnn", 64), "cnn b64")


def test_deep_mlp_launches_per_step_stay_within_the_bound():
    _within(mlp_count(DEPTHS[1]), f"mlp depth {DEPTHS[1]} b64")


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers is not installed")
def test_bert_launches_per_step_stay_within_the_bound():
    _within(workload_count("bert", 4, 16), "bert b4 s16")


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers is not installed")
def test_a_bf16_step_adds_few_float32_copies():
    private, plain = (small_bert_bf16_count(system) for system in ("dpopt", "pytorch"))
    assert plain.fp32_copies > 20  # autocast's own: the counter sees upcasts
    assert private.fp32_copies - plain.fp32_copies <= UPCAST_BOUND, (private.upcasts, plain.upcasts)


def test_launches_per_added_linear_layer_are_bounded():
    shallow, deep = (mlp_count(d).launching_ops for d in DEPTHS)
    assert (deep - shallow) / (DEPTHS[1] - DEPTHS[0]) <= PER_LAYER_BOUND


def test_cnn_launches_do_not_depend_on_the_batch_size():
    counts = {b: workload_count("cnn", b).launching_ops for b in (16, 64, 256)}
    assert len(set(counts.values())) == 1, counts


def _two_point(engine, batch):
    """43 g(s') - 42 g(s), s' the batch's fourth tensor: an example with s' = 42/43 s cancels."""
    tokens, y, s, shifted = batch
    return 43.0 * engine.gradients((tokens, y, shifted)) - 42.0 * engine.gradients((tokens, y, s))


def _traces(statistic) -> tuple[list[list[launches.Op]], list[int]]:
    """The traces of four steps after a warm-up one, with the accelerator's settings, and their non-finite
    examples: on clean data; with a token repeated through an example; with a non-finite example too; with an
    example whose two points cancel."""
    torch.manual_seed(0)
    n = 8
    tokens, y, s = torch.randint(0, 11, (5 * n, 5)), torch.randint(0, 3, (5 * n,)), torch.ones(5 * n)
    shifted = s.clone()
    tokens[2 * n + 3] = tokens[3 * n + 3] = 7
    s[3 * n + 1] = float("nan")
    shifted[4 * n + 2] = 42 / 43
    with launches.accelerator_settings():
        engine = PerExampleEngine(Tokens(), weighted_loss, strategy="ghost")
        privatizer = Privatizer(Clipping(0.1), GaussianNoise(1.0, 0.1, SecretStream(1, "noise")),
                                FixedOrderSampler(5 * n, n, SecretStream(2, "sampling")), PrivacyLedger())
        opt = PrivateStep(engine, privatizer, torch.optim.SGD(engine.params, lr=0.1), statistic=statistic,
                          verify=False)
        opt.step((tokens, y, s, shifted))
        traces, nonfinite = [], []
        for _ in range(4):
            with launches.tracing() as trace:
                nonfinite.append(opt.step((tokens, y, s, shifted)).nonfinite)
            traces.append(trace)
    return traces, nonfinite


@pytest.mark.parametrize("statistic", [None, _two_point], ids=["gradient", "two-point"])
def test_a_step_is_capture_ready_whatever_its_data(statistic):
    """Capture-readiness: two steps whose data differ by an embedding token repeated through an example run the same
    launching operations on tensors of the same shapes (one CUDA graph could replay both), with one host sync, the
    clip stage's read, and no zeroing of non-finite entries. A non-finite example changes nothing up to that read;
    after it the sums zero the non-finite entries (a rare eager pass, no other read). An example whose two points
    cancel changes nothing up to that read either; after it comes the exact recomputation of its ghost norm, with
    two more reads."""
    (clean, repeated, odd, cancelling), nonfinite = _traces(statistic)
    assert nonfinite == [0, 0, 1, 0] and [op.name for op in clean if op.sync] == ["tolist"]
    read = read_at(clean)
    assert repeated == clean and not any(op.name.startswith("nan_to_num") for op in clean[read:])
    assert odd[:read] == clean[:read] and sum(op.sync for op in odd) == 1
    assert any(op.name.startswith("nan_to_num") for op in odd[read:])
    if statistic is not None:
        assert cancelling[:read] == clean[:read] and sum(op.sync for op in cancelling) == 3


def read_at(trace: list[launches.Op]) -> int:
    """The position just after a trace's first host sync."""
    return next(k for k, op in enumerate(trace) if op.sync) + 1


def test_views_launch_nothing_and_host_syncs_are_seen():
    t = torch.arange(6.0)
    with launches.counting() as count:
        u = t.view(2, 3).t().unsqueeze(0).expand(2, 3, 2)
        (u * 2).sum()
        t[t > 2]  # a boolean mask: a sync
        t[torch.tensor([0, 2])]  # integer indices: none
        t.nonzero()
        t[0].item()
        t.tolist()
    assert count.launching == Counter({"mul": 1, "sum": 1, "gt": 1, "index": 2, "nonzero": 1})
    assert count.syncs == Counter({"index": 1, "nonzero": 1, "_local_scalar_dense": 1, "tolist": 1})
    assert (count.aten_ops, count.launching_ops, count.host_syncs) == (13, 6, 4)


def test_accelerator_settings_are_restored():
    tolist, budget, threads = torch.Tensor.tolist, captures.CHUNK_ELEMENTS, torch.get_num_threads()
    with launches.accelerator_settings():
        assert captures.chunk_elements(torch.device("cpu")) == captures.ACCELERATOR_CHUNK_ELEMENTS
        opt = torch.optim.SGD([torch.zeros(2, requires_grad=True)], lr=0.1)
        opt.param_groups[0]["params"][0].grad = torch.ones(2)
        with launches.counting() as count:
            opt.step()
        assert "_foreach_add_" in count.ops
    assert (torch.Tensor.tolist, captures.CHUNK_ELEMENTS, torch.get_num_threads()) == (tolist, budget, threads)


def test_bench_count_ops_prints_each_systems_counts_and_ratio(capsys):
    assert main(["bench", "--count-ops", "--workload", "mlp", "--batch", "8", "--systems", "pytorch", "dpopt",
                 "--json"]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert captured.err.startswith("counted: each system's third step")
    assert set(out) == {"pytorch", "dpopt"}
    for r in out.values():
        assert r["aten_ops"] >= r["launching_ops"] > 0 and r["host_syncs"] >= 0
    assert out["pytorch"]["launch_ratio"] == 1.0 and out["pytorch"]["host_syncs"] == 0
    assert out["dpopt"]["launch_ratio"] == out["dpopt"]["launching_ops"] / out["pytorch"]["launching_ops"] > 1


@pytest.mark.parametrize("extra,message", [(["--suite"], "not with --suite, --scaling or --out"),
                                           (["--batch", "0"], "--batch must be at least 1, got 0")])
def test_bench_count_ops_refuses_bad_input_in_one_line(extra, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "--count-ops", "--workload", "cnn", *extra])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("dpopt: error: ") and err.count("\n") == 1 and message in err
