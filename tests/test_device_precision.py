"""Devices and precision (issue 21, parts 2-3): bf16 on CPU against fp32, the bad-input errors, and CUDA runs
against CPU runs (skipped without a GPU)."""

import copy

import pytest
import torch

from dpopt import bench
from dpopt.algorithms import SGD, Privatizer, build_algorithm
from dpopt.cli import main
from dpopt.clipping import Clipping, clip_and_sum
from dpopt.data.samplers import FixedOrderSampler
from dpopt.grad.engine import PerExampleEngine
from dpopt.noise.gaussian import GaussianNoise
from dpopt.noise.rng import SecretStream, derive_seed
from dpopt.privacy import PrivacyLedger
from dpopt.run import TrainConfig, train
from tests.helpers import Zoo, quiet, zoo_batch, zoo_loss

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")


def _flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.flatten() for t in tensors])


def _clipped_sums(model: torch.nn.Module, batch, precision: str, strategy: str) -> tuple[list[torch.Tensor], set]:
    grads = PerExampleEngine(model, zoo_loss, strategy=strategy, precision=precision).gradients(batch)
    dtypes = {t.materialize(slice(0, 1)).dtype for ts in grads.terms for _, t in ts}
    return clip_and_sum(grads, Clipping(1.0))[0], dtypes


@pytest.mark.parametrize("strategy", ["ghost", "materialize"])
def test_bf16_clipped_sums_are_fp32_sums_within_bf16_tolerance(strategy):
    """Every layer rule (Zoo) and the torch.func fallback, autocast to bf16: the captures are bf16, the norms and
    clipped sums float32, within bf16's tolerance of the fp32 sums (and not equal to them: autocast ran)."""
    model, batch = Zoo(), zoo_batch(16)
    full, full_dtypes = _clipped_sums(model, batch, "fp32", strategy)
    half, half_dtypes = _clipped_sums(model, batch, "bf16", strategy)
    assert full_dtypes == {torch.float32} and torch.bfloat16 in half_dtypes
    assert all(s.dtype == torch.float32 for s in half)
    error = float((_flat(half) - _flat(full)).norm() / _flat(full).norm())
    assert 0 < error < 1e-2


def test_bf16_digits_run_is_within_one_point_of_fp32_with_the_same_ledger():
    runs = {p: train(TrainConfig(epochs=3, epsilon=2.0, secret_seed=0, precision=p), progress=False, log=quiet)
            for p in ("fp32", "bf16")}
    fp32, bf16 = runs["fp32"], runs["bf16"]
    assert bf16["precision"] == "bf16" and bf16["device"] == "cpu"
    assert bf16["ledger"] == fp32["ledger"] and bf16["epsilon"] == fp32["epsilon"]
    assert bf16["history"][0]["train_loss"] != fp32["history"][0]["train_loss"]  # the forward did run in bf16
    assert abs(bf16["test_accuracy"] - fp32["test_accuracy"]) <= 0.01


BAD = [(["train", "--device", "tpu"], "unknown device 'tpu'"),
       (["train", "--precision", "fp8"], "unknown precision 'fp8'"),
       (["federated", "--epsilon", "1", "--out", "unused", "--device", "tpu"], "unknown device 'tpu'"),
       (["bench", "--workload", "cnn", "--batch", "8", "--device", "tpu"], "unknown device 'tpu'"),
       (["audit", "--device", "tpu"], "unknown device 'tpu'"),
       (["federated", "--epsilon", "1", "--out", "unused", "--engine", "flower", "--device", "cuda"],
        "Flower's clients and server run on the CPU")]
NO_CUDA = [(["train", "--device", "cuda"], "device 'cuda' was requested but this machine has none"),
           (["train", "--precision", "fp16"], "fp16 needs a CUDA device (this run is on cpu); use bf16 on CPU"),
           (["bench", "--workload", "cnn", "--batch", "8", "--precision", "fp16"], "fp16 needs a CUDA device"),
           (["federated", "--epsilon", "1", "--out", "unused", "--device", "cuda"], "device 'cuda' was requested"),
           (["audit", "--device", "cuda"], "device 'cuda' was requested")]


