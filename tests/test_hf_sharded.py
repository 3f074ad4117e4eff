"""PrivateTrainer on a model sharded with FSDP2: 2 gloo ranks, launched as torchrun launches them (RANK, WORLD_SIZE,
LOCAL_RANK in the environment, so the Trainer sees 2 processes), each sharding the model with fully_shard, train
the 1-process unsharded PrivateTrainer's run at the same secret seed (parameters, ledger, epsilon, logged loss and
grad_norm) with the model left unwrapped; the Trainer's checkpoint holds the whole model and optimizer state and
resumes exactly; FSDP2's averaging left on, or the clipped sums averaged over the ranks, fail; ranks given different
arguments are refused on every rank, and what a sharded run cannot do in one line. One launch runs every 2-rank
check."""

import dataclasses
import gc
import os
import re

import pytest
import torch
from broken_variants import SHARDED_BROKEN
from helpers import forked_launches
from torch import nn

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("safetensors")
from safetensors.torch import load_file  # noqa: E402
from transformers import TrainingArguments  # noqa: E402

from dpopt.distributed import launch  # noqa: E402
from dpopt.grad.verify import ExampleMixingError  # noqa: E402
from dpopt.hf import PrivacyArguments, PrivateTrainer  # noqa: E402
from dpopt.privacy import PrivacyLedger  # noqa: E402

transformers.logging.set_verbosity_error()
N, T, STEPS = 30, 5, 4
PRIVACY = PrivacyArguments(noise_multiplier=1.0, batch_size=8, clip=0.5, accountant="rdp", secret_seed=3)


