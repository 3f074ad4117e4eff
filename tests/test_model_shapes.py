"""Causal language models of real shapes (``dpopt.model_shapes``) as ``dpopt bench`` workloads: the shapes'
parameter counts, the bad-size error, and every large-model system stepping a tiny model of the same builder."""

import json

import pytest
import torch

from dpopt import bench, model_shapes
from dpopt.cli import main

TINY = {"opt-tiny": model_shapes._opt(32, 2, 4, vocab_size=96, max_position_embeddings=32),
        "llama-tiny": ("llama", {"vocab_size": 96, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                                 "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 32,
                                 "tie_word_embeddings": True}),
        "gpt2-tiny": ("gpt2", {"vocab_size": 96, "n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 32})}


@pytest.mark.parametrize("name, published", [("opt-125m", 125_239_296), ("opt-350m", 331_196_416),
                                             ("opt-1.3b", 1_315_758_080), ("gpt2", 124_439_808)])
def test_shapes_have_the_published_checkpoints_parameter_counts(name, published):
    """Counted on the meta device (no memory): the sizes of facebook/opt-125m, -350m, -1.3b and gpt2."""
    assert model_shapes.parameter_count(name) == published


def test_the_bert_base_workload_has_bert_base_uncased_encoder():
    """``dpopt bench --workload bert-base``: an encoder of bert-base-uncased's 109,482,240 parameters, counted on
    the meta device, under a two-class head."""
    from dpopt.data.datasets import Dataset
    from dpopt.models import bert_base_random

    with torch.device("meta"):
        model = bert_base_random(Dataset("bench", {"labels": torch.zeros(1)}, None, 2))
    assert sum(p.numel() for p in model.bert.parameters()) == 109_482_240
    assert bench.check_workload("bert-base") == "bert-base"

def test_an_unknown_size_is_one_line_listing_the_sizes_with_a_did_you_mean(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "--workload", "opt-1.3", "--systems", "inference"])
    err = capsys.readouterr().err
    first = err.splitlines()[0]
    assert e.value.code == 2 and first.startswith("dpopt: error: argument --workload: unknown model size 'opt-1.3'")
    assert "did you mean 'opt-1.3b'?" in first and all(size in first for size in model_shapes.SHAPES)


@pytest.fixture
def tiny_shapes(monkeypatch):
    for name, shape in TINY.items():
        monkeypatch.setitem(model_shapes.SHAPES, name, shape)


def test_per_example_losses_are_each_sequences_mean_next_token_loss(tiny_shapes):
    """Example i's loss is the loss of sequence i alone: the batch does not mix examples."""
    model = model_shapes.build("opt-tiny").eval()
    ids = torch.randint(0, 96, (3, 10), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    with torch.no_grad():
        together = model_shapes.causal_lm_loss(model, batch)
        alone = [model_shapes.causal_lm_loss(model, {k: v[i:i + 1] for k, v in batch.items()}) for i in range(3)]
    assert together.shape == (3,)
    torch.testing.assert_close(together, torch.cat(alone), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("workload", list(TINY))
def test_every_large_model_system_steps_a_tiny_model_of_the_same_builder(tiny_shapes, workload):
    """Training systems move the weights; inference leaves them and builds no gradient. (DP-GRAPE projects
    ``nn.Linear`` weights: GPT-2's are ``Conv1D``, so it has none to project.)"""
    case = bench.Case(workload, 4, 16, "adam", rank=4, precision="bf16")
    systems = ("inference", "pytorch", "dpopt", "dp-grape", "dpzero", "disk-adam")
    for system in (s for s in systems if not (s == "dp-grape" and workload.startswith("gpt2"))):
        model, data, loss = bench._workload(case, system)
        before = [p.detach().clone() for p in model.parameters()]
        bench._step_fn(system, case, model, data, loss)()
        moved = any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
        assert moved == (system != "inference"), system
        if system == "inference":
            assert all(p.grad is None for p in model.parameters())


def test_dpzero_holds_within_ten_percent_of_inference_on_a_language_model(tiny_shapes):
    """Two forward passes and the direction regenerated in chunks: DPZero's peak is the forward's, whatever the
    direction's size (a stored direction or a perturbed copy would add the model's size again)."""
    case = bench.Case("opt-tiny", 4, 16, "adam", precision="bf16")
    peaks = {s: bench.peak_tensor_mb(bench._step_fn(s, case, *bench._workload(case, s))) for s in ("inference", "dpzero")}
    assert peaks["dpzero"] <= 1.10 * peaks["inference"]


def test_large_models_skips_what_cannot_fit_and_does_not_retry_larger_sizes(tmp_path):
    """Under a cap below every method's floor (parameters times the bytes each must hold) no process starts: the
    smallest size is skipped with its floor, larger sizes are not tried, and the table says none completed."""
    from experiments import large_models

    assert large_models.main(["--sizes", "opt-350m", "opt-125m", "--memory-gb", "0.1", "--out", str(tmp_path)]) == 0
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [r["size"] for r in rows] == ["opt-125m"] * 6 + ["opt-350m"] * 6  # smallest first
    assert all(r["error"].startswith("skipped: needs at least") for r in rows[:6])
    assert all(r["error"] == "not run: failed at a smaller size" for r in rows[6:])
    assert large_models.floor_gb("dpopt", "opt-125m") == 4 * large_models.floor_gb("dpzero", "opt-125m") > 0.1
    assert "| DPZero | none |" in (tmp_path / "table.md").read_text()