@pytest.mark.parametrize("argv,message", BAD + [pytest.param(*case, marks=no_cuda) for case in NO_CUDA])
def test_bad_device_or_precision_is_one_line_and_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main([*argv, "--no-progress"] if argv[0] == "train" else argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("dpopt: error: ") and err.count("\n") == 1 and message in err


def test_engine_refuses_low_precision_in_vmap_mode_and_fp16_off_cuda():
    model = Zoo()
    with pytest.raises(ValueError, match="runs in fp32 only"):
        PerExampleEngine(model, zoo_loss, mode="vmap", precision="bf16")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="fp16 needs a CUDA device"):
            PerExampleEngine(model, zoo_loss, precision="fp16")


def _step(model: torch.nn.Module, data, precision: str = "fp32", noise: float = 1.0):
    """One DP-SGD step over all of ``data`` (fixed order), secret seed 0; returns the optimizer and the result."""
    n = len(data[2])
    privatizer = Privatizer(Clipping(1.0), GaussianNoise(noise, 1.0, SecretStream(0, "noise")),
                            FixedOrderSampler(n, n, SecretStream(0, "sampling")), PrivacyLedger())
    engine = PerExampleEngine(model, zoo_loss, precision=precision)
    opt = build_algorithm("dp-sgd", engine, privatizer, SGD(lr=0.1))
    return opt, opt.step(data)


@cuda
def test_a_step_on_cuda_is_the_cpu_step_with_noise_drawn_on_the_gpu():
    data = zoo_batch(12)  # stays on the CPU: each physical batch is moved to the model's device
    cpu = Zoo()
    gpu = copy.deepcopy(cpu).cuda()
    grads = [PerExampleEngine(m, zoo_loss).gradients(b) for m, b in
             ((cpu, data), (gpu, tuple(t.cuda() for t in data)))]
    sums = [clip_and_sum(g, Clipping(1.0))[0] for g in grads]
    assert all(s.device.type == "cuda" for s in sums[1])
    torch.testing.assert_close(_flat(sums[1]).cpu(), _flat(sums[0]), rtol=1e-4, atol=1e-5)
    stream = SecretStream(0, "noise")
    noise = stream.normals([torch.Size([5])], 3, "cuda")[0]
    g = torch.Generator(device="cuda").manual_seed(derive_seed(stream._key, 3, 0))  # chunk 0 of step 3
    assert torch.equal(noise, torch.randn(5, generator=g, device="cuda"))  # a device generator, not a CPU copy
    (opt_cpu, res_cpu), (opt_gpu, res_gpu) = _step(cpu, data, noise=0.0), _step(gpu, data, noise=0.0)
    assert res_gpu.examples == res_cpu.examples == 12
    assert opt_gpu.privatizer.ledger.to_dict() == opt_cpu.privatizer.ledger.to_dict()
    torch.testing.assert_close(_flat([p.detach().cpu() for p in gpu.parameters()]),
                               _flat([p.detach() for p in cpu.parameters()]), rtol=1e-4, atol=1e-5)


@cuda
def test_fp16_on_cuda_scales_the_loss_and_an_overflowing_step_is_still_recorded():
    data = zoo_batch(12)
    opt, result = _step(Zoo().cuda(), data, "fp16")
    assert result.nonfinite == 0 and opt.privatizer.ledger.steps == 1
    model, n = Zoo().cuda(), len(data[2])
    privatizer = Privatizer(Clipping(1.0), GaussianNoise(1.0, 1.0, SecretStream(0, "noise")),
                            FixedOrderSampler(n, n, SecretStream(0, "sampling")), PrivacyLedger())
    engine = PerExampleEngine(model, zoo_loss, precision="fp16")
    engine.loss_scale = 2.0 ** 60  # every example's scaled backward overflows fp16
    opt = build_algorithm("dp-sgd", engine, privatizer, SGD(lr=0.1))
    result = opt.step(data)
    assert result.nonfinite == result.examples == n  # all weight 0: the release is the noise alone ...
    assert opt.privatizer.ledger.steps == 1  # ... and it is accounted
    assert all(torch.isfinite(p).all() for p in model.parameters())


@cuda
def test_training_and_bench_run_on_cuda():
    m = train(TrainConfig(epochs=2, epsilon=2.0, secret_seed=0, device="cuda", precision="fp16"), progress=False,
              log=quiet)
    assert m["device"].startswith("cuda") and m["test_accuracy"] > 0.5
    r = bench.measure("dpopt", bench.Case("cnn", 8, threads=1, device="cuda", precision="bf16"), warmup=1, steps=1)
    assert "error" not in r and r["peak_mb"] > 0
