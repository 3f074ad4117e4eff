"""Data-parallel DP on torch.distributed: two gloo processes reproduce one process (parameters to float
tolerance, epsilon and ledger exactly) for recipes whose statistics have different shapes; noise is added
once; secret randomness drawn on rank 0 keeps the ranks identical even in secure mode."""

import dataclasses

import pytest
import torch
import torch.distributed as dist
from helpers import forked_launches, mlp_loss, quiet
from torch import nn

from dpopt.algorithms import SGD, Adam, DiSKAdam, Privatizer, Projection, build_algorithm
from dpopt.clipping import Clipping
from dpopt.data.samplers import PoissonSampler
from dpopt.grad.engine import PerExampleEngine
from dpopt.noise.gaussian import GaussianNoise
from dpopt.noise.rng import SecretStream
from dpopt.privacy import PrivacyLedger
from dpopt.cli import main
from dpopt import distributed
from dpopt.distributed import DataParallel, device_types, launch
from dpopt.run import TrainConfig, train

BASE = dict(model="mlp", epochs=1, noise_multiplier=1.0, accountant="rdp", secret_seed=0)  # one run, twice
CONFIGS = {
    "dp-sgd": TrainConfig(algorithm="dp-sgd", hyperparameters=SGD(lr=0.5, momentum=0.9), **BASE),
    "disk-adam": TrainConfig(algorithm="disk-adam", hyperparameters=DiSKAdam(lr=0.01), **BASE),  # two-point statistic
    "dp-grape": TrainConfig(algorithm="dp-grape", hyperparameters=Projection(lr=0.01, rank=8), **BASE),  # projected
    "shuffle": TrainConfig(algorithm="dp-adam", sampling="shuffle", hyperparameters=Adam(lr=0.01), **BASE),
}


def _secure_steps(parallel: DataParallel | None, steps: int = 4) -> list[torch.Tensor]:
    """A few secure-mode DP-SGD steps (batch and noise from OS entropy), without the trainer's
    start-of-run parameter broadcast."""
    torch.manual_seed(0)
    model, data = nn.Linear(8, 3), (torch.randn(64, 8), torch.randint(0, 3, (64,)))
    clipping = Clipping(1.0)
    privatizer = Privatizer(clipping, GaussianNoise(1.0, 1.0, SecretStream(None, "noise")),
                            PoissonSampler(64, 0.25, SecretStream(None, "sampling")), PrivacyLedger(), parallel)
    opt = build_algorithm("dp-sgd", PerExampleEngine(model, mlp_loss), privatizer, SGD(lr=0.5))
    for _ in range(steps):
        opt.step(data)
    return [p.detach().clone() for p in model.parameters()]


def _each_config(parallel: DataParallel, folder) -> None:
    for name, config in CONFIGS.items():
        metrics = train(config, folder / name, progress=False, log=quiet, parallel=parallel)
        torch.save(metrics, folder / f"{name}.rank{parallel.rank}.pt")
    torch.save(_secure_steps(parallel), folder / f"secure.rank{parallel.rank}.pt")
    sampler = PoissonSampler(1000, 0.05, SecretStream(None, "sampling"))
    torch.save([parallel.share(sampler, t) for t in range(20)], folder / f"shares.rank{parallel.rank}.pt")


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ddp")
    with forked_launches():
        launch(2, _each_config, folder)
    return folder


@pytest.mark.parametrize("name", ["dp-sgd", "disk-adam", "dp-grape", "shuffle"])
def test_two_processes_match_one(two_processes, name, tmp_path):
    torch.set_num_threads(1)
    one = train(CONFIGS[name], tmp_path, progress=False, log=quiet)
    two = torch.load(two_processes / f"{name}.rank0.pt", weights_only=False)
    other = torch.load(two_processes / f"{name}.rank1.pt", weights_only=False)
    assert two["epsilon"] == one["epsilon"] and two["ledger"] == one["ledger"] == other["ledger"]
    assert two["steps"] == one["steps"] == other["steps"] > 0
    a = torch.load(tmp_path / "checkpoint.pt")["model"]
    b = torch.load(two_processes / name / "checkpoint.pt")["model"]
    for k in a:  # only summation order differs; noise added twice or a different batch would be far off
        torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-6)
    for h1, h2 in zip(one["history"], two["history"]):
        assert h2["train_loss"] == pytest.approx(h1["train_loss"], rel=1e-6)
        assert h2["test_accuracy"] == pytest.approx(h1["test_accuracy"], abs=2 / 360)


def test_secure_mode_keeps_the_ranks_identical(two_processes):
    """OS entropy differs per process: the batch and the noise must come from rank 0 only."""
    a, b = (torch.load(two_processes / f"secure.rank{r}.pt") for r in (0, 1))
    start = _secure_steps(None, steps=0)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not any(torch.equal(x, s) for x, s in zip(a, start))  # and they did train


def test_the_ranks_share_one_global_poisson_batch(two_processes):
    """Secure mode: the shares are the two halves of ONE sorted draw (rank 0's), not halves of two draws."""
    first, second = (torch.load(two_processes / f"shares.rank{r}.pt") for r in (0, 1))
    for a, b in zip(first, second):
        assert abs(len(a) - len(b)) <= 1
        assert len(a) == 0 or len(b) == 0 or int(a.max()) < int(b.min())
    assert sum(len(a) + len(b) for a, b in zip(first, second)) == pytest.approx(20 * 50, rel=0.2)


def test_only_rank_zero_writes(two_processes):
    written = {p.name for p in (two_processes / "dp-sgd").iterdir()} - {"tensorboard"}  # where it is installed
    assert written == {"checkpoint.pt", "curves.png", "metrics.json", "model", "train.log"}


