"""PrivateTrainer: a Hugging Face Trainer step is PrivateStep.step, resumes exactly, keeps its secret in the
optimizer state only, and trains a tiny BERT, a tiny GPT-2 and LoRA adapters (DP-AdamW, DP-GRAPE)."""

import copy
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
from transformers import (BertConfig, BertForSequenceClassification, GPT2Config, GPT2LMHeadModel,  # noqa: E402
                          TrainingArguments)

from dpopt.hf import PrivacyArguments, PrivateTrainer, per_example_loss  # noqa: E402
from dpopt.loop import make_private  # noqa: E402

transformers.logging.set_verbosity_error()
N, T = 24, 6


def tiny_bert() -> BertForSequenceClassification:
    torch.manual_seed(0)
    return BertForSequenceClassification(BertConfig(
        vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=20,
        max_position_embeddings=T, num_labels=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def examples() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {"input_ids": torch.randint(0, 40, (N, T), generator=g), "attention_mask": torch.ones(N, T, dtype=torch.long),
            "labels": torch.randint(0, 2, (N,), generator=g)}


def as_list(data: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    return [{k: v[i] for k, v in data.items()} for i in range(N)]


def arguments(out, **kw) -> TrainingArguments:
    base = dict(per_device_train_batch_size=3, max_steps=4, learning_rate=0.1, optim="sgd", lr_scheduler_type="constant",
                max_grad_norm=0.0, weight_decay=0.0, report_to=[], save_strategy="no", logging_steps=2, use_cpu=True,
                disable_tqdm=True)
    return TrainingArguments(str(out), **{**base, **kw})


def test_a_trainer_step_is_dpoptimizer_step(tmp_path):
    model, reference = tiny_bert(), tiny_bert()
    privacy = PrivacyArguments(noise_multiplier=1.0, batch_size=8, clip=0.5, secret_seed=3)
    trainer = PrivateTrainer(model, arguments(tmp_path), train_dataset=as_list(examples()), privacy=privacy)
    trainer.train()
    _, private, _ = make_private(reference, torch.optim.SGD(reference.parameters(), lr=0.1), examples(),
                                 per_example_loss, batch_size=8, noise_multiplier=1.0, clip=0.5, secret_seed=3,
                                 physical_batch_size=3)
    for _ in range(4):
        private.dp.step(examples())
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), tiny_bert().parameters()))
    assert trainer.ledger.steps == 4 and trainer.epsilon() == pytest.approx(private.epsilon(1e-5), rel=1e-12)
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert logged and all(h["epsilon"] > 0 for h in logged) and logged[-1]["grad_norm"] > 0


def test_a_resumed_trainer_continues_exactly_and_its_checkpoints_keep_the_key_to_themselves(tmp_path):
    kw = dict(save_strategy="steps", save_steps=2, optim="adamw_torch", learning_rate=1e-2)
    privacy = PrivacyArguments(noise_multiplier=1.0, batch_size=8)  # the key: OS entropy
    whole = PrivateTrainer(tiny_bert(), arguments(tmp_path / "a", **kw), train_dataset=as_list(examples()),
                           privacy=privacy)
    whole.train()
    resumed = PrivateTrainer(tiny_bert(), arguments(tmp_path / "a", **kw), train_dataset=as_list(examples()),
                             privacy=privacy)
    resumed.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-2"))
    for p, q in zip(whole.model.parameters(), resumed.model.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    assert resumed.ledger.steps == 4 and resumed.epsilon() == whole.epsilon()
    checkpoint = tmp_path / "a" / "checkpoint-4"
    key = torch.load(checkpoint / "optimizer.pt", weights_only=True)["secret_key"]
    assert isinstance(key, bytes) and len(key) == 32
    privacy_json = json.loads((checkpoint / "privacy.json").read_text())
    assert privacy_json["epsilon"] == pytest.approx(whole.epsilon()) and privacy_json["steps"] == 4
    exported = tmp_path / "model"
    whole.save_model(str(exported))
    for f in [*checkpoint.iterdir(), *exported.iterdir()]:
        if f.name != "optimizer.pt":
            assert key not in f.read_bytes(), f.name


def test_an_examples_loss_does_not_depend_on_the_others_and_a_gpt2_trains(tmp_path):
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=40, n_positions=8, n_embd=16, n_layer=1, n_head=2, resid_pdrop=0.0,
                                       embd_pdrop=0.0, attn_pdrop=0.0))
    ids = torch.randint(0, 40, (2, 8))
    labels = ids.clone()
    labels[1, 3:] = -100  # the second example is shorter: the batch's token mean would weigh the first more
    both = per_example_loss(model, {"input_ids": ids, "labels": labels})
    alone = torch.cat([per_example_loss(model, {"input_ids": ids[i:i + 1], "labels": labels[i:i + 1]}) for i in (0, 1)])
    torch.testing.assert_close(both, alone)
    data = [{"input_ids": x, "labels": x} for x in torch.randint(0, 40, (N, 8))]
    trainer = PrivateTrainer(model, arguments(tmp_path, max_steps=2, optim="adamw_torch", learning_rate=1e-3),
                             train_dataset=data, privacy=PrivacyArguments(noise_multiplier=1.0, batch_size=8))
    before = copy.deepcopy(model.state_dict())
    trainer.train()
    assert trainer.ledger.steps == 2
    name = "transformer.h.0.attn.c_attn.weight"  # a Conv1D: its hook rule
    assert not torch.equal(before[name], model.state_dict()[name])