class Bag(nn.Module):
    """Token embeddings (41 rows: an uneven split over 2 ranks), a hidden layer and a head, on input_ids."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.hidden, self.head = nn.Embedding(41, 8), nn.Linear(8, 12), nn.Linear(12, 3)

    def forward(self, input_ids: torch.Tensor, **_) -> torch.Tensor:
        return self.head(torch.tanh(self.hidden(self.embed(input_ids))).mean(1))


def bag() -> Bag:
    torch.manual_seed(0)  # the same initial model on every rank
    return Bag()


def examples() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    ids, labels = torch.randint(0, 41, (N, T), generator=g), torch.randint(0, 3, (N,), generator=g)
    return [{"input_ids": ids[i], "labels": labels[i]} for i in range(N)]


def arguments(out, **kw) -> TrainingArguments:
    """AdamW with a linear schedule and max_grad_norm small enough to clip the released gradient; a checkpoint at
    step 2."""
    base = dict(per_device_train_batch_size=2, max_steps=STEPS, learning_rate=0.05, optim="adamw_torch",
                lr_scheduler_type="linear", max_grad_norm=0.5, report_to=[], save_strategy="steps", save_steps=2,
                logging_steps=1, per_device_eval_batch_size=5, use_cpu=True, disable_tqdm=True)
    return TrainingArguments(str(out), **{**base, **kw})


def sharded_bag(world_size: int) -> Bag:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model, mesh = bag(), init_device_mesh("cpu", (world_size,))
    for unit in (model.embed, model.hidden, model.head, model):
        fully_shard(unit, mesh=mesh)
    return model


def run(trainer: PrivateTrainer) -> dict:
    """Train; the whole parameters, the ledger, epsilon, the logged loss and grad_norm, and the evaluation's loss
    (None without an eval_dataset)."""
    trainer.train()
    evaluated = trainer.evaluate()["eval_loss"] if trainer.eval_dataset is not None else None
    whole = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
             for n, p in trainer.model.named_parameters()}
    logged = [(h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "loss" in h]
    return {"params": whole, "ledger": trainer.ledger.to_dict(), "epsilon": trainer.epsilon(), "logged": logged,
            "wrapped": type(trainer.model_wrapped).__name__, "eval_loss": evaluated}


def _ranks(parallel, folder) -> None:
    """Each rank as torchrun starts it: the environment names its rank, and the Trainer sees the 2 processes."""
    os.environ.update(RANK=str(parallel.rank), WORLD_SIZE=str(parallel.world_size), LOCAL_RANK=str(parallel.rank),
                      LOCAL_WORLD_SIZE=str(parallel.world_size), MASTER_ADDR="127.0.0.1")
    torch.set_num_threads(1)
    gc.freeze()  # what is imported by now is not collected again at each train() (accelerate's free_memory)

    def trainer(name: str, privacy: PrivacyArguments = PRIVACY, eval_dataset: list | None = None,
                **kw) -> PrivateTrainer:
        return PrivateTrainer(sharded_bag(parallel.world_size), arguments(folder / name, **kw),
                              train_dataset=examples(), eval_dataset=eval_dataset, privacy=privacy)

    out = {"run": run(trainer("run", eval_dataset=examples()[:10]))}  # evaluated 5 examples per rank
    resumed = trainer("resumed")
    resumed.train(resume_from_checkpoint=str(folder / "run" / "checkpoint-2"))  # rank 0 wrote it, every rank reads it
    out["resumed"] = {n: p.full_tensor() for n, p in resumed.model.named_parameters()}, resumed.ledger.to_dict()
    for variant in ("averaging-left-on", "averaging-reduce-scatter"):
        owner, attribute, replacement = SHARDED_BROKEN[variant]
        original = getattr(owner, attribute)
        setattr(owner, attribute, replacement)  # in this process only, until the variant's run ends
        try:
            out[variant] = run(trainer(variant, save_strategy="no"))
        except ExampleMixingError as e:  # the sharded step's check when train() builds it, before any release
            out[variant] = str(e)
        finally:
            setattr(owner, attribute, original)
    try:  # the private step is built with the train DataLoader
        trainer("differ", dataclasses.replace(PRIVACY, batch_size=8 + parallel.rank)).get_train_dataloader()
        out["differ"] = "no error"
    except ValueError as e:
        out["differ"] = str(e)
    torch.save(out, folder / f"rank{parallel.rank}.pt")


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[dict, object]:
    """The 1-process unsharded PrivateTrainer run, and its folder."""
    folder, threads = tmp_path_factory.mktemp("unsharded"), torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return run(PrivateTrainer(bag(), arguments(folder), train_dataset=examples(), eval_dataset=examples()[:10],
                                  privacy=PRIVACY)), folder
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> tuple[list[dict], object]:
    folder = tmp_path_factory.mktemp("sharded")
    with forked_launches():
        launch(2, _ranks, folder)
    return [torch.load(folder / f"rank{r}.pt") for r in range(2)], folder


def _close(a: dict, b: dict) -> bool:
    return all(torch.allclose(a[k], b[k], rtol=1e-5, atol=1e-6) for k in a)


def test_a_sharded_trainer_run_is_the_unsharded_run(reference, ranks):
    want = reference[0]
    assert PrivacyLedger.from_dict(want["ledger"]).steps == len(want["logged"]) == STEPS
    assert not _close(want["params"], dict(bag().named_parameters()))  # the run moved
    assert any(norm > 0.5 for _, norm in want["logged"])  # max_grad_norm clipped the released gradient
    for got in (r["run"] for r in ranks[0]):
        assert got["wrapped"] == "FSDPBag"  # the model as the rank sharded it: accelerate added no DDP
        assert got["ledger"] == want["ledger"] and got["epsilon"] == want["epsilon"]
        assert got["eval_loss"] == pytest.approx(want["eval_loss"], rel=1e-5)  # every rank evaluates its share
        assert got["params"].keys() == want["params"].keys()
        for name in want["params"]:
            torch.testing.assert_close(got["params"][name], want["params"][name], rtol=1e-5, atol=1e-6, msg=name)
        for (loss, norm), (want_loss, want_norm) in zip(got["logged"], want["logged"], strict=True):
            assert loss == pytest.approx(want_loss, rel=1e-5) and norm == pytest.approx(want_norm, rel=1e-5)


def test_its_checkpoint_holds_the_whole_model_and_optimizer_state(reference, ranks):
    """Rank 0 writes checkpoint-2 as the unsharded run writes it: the whole model's tensors (equal to its), the
    optimizer's state whole (every rank gathered it), the same privacy.json."""
    want_folder, got_folder = reference[1] / "checkpoint-2", ranks[1] / "run" / "checkpoint-2"
    want, got = (load_file(f / "model.safetensors") for f in (want_folder, got_folder))
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)
    want, got = (torch.load(f / "optimizer.pt", weights_only=False) for f in (want_folder, got_folder))
    assert got["secret_key"] == want["secret_key"] and got["ledger"] == want["ledger"]
    for i, state in want["dpopt"]["base"]["state"].items():
        for k, v in state.items():
            torch.testing.assert_close(got["dpopt"]["base"]["state"][i][k], v, rtol=1e-5, atol=1e-6)
    assert (got_folder / "privacy.json").read_text() == (want_folder / "privacy.json").read_text()


