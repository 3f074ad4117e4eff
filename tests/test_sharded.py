"""Sharded private training on FSDP2 with gloo: 2- and 3-process sharded runs are the 1-process unsharded run at
the same secret seed (parameters, ledger), for DP-SGD, DP-Adam, DiSK, per-layer clipping and bf16 autocast; the
sums are summed, not averaged; noise is drawn once per coordinate, by its owner; each rank holds 1/W of the
parameters and optimizer state. One spawn per world size runs every check."""

import dataclasses
import math
import shutil

import pytest
import torch
from broken_variants import SHARDED_BROKEN
from helpers import forked_launches, mlp_loss, quiet
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from dpopt.algorithms import SGD, Adam, DiSKAdam, Privatizer, build_algorithm
from dpopt.clipping import Clipping
from dpopt.data.samplers import PoissonSampler
from dpopt.distributed import launch
from dpopt.grad.engine import PerExampleEngine
from dpopt.grad.verify import ExampleMixingError
from dpopt.noise import rng
from dpopt.noise.gaussian import GaussianNoise
from dpopt.noise.rng import SecretStream
from dpopt.privacy import PrivacyLedger
from dpopt.cli import main
from dpopt.loop import make_private
from dpopt.run import TrainConfig, resume, train
from dpopt.sharded import ShardedStep, device_mesh, refusal, same_order, shard_model

CHUNK = 100  # noise chunks far smaller than the model: chunk boundaries fall inside every rank's shards


@dataclasses.dataclass(frozen=True)
class Run:
    """A recipe at a sample rate and physical batch size (small batches give ranks without examples: weight-0
    rounds), with its clipping mode and forward precision."""

    recipe: str
    hyperparameters: object
    rate: float
    physical: int
    clipping: str = "flat"
    precision: str = "fp32"


RUNS = {"dp-sgd": Run("dp-sgd", SGD(lr=0.5, momentum=0.9), 0.08, 2),
        "dp-adam": Run("dp-adam", Adam(lr=0.02), 0.3, 4),
        "disk-adam": Run("disk-adam", DiSKAdam(lr=0.02), 0.3, 4),  # two points per example, a Kalman filter
        "dp-sgd per-layer": Run("dp-sgd", SGD(lr=0.5), 0.3, 4, clipping="per-layer"),
        "dp-adam bf16": Run("dp-adam", Adam(lr=0.02), 0.3, 4, precision="bf16")}
FP32 = [name for name, run in RUNS.items() if run.precision == "fp32"]
STEPS = 5
TRAIN = TrainConfig(algorithm="disk-adam", model="mlp", epochs=1, batch_size=200, noise_multiplier=1.0,
                    accountant="rdp", secret_seed=3, hyperparameters=DiSKAdam(lr=0.01), checkpoint_every=3)


def _model() -> nn.Module:
    torch.manual_seed(0)  # rows 48 and 5: an uneven split over 2 and 3 ranks (FSDP2 pads the last shard)
    return nn.Sequential(nn.Linear(16, 48), nn.Tanh(), nn.Linear(48, 5))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(60, 16, generator=g) * 3, torch.randint(0, 5, (60,), generator=g)


def _train(name: str, parallel=None) -> tuple[list[torch.Tensor], dict, int, int]:
    """STEPS steps of recipe ``name`` at secret seed 7: (full parameters, ledger, this rank's and the whole
    model's parameter + optimizer-state bytes); sharded over ``parallel``'s ranks if given."""
    step = _step(name, parallel)
    privatizer = step.privatizer
    for _ in range(STEPS):
        step.step(_data())
    local = [t.to_local() if hasattr(t, "to_local") else t for t in _held(step)]
    whole = [t.full_tensor() if hasattr(t, "full_tensor") else t for t in _held(step)]
    params = [p.full_tensor() if hasattr(p, "full_tensor") else p.detach() for p in step.params]
    return params, privatizer.ledger.to_dict(), *(sum(t.numel() * t.element_size() for t in ts)
                                                   for ts in (local, whole))


def _step(name: str, parallel=None):
    """Run ``name``'s step at secret seed 7, on a model sharded over ``parallel``'s ranks if given."""
    run = RUNS[name]
    model = _model()
    if parallel is not None:
        shard_model(model, device_mesh(parallel, torch.device("cpu")))
    privatizer = Privatizer(Clipping(1.0, run.clipping), GaussianNoise(0.8, 1.0, SecretStream(7, "noise")),
                            PoissonSampler(60, run.rate, SecretStream(7, "sampling")), PrivacyLedger(), parallel)
    engine = PerExampleEngine(model, mlp_loss, precision=run.precision)
    step = build_algorithm(run.recipe, engine, privatizer, run.hyperparameters, run.physical)
    return step if parallel is None else ShardedStep(step, run.recipe)