@pytest.mark.parametrize("algorithm", [None, "dp-grape"])
def test_lora_adapters_train_privately_and_export_alone(tmp_path, algorithm):
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(tiny_bert(), peft.LoraConfig(r=4, target_modules=["query", "value"],
                                                             task_type="SEQ_CLS"))
    frozen = {n: p.clone() for n, p in model.named_parameters() if not p.requires_grad}
    lora = {n: p.clone() for n, p in model.named_parameters() if "lora_B" in n}
    trainer = PrivateTrainer(model, arguments(tmp_path, max_steps=2, optim="adamw_torch", learning_rate=1e-2),
                             train_dataset=as_list(examples()),
                             privacy=PrivacyArguments(noise_multiplier=1.0, batch_size=8, algorithm=algorithm,
                                                      hyperparameters={"rank": 2} if algorithm else {}))
    trainer.train()
    params = dict(model.named_parameters())
    assert all(torch.equal(params[n], p) for n, p in frozen.items())
    assert all(not torch.equal(params[n], p) for n, p in lora.items())
    trainer.save_model(str(tmp_path / "adapter"))
    saved = {f.name for f in (tmp_path / "adapter").iterdir()}
    assert "adapter_model.safetensors" in saved and "model.safetensors" not in saved


def test_bad_use_is_refused(tmp_path):
    data = as_list(examples())
    privacy = PrivacyArguments(noise_multiplier=1.0, batch_size=8)
    with pytest.raises(ValueError, match="gradient_accumulation_steps must be 1"):
        PrivateTrainer(tiny_bert(), arguments(tmp_path, gradient_accumulation_steps=2), train_dataset=data,
                       privacy=privacy)
    trainer = PrivateTrainer(tiny_bert(), arguments(tmp_path, max_steps=1), train_dataset=data, privacy=privacy)
    trainer.train()
    with pytest.raises(RuntimeError, match="trains once"):
        trainer.train()
    with pytest.raises(ValueError, match="checkpoint"):
        PrivateTrainer(tiny_bert(), arguments(tmp_path / "empty"), train_dataset=data,
                       privacy=privacy).train(resume_from_checkpoint=True)