def test_a_sharded_trainer_resumes_from_its_checkpoint_exactly(ranks):
    """A fresh sharded Trainer resumed from checkpoint-2 (each rank loads its shards of the whole model and of the
    optimizer's state, the key and the ledger) ends where the uninterrupted run ends."""
    for rank in ranks[0]:
        params, ledger = rank["resumed"]
        assert ledger == rank["run"]["ledger"]
        for name, p in rank["run"]["params"].items():
            torch.testing.assert_close(params[name], p, rtol=0, atol=0, msg=name)


def test_the_trainers_averaging_left_on_or_averaged_sums_fail(reference, ranks):
    """FSDP2's averaging (what the Trainer's data parallelism does) left on in the units the user sharded is
    refused before the first release; clipped sums averaged over the ranks instead of summed make the run differ."""
    for rank in ranks[0]:
        assert rank["averaging-left-on"].startswith("the engine's per-example gradients differ from single-example")
        assert not _close(rank["averaging-reduce-scatter"]["params"], reference[0]["params"])


def test_ranks_given_different_arguments_are_refused_on_every_rank(ranks):
    for rank in ranks[0]:
        assert rank["differ"].startswith("the ranks were given different batch_size: every rank builds the same")


@pytest.fixture
def one_rank(tmp_path):
    """A 1-process gloo group (the Trainer sees one process, as the group does) and a model sharded over it."""
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield lambda: sharded_bag(1)
    finally:
        torch.distributed.destroy_process_group()


def test_what_a_sharded_trainer_cannot_do_is_refused_in_one_line(one_rank, tmp_path, monkeypatch):
    data = examples()
    refused = {
        "the Trainer sees 2 process(es) and the process group 1: launch one Trainer per rank with torchrun":
            dict(world_size=2),
        "gradient_accumulation_steps must be 1": dict(gradient_accumulation_steps=2),
        "save_on_each_node does not apply to a sharded PrivateTrainer": dict(save_on_each_node=True),
        "load_best_model_at_end is not supported for a sharded PrivateTrainer": dict(
            load_best_model_at_end=True, eval_strategy="steps", eval_steps=2),
    }
    for says, kw in refused.items():
        with monkeypatch.context() as patch:
            if "world_size" in kw:
                patch.setattr(TrainingArguments, "world_size", property(lambda self, n=kw["world_size"]: n))
            args = arguments(tmp_path, **{k: v for k, v in kw.items() if k != "world_size"})
            with pytest.raises(ValueError, match=re.escape(says)) as error:
                PrivateTrainer(one_rank(), args, train_dataset=data, eval_dataset=data, privacy=PRIVACY)
            assert "\n" not in str(error.value)
    trainer = PrivateTrainer(one_rank(), arguments(tmp_path), train_dataset=data, privacy=PRIVACY)
    (tmp_path / "checkpoint-2").mkdir()
    with pytest.raises(ValueError, match="resumes from a checkpoint it wrote .model.safetensors.; there is none in"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    grape = dataclasses.replace(PRIVACY, algorithm="dp-grape", hyperparameters={"rank": 2})
    with pytest.raises(ValueError, match="dp-grape cannot train a sharded model: .*; shard dp-sgd, dp-adam"):
        PrivateTrainer(one_rank(), arguments(tmp_path), train_dataset=data, privacy=grape).get_train_dataloader()