CUDA_CONFIGS = {name: dataclasses.replace(CONFIGS[name], device="cuda") for name in ("dp-sgd", "disk-adam")}


def _group_of_one(rank: int, backend: str | None, store, folder) -> None:
    """One process in a process group of one (``backend`` None: torch's default, NCCL alone on a GPU machine, what
    torchrun users get), training each CUDA config."""
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=1)
    parallel = DataParallel()
    try:
        for name, config in CUDA_CONFIGS.items():
            metrics = train(config, folder / name, progress=False, log=quiet, parallel=parallel)
            torch.save(metrics, folder / f"{name}.pt")
    finally:
        parallel.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("backend", ["nccl", None])
def test_a_cuda_run_in_an_nccl_group_of_one_is_the_plain_cuda_run(backend, tmp_path):
    """The NCCL paths (indices, counts and objects as CUDA tensors; sums reduced on the GPU): a group of one
    must give the run that no group gives (one GPU cannot host two NCCL ranks)."""
    torch.multiprocessing.spawn(_group_of_one, args=(backend, tmp_path / "store", tmp_path), nprocs=1)
    for name, config in CUDA_CONFIGS.items():
        one = train(config, tmp_path / f"plain-{name}", progress=False, log=quiet)
        group = torch.load(tmp_path / f"{name}.pt", weights_only=False)
        assert group["device"].startswith("cuda") and group["steps"] == one["steps"] > 0
        assert group["epsilon"] == one["epsilon"] and group["ledger"] == one["ledger"]
        a = torch.load(tmp_path / f"plain-{name}" / "checkpoint.pt")["model"]
        b = torch.load(tmp_path / name / "checkpoint.pt")["model"]
        for k in a:
            torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("config,types", [("cpu:gloo,cuda:gloo", {"cpu"}), ("cuda:nccl", {"cuda"}),
                                          ("cpu:gloo,cuda:nccl", {"cpu", "cuda"}), ("mps:gloo", set())])
def test_a_group_sends_each_tensor_where_its_backend_carries_it(config, types):
    """Indices and counts go as CPU tensors only where a CPU backend is there: init_process_group() with no backend
    gives an NCCL-only group on a GPU machine ('cuda:nccl'), which refused them on an H200 ('No backend type
    associated with device type cpu'); gloo's CUDA side cannot reduce."""
    assert device_types(config) == types


def test_a_group_that_carries_neither_cpu_nor_cuda_tensors_is_refused(monkeypatch):
    """init_process_group() with no backend on a Mac gives 'mps:gloo': nothing dpopt's collectives can use."""
    for name, value in [("is_initialized", True), ("get_rank", 0), ("get_world_size", 1),
                        ("get_backend_config", "mps:gloo")]:
        monkeypatch.setattr(dist, name, lambda value=value: value)
    with pytest.raises(ValueError, match=r"carry neither CPU nor CUDA tensors; initialise it with backend 'gloo'"):
        DataParallel()


@pytest.mark.parametrize("local_rank,visible,gpu", [("3", 8, 3), ("3", 1, 0), (None, 8, None)])
def test_under_torchrun_each_process_takes_its_local_ranks_gpu(monkeypatch, local_rank, visible, gpu):
    """torchrun --nproc-per-node 8 on 8 GPUs: rank r works on GPU r, not all on GPU 0 (which NCCL refuses); with one
    GPU visible per process (CUDA_VISIBLE_DEVICES), on that one."""
    chosen = []
    monkeypatch.setenv("WORLD_SIZE", "8")
    if local_rank is not None:
        monkeypatch.setenv("LOCAL_RANK", local_rank)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)  # the group itself is not what this test is about
    monkeypatch.setattr(distributed, "DataParallel", lambda: "parallel")
    assert distributed.from_environment() == "parallel"
    assert chosen == ([] if gpu is None else [gpu])


@pytest.mark.parametrize("gpus,backend", [(True, None), (False, "gloo")])
def test_under_torchrun_the_group_is_gloo_unless_there_are_gpus(monkeypatch, gpus, backend):
    """With GPUs: torch's default (NCCL); elsewhere gloo, whose group carries CPU tensors also on a Mac."""
    started = []
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", started.append)
    monkeypatch.setattr(distributed, "DataParallel", lambda: "parallel")
    assert distributed.from_environment() == "parallel" and started == [backend]


def test_bad_parallel_input(monkeypatch, capsys):
    with pytest.raises(ValueError, match="process group"):
        DataParallel()
    with pytest.raises(ValueError, match="number of processes"):
        launch(0, print)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit):
        main(["train", "--nproc", "2", "--epochs", "1"])
    assert "drop --nproc" in capsys.readouterr().err


@pytest.mark.parametrize("rank", [0, 1])
def test_under_torchrun_only_rank_0_reads_the_checkpoint_to_resume(monkeypatch, tmp_path, capsys, rank):
    """Resuming on several machines needs the run folder on rank 0's alone: the other ranks read nothing themselves
    (``resume`` hands them rank 0's checkpoint), so a rank whose machine has no copy starts; rank 0 without one is
    refused in one line."""
    from dpopt import cli

    started = []
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(cli, "from_environment", lambda: None)
    monkeypatch.setattr(cli, "_run_training", lambda *a: started.append(a))
    argv = ["train", "--resume", str(tmp_path / "elsewhere"), "--shard", "--epochs", "4"]
    if rank == 0:
        with pytest.raises(SystemExit) as exit:
            main(argv)
        assert exit.value.code == 2 and "no checkpoint to resume from" in capsys.readouterr().err
        assert not started
    else:
        assert main(argv) == 0
        (parallel, config, out, resume_from, _, epochs, state, shard), = started
        assert (config, resume_from, epochs, state, shard) == (None, str(tmp_path / "elsewhere"), 4, None, True)
