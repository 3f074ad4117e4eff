"""The captured clip stage (``dpopt.grad.graphs``), checked on the CPU with ``Rerun`` (a replay that runs the captured
function again into the same outputs): a run with capture equals the eager run in float64 (every clipping mode, one
pass or physical batches, a non-finite example, a repeated token), the captured function reads nothing, each
batch's status is read once, a replay that differs from the eager step is caught before it is used, and capture
where it cannot work is refused or falls back. The CUDA graph itself: ``test_a_cuda_graph_replay_equals_the_eager_step``
(skipped without CUDA)."""

import math
import re

import pytest
import torch
from torch import nn

from dpopt import hyperparameters_for
from dpopt.algorithms import Privatizer, build_algorithm
from dpopt.clipping import Clipping
from dpopt.data.samplers import PoissonSampler
from dpopt.grad.engine import PerExampleEngine
from dpopt.grad.graphs import CHECKS, CaptureError, Rerun
from dpopt.noise.gaussian import GaussianNoise
from dpopt.noise.rng import SecretStream
from dpopt.privacy import PrivacyLedger
from helpers import Zoo, zoo_loss
from test_host_syncs import counting_syncs
from test_sync_free_step import zoo_data

N = 64


def zoo_dataset(device="cpu", dtype=torch.float64):
    tokens, images, y = zoo_data()  # example 5 is non-finite, example 3 repeats one token
    noise = torch.randn(N, 1, 1, 1, dtype=torch.float64)
    return tokens.repeat(8, 1).to(device), (images.repeat(8, 1, 1, 1) + noise).to(device, dtype), y.repeat(8).to(device)


def zoo_step(recipe="dp-sgd", mode="flat", physical=None, device="cpu", dtype=torch.float64):
    torch.manual_seed(1)
    engine = PerExampleEngine(Zoo().to(device, dtype), zoo_loss)
    privatizer = Privatizer(Clipping(0.1, mode), GaussianNoise(1.0, 0.1, SecretStream(1, "noise")),
                            PoissonSampler.with_batch_size(N, 16, SecretStream(2, "sampling")), PrivacyLedger())
    return build_algorithm(recipe, engine, privatizer, hyperparameters_for(recipe, lr=0.05), physical)


def close(got, want, rtol=1e-9, atol=1e-12):
    return all(torch.allclose(g, w, rtol=rtol, atol=atol) for g, w in zip(got, want))


@pytest.mark.parametrize("mode, physical", [("flat", None), ("per-layer", 10), ("automatic", 10)])
def test_a_replayed_run_is_the_eager_run(mode, physical):
    data = zoo_dataset()
    runs = []
    for capture in (False, True):
        step = zoo_step("dp-adam", mode, physical)
        if capture:
            step.capture("on", replayed=Rerun)
        results = [step.step(data) for _ in range(2)]
        runs.append((results, [p.detach().clone() for p in step.params], step))
    (eager, eager_params, _), (replayed, replayed_params, step) = runs
    assert step.captured.replays >= 2 and step.captured.enabled
    assert [(r.examples, r.nonfinite, r.clipped) for r in replayed] == [(r.examples, r.nonfinite, r.clipped)
                                                                        for r in eager]
    assert any(r.nonfinite for r in eager)  # the non-finite example was sampled
    assert all(math.isclose(a.loss, b.loss, rel_tol=1e-9) for a, b in zip(eager, replayed))
    assert close(replayed_params, eager_params)


def test_the_captured_function_reads_nothing_and_a_replayed_batch_is_read_once():
    data = zoo_dataset()
    step = zoo_step(physical=10)
    step.capture("on", replayed=Rerun)
    step.step(data)  # captures and checks
    captured = step.captured
    with counting_syncs() as syncs:
        captured._static(*_static_inputs(captured))
    assert sum(syncs.values()) == 0, syncs
    for key in captured._checked:
        captured._checked[key] = 2  # checked: a replay is now one read
    index = step.privatizer.batch(0)  # the shapes captured and checked
    with counting_syncs() as syncs:
        step.clipped_sums(data, index)
    parts = math.ceil(index.numel() / 10)
    assert syncs["tolist"] == parts and sum(syncs.values()) == parts, syncs


def _static_inputs(captured):
    """The static batch and mask of the first graph captured (a ``Rerun``'s function's arguments)."""
    _, graph = next(iter(captured._graphs.values()))
    closure = graph.fn.__closure__
    cells = {type(c.cell_contents).__name__: c.cell_contents for c in closure}
    return cells["tuple"], cells["Tensor"]


class Stale:
    """A broken capture: its replays leave the outputs of the batch it was captured on."""

    def __init__(self, fn):
        self.outputs = fn()

    def replay(self):
        pass