def _nonfinite_run(parallel=None) -> tuple[list[torch.Tensor], dict, int]:
    """Two DP-Adam steps on data where every fifth example has an infinite feature: (parameters, ledger, the
    examples dropped)."""
    step = _step("dp-adam", parallel)
    x, y = _data()
    x[::5, 0] = math.inf
    dropped = sum(step.step((x, y)).nonfinite for _ in range(2))
    return [p.full_tensor() if hasattr(p, "full_tensor") else p.detach() for p in step.params], \
        step.privatizer.ledger.to_dict(), dropped


def _make_private_run(parallel=None) -> tuple[list[torch.Tensor], dict]:
    """make_private's closure loop with DiSK-Adam (the closure taken at two points), on a model its owner shards
    with fully_shard if ``parallel``."""
    model = _model()
    if parallel is not None:
        mesh = init_device_mesh("cpu", (parallel.world_size,))
        for layer in (model[0], model[2], model):
            fully_shard(layer, mesh=mesh)
    model, optimizer, batches = make_private(model, None, _data(), mlp_loss, algorithm="disk-adam", batch_size=12,
                                             noise_multiplier=0.8, epochs=1, physical_batch_size=4, secret_seed=7,
                                             hyperparameters={"lr": 0.02}, parallel=parallel)
    for batch in batches:
        optimizer.step(lambda: mlp_loss(model, batch))
    return [p.full_tensor() if hasattr(p, "full_tensor") else p.detach() for p in model.parameters()], \
        optimizer.ledger.to_dict()


def _held(step) -> list[torch.Tensor]:
    """The parameters, the optimizer's state tensors and the transforms' (DiSK's filter: g~ and d per parameter)."""
    state = [v for s in step.base.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    filters = [v for t in step.transforms for vs in t.state_dict().values() for v in vs or ()]
    return [p.data for p in step.params] + state + filters


def _sharded_runs(parallel, folder) -> None:
    if parallel.world_size == 2:
        parallel.sharded = True  # dpopt train --nproc 2 --shard
        metrics = train(TRAIN, folder / "train", progress=False, log=quiet, parallel=parallel)
        torch.save(metrics, folder / f"train.rank{parallel.rank}.pt")
        if parallel.lead:
            shutil.copytree(folder / "train", folder / "resumed")
        torch.distributed.barrier()
        metrics = resume(folder / "resumed", progress=False, log=quiet, parallel=parallel, epochs=2)
        torch.save(metrics, folder / f"resumed.rank{parallel.rank}.pt")
        parallel.sharded = False
    rng.NOISE_CHUNK = CHUNK
    out = {name: _train(name, parallel) for name in RUNS}
    out["make_private"] = _make_private_run(parallel)
    out["nonfinite"] = _nonfinite_run(parallel)
    step = _step("dp-adam", parallel)
    step.step(_data())
    out["checkpoint"] = step.state_dict()
    try:
        same_order([0, 1] if parallel.lead else [1, 0])
        out["misordered"] = "no error"
    except RuntimeError as e:
        out["misordered"] = str(e)
    for variant, (owner, attribute, replacement) in SHARDED_BROKEN.items():
        original = getattr(owner, attribute)
        setattr(owner, attribute, replacement)  # in this process only, until the variant's run ends
        try:
            out[variant] = _train("dp-sgd", parallel)
        except ExampleMixingError as e:  # the step's own check, before the first release
            out[variant] = str(e)
        finally:
            setattr(owner, attribute, original)
    torch.save(out, folder / f"rank{parallel.rank}.pt")


@pytest.fixture(scope="module")
def reference():
    """The 1-process unsharded runs."""
    chunk, rng.NOISE_CHUNK = rng.NOISE_CHUNK, CHUNK
    try:
        return {**{name: _train(name) for name in RUNS}, "make_private": _make_private_run(),
                "nonfinite": _nonfinite_run()}
    finally:
        rng.NOISE_CHUNK = chunk


@pytest.fixture(scope="module", params=[2, 3])
def sharded(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"sharded{request.param}")
    with forked_launches():
        launch(request.param, _sharded_runs, folder)
    return request.param, [torch.load(folder / f"rank{r}.pt") for r in range(request.param)], folder


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.allclose(x, y, rtol=1e-5, atol=1e-6) for x, y in zip(a, b))


