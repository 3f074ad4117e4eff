"""Stock Hugging Face models train with DP with no change to the model or its inputs."""

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from dpopt.algorithms import Privatizer, Projection, build_algorithm  # noqa: E402
from dpopt.clipping import Clipping  # noqa: E402
from dpopt.data.samplers import PoissonSampler  # noqa: E402
from dpopt.grad import PerExampleEngine  # noqa: E402
from dpopt.noise.gaussian import GaussianNoise  # noqa: E402
from dpopt.noise.rng import SecretStream  # noqa: E402
from dpopt.privacy import PrivacyLedger  # noqa: E402

SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
B, T = 6, 10


def seq_loss(model, batch):
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    return F.cross_entropy(out.logits, batch["labels"], reduction="none")


def lm_loss(model, batch):
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    mask = batch["attention_mask"][:, 1:].float()
    tokens = F.cross_entropy(logits.transpose(1, 2), batch["input_ids"][:, 1:], reduction="none")
    return (tokens * mask).sum(1) / mask.sum(1)


def image_loss(model, batch):
    return F.cross_entropy(model(pixel_values=batch["pixel_values"]).logits, batch["labels"], reduction="none")


def text_batch():
    mask = torch.ones(B, T, dtype=torch.long)
    mask[0, 6:] = 0
    mask[3, 8:] = 0
    return {"input_ids": torch.randint(3, 99, (B, T)), "attention_mask": mask, "labels": torch.randint(0, 2, (B,))}


def build(name):
    t = transformers
    if name == "bert":
        return t.BertForSequenceClassification(t.BertConfig(vocab_size=100, max_position_embeddings=32, **SMALL)), \
            seq_loss, text_batch()
    if name == "roberta":
        config = t.RobertaConfig(vocab_size=100, max_position_embeddings=40, pad_token_id=1, **SMALL)
        return t.RobertaForSequenceClassification(config), seq_loss, text_batch()
    if name == "opt":  # tied LM head, token-flattened MLP, learned positions with an offset
        config = t.OPTConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, ffn_dim=64, num_attention_heads=4,
                             max_position_embeddings=32, word_embed_proj_dim=32)
        return t.OPTForCausalLM(config), lm_loss, text_batch()
    if name == "gpt2":  # Conv1D layers (weights stored transposed), tied LM head, [1, T] position ids
        config = t.GPT2Config(vocab_size=100, n_positions=32, n_embd=32, n_layer=2, n_head=4)
        return t.GPT2LMHeadModel(config), lm_loss, text_batch()
    config = t.ViTConfig(image_size=16, patch_size=4, num_channels=1, num_labels=3, **SMALL)
    return t.ViTForImageClassification(config), image_loss, \
        {"pixel_values": torch.randn(B, 1, 16, 16), "labels": torch.randint(0, 3, (B,))}


MODELS = ["bert", "roberta", "opt", "gpt2", "vit"]


@pytest.mark.parametrize("strategy", ["ghost", "materialize"])
@pytest.mark.parametrize("name", MODELS)
def test_per_example_gradients_match_single_example_backward(name, strategy):
    model, loss, batch = build(name)
    PerExampleEngine(model, loss, strategy=strategy).verify(batch, examples=B, rtol=1e-5)


# DP-GRAPE projects Linear weights; GPT-2's are Conv1D (not projected), so it trains GPT-2 with DP-AdamW only
@pytest.mark.parametrize("name,algorithm", [(m, a) for m in MODELS for a in ("dp-adamw", "dp-grape")
                                            if (m, a) != ("gpt2", "dp-grape")])
def test_dp_training_steps_run(name, algorithm):
    model, loss, batch = build(name)
    model.train()  # dropout on, as in real training
    engine = PerExampleEngine(model, loss)
    sampler = PoissonSampler(B, 0.5, SecretStream(0, "sampling"))
    privatizer = Privatizer(Clipping(1.0), GaussianNoise(0.5, 1.0, SecretStream(0, "noise")), sampler, PrivacyLedger())
    opt = build_algorithm(algorithm, engine, privatizer, Projection(lr=1e-3, rank=8))
    before = [p.detach().clone() for p in engine.params]
    for _ in range(3):
        opt.step(batch)
    assert opt.verified and privatizer.ledger.steps == 3
    assert all(not torch.equal(a, p) for a, p in zip(before, engine.params))


def test_gpt2_conv1d_layers_take_their_hook_rule():
    """GPT-2's Conv1D gets a layer rule (ghost norms, book-keeping) instead of the torch.func fallback."""
    model, loss, _ = build("gpt2")
    engine = PerExampleEngine(model, loss)
    conv1d = [u for u in engine.units if type(u.module).__name__ == "Conv1D"]
    assert len(conv1d) == 8 and all(u.rule is not None for u in conv1d)
    assert all(u.rule is not None for u in engine.units)  # no fallback unit left in the model