def test_a_replay_that_differs_from_the_eager_step_is_never_used():
    data = zoo_dataset()
    eager = zoo_step()
    want, snapshots = [], []
    for _ in range(4):
        want.append(eager.step(data))
        snapshots.append([p.detach().clone() for p in eager.params])
    logged = []
    step = zoo_step()
    step.capture("auto", log=logged.append, replayed=Stale)
    got = [step.step(data) for _ in range(4)]
    assert not step.captured.enabled and len(logged) == 1 and "differs from the eager step" in logged[0]
    assert [(r.examples, r.loss) for r in got] == [(r.examples, r.loss) for r in want]
    assert close(step.params, snapshots[-1])
    strict = zoo_step()
    strict.capture("on", replayed=Stale)
    with pytest.raises(CaptureError, match="differs from the eager step"):
        for _ in range(4):
            strict.step(data)
    released = strict.privatizer.ledger.steps  # the step whose replay differed released nothing
    assert released < 4 and close(strict.params, snapshots[released - 1] if released else eager_start())


def eager_start():
    return [p.detach().clone() for p in zoo_step().params]


def test_capture_is_refused_or_falls_back_where_it_cannot_work():
    step = zoo_step()
    with pytest.raises(ValueError, match="graph 'on' cannot work here: CUDA graphs need a CUDA device"):
        step.capture("on")
    with pytest.raises(ValueError, match="unknown graph choice 'always'"):
        step.capture("always")
    logged = []
    step.capture("auto", log=logged.append)  # on a CPU: eager, nothing to fall back from
    assert step.captured is None and not step.static_shapes and not logged
    for step, reason in ((zoo_step("disk-adam"), "the recipe's statistic (two points"),
                         (zoo_step("dpzero"), "the recipe's statistic (two points, a projection or zeroth-order)")):
        with pytest.raises(ValueError, match=re.escape(f"graph 'on' cannot work here: {reason}")):
            step.capture("on")


def test_a_model_with_dropout_is_checked_from_the_replays_random_state():
    """The eager comparison starts from the random state the replay started from: the same dropout masks, so the
    check passes (and the run's random stream goes on from the replay's end)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.5), nn.Linear(16, 2)).double()
    engine = PerExampleEngine(model, lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1], reduction="none"))
    privatizer = Privatizer(Clipping(0.1), GaussianNoise(1.0, 0.1, SecretStream(1, "noise")),
                            PoissonSampler.with_batch_size(N, 16, SecretStream(2, "sampling")), PrivacyLedger())
    step = build_algorithm("dp-sgd", engine, privatizer, hyperparameters_for("dp-sgd", lr=0.05))
    step.capture("on", replayed=Rerun)
    data = (torch.randn(N, 4, dtype=torch.float64), torch.randint(0, 2, (N,)))
    for _ in range(3):
        step.step(data)
    assert step.captured.enabled and step.captured.replays == 3
    assert sum(step.captured._checked.values()) == CHECKS * len(step.captured._checked)  # each graph checked


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("physical", [None, 10])
def test_a_cuda_graph_replay_equals_the_eager_step(physical):
    data = zoo_dataset("cuda", torch.float32)
    runs = []
    for capture in (False, True):
        step = zoo_step("dp-adam", "flat", physical, "cuda", torch.float32)
        if capture:
            step.capture("on")
        results = [step.step(data) for _ in range(4)]
        runs.append((results, [p.detach().clone() for p in step.params], step))
    (eager, eager_params, _), (replayed, replayed_params, step) = runs
    assert step.captured.enabled and step.captured.replays >= 4
    assert [r.examples for r in replayed] == [r.examples for r in eager]
    assert close(replayed_params, eager_params, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("argv, says", [
    (["--graph", "on"], "--graph on captures the step as a CUDA graph: it needs --device cuda"),
    (["--graph", "always"], "argument --graph: invalid choice 'always'"),
])
def test_graph_on_where_capture_cannot_work_is_one_line_before_training(argv, says, capsys):
    from dpopt.cli import main
    with pytest.raises(SystemExit) as exit:
        main(["train", "--epochs", "1", *argv])
    err = capsys.readouterr().err
    assert exit.value.code == 2 and err.startswith("dpopt: error: ") and says in err.splitlines()[0]


def test_the_captured_function_runs_one_trace_whatever_its_data():
    """What a CUDA graph records must not depend on the data: the same launching operations on the same shapes, and
    no host read, for clean data, an embedding token repeated through an example and a non-finite example."""
    from dpopt import launches
    from dpopt.grad.graphs import CapturedClip
    from helpers import Tokens, weighted_loss

    torch.manual_seed(0)
    n = 8
    tokens, y, s = torch.randint(0, 11, (3 * n, 5)), torch.randint(0, 3, (3 * n,)), torch.ones(3 * n)
    tokens[n + 3] = 7
    s[2 * n + 1] = float("nan")
    with launches.accelerator_settings():
        captured = CapturedClip(PerExampleEngine(Tokens(), weighted_loss, strategy="ghost"), Clipping(0.1), eager=None)
        mask = torch.ones(n)
        captured._static((tokens[:n], y[:n], s[:n]), mask)  # warm-up
        traces = []
        for k in range(3):
            part = slice(k * n, (k + 1) * n)
            with launches.tracing() as trace:
                captured._static((tokens[part], y[part], s[part]), mask)
            traces.append(trace)
    assert traces[0] == traces[1] == traces[2] and not any(op.sync for op in traces[0])