@pytest.mark.parametrize("name", FP32)
def test_a_sharded_run_is_the_unsharded_run(reference, sharded, name):
    world, ranks, _ = sharded
    params, ledger, _, _ = reference[name]
    assert PrivacyLedger.from_dict(ledger).steps == STEPS
    for got, got_ledger, _, _ in (r[name] for r in ranks):
        assert got_ledger == ledger
        for x, y in zip(got, params):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)
    assert not _same(params, _train_start())  # and the run moved


def test_a_bf16_sharded_run_is_the_unsharded_bf16_run_near_the_fp32_one(reference, sharded):
    """bf16 autocast sharded: each example's forward and backward are the unsharded run's, and the norms and the
    clipped sum read the same captured gradients (summed in fp32), so the run is the unsharded bf16 run up to the
    order of fp32 sums (and the bf16 roundings that may follow from it: rtol 1e-4, 20 times below the gap to the
    fp32 run); the bf16 forward moves it visibly, but little, from the fp32 run (atol 2e-3, 10 times that gap)."""
    params, ledger, _, _ = reference["dp-adam bf16"]
    for rank in sharded[1]:
        got, got_ledger, _, _ = rank["dp-adam bf16"]
        assert got_ledger == ledger
        for x, y, z in zip(got, params, rank["dp-adam"][0]):
            torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(x, z, rtol=0.0, atol=2e-3)
        assert not _same(got, rank["dp-adam"][0])  # the forward did run in bf16


def test_make_private_on_a_model_sharded_by_its_owner_is_the_unsharded_run(reference, sharded):
    params, ledger = reference["make_private"]
    assert PrivacyLedger.from_dict(ledger).steps == 5
    for got, got_ledger in (r["make_private"] for r in sharded[1]):
        assert got_ledger == ledger
        for x, y in zip(got, params):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)
    assert not _same(params, _train_start())


def _train_start() -> list[torch.Tensor]:
    return [p.detach() for p in _model().parameters()]


def test_the_equivalence_fails_for_each_broken_variant(reference, sharded):
    """FSDP2's default averaging left on is refused by the step's check before its first release (FSDP2's gradient
    of one example is then 1/W of the engine's); a reduce-scatter of the clipped sums that averages (the sum divided
    by W), or noise added on every rank before the sum (W draws per coordinate), makes the sharded run differ from
    the unsharded one."""
    params = reference["dp-sgd"][0]
    for rank in sharded[1]:
        assert rank["averaging-left-on"].startswith("the engine's per-example gradients differ from single-example")
        assert not _same(rank["averaging-reduce-scatter"][0], params)
        assert not _same(rank["noise-on-every-rank"][0], params)


@pytest.mark.parametrize("name", list(RUNS))
def test_each_rank_holds_a_1_over_w_share_of_parameters_and_optimizer_state(sharded, name):
    world, ranks, _ = sharded
    for _, _, local, whole in (r[name] for r in ranks):
        assert local <= whole / world * 1.05
    assert sum(r[name][2] for r in ranks) == pytest.approx(ranks[0][name][3], rel=0.01)  # every byte held once
    assert math.isfinite(ranks[0][name][3])


@pytest.mark.parametrize("sharded", [2], indirect=True)  # the trainer at one world size; the step at both above
def test_dpopt_train_shard_exports_the_unsharded_runs_model(sharded, tmp_path):
    """`dpopt train --nproc 2 --shard` (the trainer on a sharded model: checkpoints gathered mid-epoch and at its
    end, every rank evaluating) against `dpopt train` at the same secret seed."""
    world, _, folder = sharded
    torch.set_num_threads(1)
    one = train(TRAIN, tmp_path, progress=False, log=quiet)
    many = [torch.load(folder / f"train.rank{r}.pt", weights_only=False) for r in range(world)]
    for metrics in many:
        assert metrics["epsilon"] == one["epsilon"] and metrics["ledger"] == one["ledger"]
        assert metrics["steps"] == one["steps"] > 3
        assert metrics["test_accuracy"] == pytest.approx(one["test_accuracy"], abs=2 / 360)
    want, got = (torch.load(f / "model" / "model.pt") for f in (tmp_path, folder / "train"))
    assert want.keys() == got.keys()
    for k in want:
        assert type(got[k]) is torch.Tensor  # gathered, not a rank's shard
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6)
    saved = torch.load(folder / "train" / "checkpoint.pt", weights_only=False)
    assert saved["optimizer"]["base"]["state"][0]["exp_avg"].shape == want["1.weight"].shape
    assert saved["optimizer"]["transforms"][0]["filtered"][0].shape == want["1.weight"].shape  # DiSK's filter