def test_a_model_sharded_otherwise_than_by_fully_shard_or_several_processes_are_refused_in_one_line(tmp_path,
                                                                                                   monkeypatch):
    """An unsharded model on a Trainer that sees several processes (torchrun) is refused, naming data parallelism's
    and sharding's routes; so is, before the Trainer sees it, a model sharded otherwise than by fully_shard at its
    root and over every trainable parameter (here over a 1-process gloo group): fully_shard at an inner module only,
    a DTensor parameter without FSDP2 (tensor parallelism), a trainable parameter left unsharded, FSDP1.
    tests/test_hf_sharded.py trains a model sharded by fully_shard."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    shard_with = r"shard it on every rank with torch.distributed.fsdp.fully_shard"
    data, privacy = as_list(examples()), PrivacyArguments(noise_multiplier=1.0, batch_size=8)
    with monkeypatch.context() as patch:
        patch.setattr(TrainingArguments, "world_size", property(lambda self: 2))
        with pytest.raises(ValueError, match=f"unsharded model on one process, not 2 .*dpopt train --nproc N.*"
                                             f"{shard_with}"):
            PrivateTrainer(tiny_bert(), arguments(tmp_path), train_dataset=data, privacy=privacy)
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        inner, tensor_parallel, unsharded_head = tiny_bert(), tiny_bert(), tiny_bert()
        fully_shard(inner.bert.encoder, mesh=mesh)
        head = tensor_parallel.classifier
        head.weight = torch.nn.Parameter(distribute_tensor(head.weight.detach(), mesh, [Shard(0)]))
        fully_shard(unsharded_head, mesh=mesh)
        unsharded_head.classifier.bias = torch.nn.Parameter(torch.zeros(2))
        fsdp1 = FullyShardedDataParallel(tiny_bert(), device_id=torch.device("cpu"))
        for model, says in ((inner, "whose root is sharded by fully_shard too"),
                            (tensor_parallel, "whose root is sharded by fully_shard too"),
                            (unsharded_head, "trainable parameter classifier.bias is not sharded on dim 0"),
                            (fsdp1, r"FSDP1 \(FullyShardedDataParallel\)")):
            with pytest.raises(ValueError, match=f"{says}.*; {shard_with}") as refused:
                PrivateTrainer(model, arguments(tmp_path), train_dataset=data, privacy=privacy)
            assert "\n" not in str(refused.value)
        with pytest.raises(ValueError, match=shard_with):
            PrivateTrainer(model=inner, args=arguments(tmp_path), train_dataset=data, privacy=privacy)
    finally:
        torch.distributed.destroy_process_group()


def test_bf16_steps_stay_within_bf16_tolerance_of_fp32(tmp_path):
    """TrainingArguments(bf16=True): the forward and backward autocast (accelerate), norms and sums in float32."""
    flat = lambda m: torch.cat([p.detach().flatten() for p in m.parameters()])  # noqa: E731
    runs = []
    for bf16 in (False, True):
        model = tiny_bert()
        trainer = PrivateTrainer(model, arguments(tmp_path / str(bf16), bf16=bf16, max_steps=2),
                                 train_dataset=as_list(examples()),
                                 privacy=PrivacyArguments(noise_multiplier=0.5, batch_size=8, clip=100.0, secret_seed=1))
        trainer.train()
        runs.append(flat(model))
    moved, gap = (runs[0] - flat(tiny_bert())).abs().max(), (runs[1] - runs[0]).abs().max()
    assert 1e-6 * moved < gap < 1e-2 * moved  # bf16 did run (not bit-equal), and stayed within its rounding


def test_a_tokenized_datasets_dataset_with_dynamic_padding_trains(tmp_path):
    """The usual Hugging Face data path: a datasets.Dataset of texts, a tokenizer, DataCollatorWithPadding (whose
    BatchEncoding batches, padded per logical batch, reach the engine as plain dicts)."""
    datasets = pytest.importorskip("datasets")
    words = ["good", "bad", "film", "plot", "very", "not", "at", "all"]
    tokenizer = transformers.BertTokenizer(vocab={w: i for i, w in enumerate(
        ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words])})
    g = torch.Generator().manual_seed(0)
    texts = [" ".join(words[j] for j in torch.randint(0, 8, (int(k),), generator=g)) for k in torch.randint(1, 5, (N,))]
    data = datasets.Dataset.from_dict({"text": texts, "label": [i % 2 for i in range(N)]}).map(
        lambda b: tokenizer(b["text"]), batched=True)
    trainer = PrivateTrainer(tiny_bert(), arguments(tmp_path, max_steps=2), train_dataset=data,
                             eval_dataset=data, processing_class=tokenizer,
                             data_collator=transformers.DataCollatorWithPadding(tokenizer),
                             privacy=PrivacyArguments(noise_multiplier=1.0, batch_size=8))
    trainer.train()
    assert trainer.ledger.steps == 2 and trainer.evaluate()["eval_loss"] > 0


def test_the_same_trainer_resumes_from_its_own_checkpoint_exactly(tmp_path):
    kw = dict(save_strategy="steps", save_steps=2, optim="adamw_torch", learning_rate=1e-2,
              lr_scheduler_type="linear")
    privacy = PrivacyArguments(noise_multiplier=1.0, batch_size=8, secret_seed=5)
    whole = PrivateTrainer(tiny_bert(), arguments(tmp_path / "a", **kw), train_dataset=as_list(examples()),
                           privacy=privacy)
    whole.train()
    again = PrivateTrainer(tiny_bert(), arguments(tmp_path / "b", **kw), train_dataset=as_list(examples()),
                           privacy=privacy)
    again.train()
    again.train(resume_from_checkpoint=str(tmp_path / "b" / "checkpoint-2"))  # steps 3-4 again, from step 2
    for p, q in zip(whole.model.parameters(), again.model.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    assert again.ledger.steps == 4


def test_any_module_that_returns_logits_trains_and_predicts(tmp_path):
    """A plain nn.Module whose forward names no labels (so the Trainer's column filter would drop them)."""
    class Bag(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.head = torch.nn.Embedding(40, 8), torch.nn.Linear(8, 2)

        def forward(self, input_ids, attention_mask, **_):
            return self.head(self.embed(input_ids).mean(1))

    torch.manual_seed(0)
    trainer = PrivateTrainer(Bag(), arguments(tmp_path, max_steps=2), train_dataset=as_list(examples()),
                             privacy=PrivacyArguments(noise_multiplier=1.0, batch_size=8))
    trainer.train()
    assert trainer.ledger.steps == 2 and trainer.predict(as_list(examples())).label_ids.shape == (N,)