@pytest.mark.parametrize("sharded", [2], indirect=True)
def test_a_sharded_run_resumes_from_its_checkpoint_exactly(sharded, tmp_path):
    """The 1-epoch sharded run's checkpoint (gathered), resumed sharded to 2 epochs (rank 0 reads it, every rank
    loads its shards of the model and of Adam's state), ends where the unsharded 2-epoch run ends."""
    folder = sharded[2]
    torch.set_num_threads(1)
    one = train(dataclasses.replace(TRAIN, epochs=2), tmp_path, progress=False, log=quiet)
    for rank in range(2):
        metrics = torch.load(folder / f"resumed.rank{rank}.pt", weights_only=False)
        assert metrics["ledger"] == one["ledger"] and metrics["steps"] == one["steps"] == 2 * 7
    want, got = (torch.load(f / "model" / "model.pt") for f in (tmp_path, folder / "resumed"))
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("argv,says", [
    (["--shard"], "--shard splits the model over several processes: add --nproc N (N >= 2)"),
    (["--shard", "--nproc", "2", "--algorithm", "dp-grape"], "dp-grape cannot train sharded yet (--shard trains "
                                                             "dp-sgd, dp-adam, dp-adamw, disk-sgd, disk-adam, "
                                                             "disk-adamw); or drop --shard"),
    (["--shard", "--nproc", "2", "--noise", "banded"], "banded noise is correlated across steps (use --noise gaussian)"),
])
def test_shard_refuses_what_it_cannot_do_in_one_line(argv, says, capsys):
    with pytest.raises(SystemExit) as exit:
        main(["train", "--epochs", "1", *argv])
    err = capsys.readouterr().err
    assert exit.value.code == 2 and err.startswith("dpopt: error: ") and says in err and err.count("\n") == 1


def test_shard_reaches_every_launched_process(monkeypatch):
    from dpopt import cli

    launched = []
    monkeypatch.setattr(cli, "launch", lambda nproc, work, *args: launched.append((nproc, args[-1])))
    assert main(["train", "--nproc", "3", "--shard", "--epochs", "1", "--secret-seed", "3"]) == 0
    assert launched == [(3, True)]


def test_a_sharded_steps_state_is_gathered_on_rank_0_only(sharded):
    """Rank 0 gets every optimizer state tensor whole, in CPU memory (the unsharded format); the other ranks take
    part in each gather and keep nothing."""
    lead, *others = (r["checkpoint"] for r in sharded[1])
    exp_avg = lead["base"]["state"][0]["exp_avg"]
    assert type(exp_avg) is torch.Tensor and exp_avg.device.type == "cpu" and exp_avg.shape == (48, 16)
    assert exp_avg.abs().sum() > 0
    for state in others:
        assert state["steps"] == lead["steps"] == 1
        assert all(v is None for s in state["base"]["state"].values() for k, v in s.items() if k != "step")


def test_sums_reduced_in_different_orders_are_refused_on_every_rank(sharded):
    for rank in sharded[1]:
        assert rank["misordered"].startswith("the ranks reduced the parameters' clipped sums in different orders")


def test_fp16_is_refused_sharded():
    assert refusal("dp-adam", "gaussian", "flat", "fp16") == "--shard trains in fp32 or bf16, not fp16 (use " \
                                                              "--precision bf16)"
    assert refusal("disk-adam", "gaussian", "per-layer", "bf16") is None


def test_an_example_whose_gradient_is_not_finite_is_dropped_as_unsharded(reference, sharded):
    """An example whose norm is not finite gets weight 0 and adds exactly nothing to its rank's sum: the sharded run
    drops it, as the unsharded run does, and goes on."""
    params, ledger, dropped = reference["nonfinite"]
    assert dropped > 0
    for got, got_ledger, got_dropped in (r["nonfinite"] for r in sharded[1]):
        assert (got_ledger, got_dropped) == (ledger, dropped)
        for x, y in zip(got, params):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


def test_a_step_that_cannot_shard_is_refused():
    with pytest.raises(ValueError, match="dp-sgd cannot train a sharded model: it needs a process group"):
        ShardedStep(_step("dp-sgd"), "dp-sgd")
