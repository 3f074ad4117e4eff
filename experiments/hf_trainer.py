"""The pretrained MiniLM fine-tuned on Rotten Tomatoes at epsilon 3 through the Hugging Face Trainer
(``dpopt.hf.PrivateTrainer``), against ``dpopt train`` on the same setting (issue 22).

Setting: all-MiniLM-L6-v2 (``--model``: ``minilm-prompt``, its normalised mean-pooled embedding with a head
started at two prompts' embeddings, the zero-shot classifier, as in docs/grape.md; or ``minilm-cls``,
``AutoModelForSequenceClassification``'s fresh [CLS] head), the ``rotten-tomatoes-512`` split (512 snippets per
class, 64 tokens; the test split's 2,562 snippets), Poisson batches of expected size ``--batch-size`` in
physical batches of 32, C = ``--clip``, delta = 1e-5, Adam without weight decay at a constant learning rate, the
same seed and secret seed (the same initial head, batches and noise). Methods: ``train`` (dpopt train,
dp-adam), ``trainer`` (PrivateTrainer, the Trainer's AdamW with weight decay 0: DP-Adam), ``trainer-lora`` (LoRA
r = 16 on query/value, the head trained too) and ``trainer-lora-grape`` (the same adapters trained by DP-GRAPE,
rank 4). Each finished run is a line of results.jsonl (skipped when run again); ``--summarize`` writes table.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

import torch

from dpopt.algorithms import hyperparameters_for
from dpopt.data.datasets import load_dataset
from dpopt.models import build_model
from dpopt.noise.rng import derive_seed
from dpopt.run import TrainConfig, accuracy, freeze_all_but, train

DATASET, EPSILON, DELTA, PHYSICAL = "rotten-tomatoes-512", 3.0, 1e-5, 32
METHODS = ("train", "trainer", "trainer-lora", "trainer-lora-grape")


def run_train(a: argparse.Namespace, seed: int, lr: float) -> float:
    config = TrainConfig(algorithm="dp-adam", dataset=DATASET, model=a.model, epsilon=EPSILON, delta=DELTA,
                         epochs=a.epochs, batch_size=a.batch_size, physical_batch_size=PHYSICAL, clip=a.clip, seed=seed,
                         secret_seed=seed, trainable=a.trainable,
                         hyperparameters=dataclasses.replace(hyperparameters_for("dp-adam"), lr=lr))
    return train(config, progress=False, log=lambda s: None)["test_accuracy"]


def run_trainer(a: argparse.Namespace, method: str, seed: int, lr: float, out: Path) -> float:
    from transformers import TrainingArguments

    from dpopt.hf import PrivacyArguments, PrivateTrainer

    data = load_dataset(DATASET)
    torch.manual_seed(derive_seed(seed, "public", "init"))  # the head dpopt train starts from
    model = build_model(a.model, data)
    algorithm, hyperparameters = None, {}
    if method == "trainer" and a.trainable:
        freeze_all_but(model, a.trainable)
    if method != "trainer":
        import peft

        head = {"task_type": "SEQ_CLS"} if a.model == "minilm-cls" else {"modules_to_save": ["head"]}
        model = peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=16, target_modules=["query", "value"],
                                                           **head))
        if method == "trainer-lora-grape":
            algorithm, hyperparameters = "dp-grape", {"rank": 4}
    x = data.train
    examples = [{k: v[i] for k, v in x.items()} for i in range(len(x["labels"]))]
    args = TrainingArguments(str(out / "trainer" / f"{method}-{seed}"), per_device_train_batch_size=PHYSICAL,
                             num_train_epochs=a.epochs, learning_rate=lr, optim="adamw_torch", weight_decay=0.0,
                             lr_scheduler_type="constant", max_grad_norm=0.0, save_strategy="no", report_to=[],
                             logging_steps=10, disable_tqdm=True, use_cpu=True, seed=seed)
    trainer = PrivateTrainer(model, args, train_dataset=examples, privacy=PrivacyArguments(
        epsilon=EPSILON, delta=DELTA, batch_size=a.batch_size, clip=a.clip, algorithm=algorithm, secret_seed=seed,
        hyperparameters=hyperparameters))
    trainer.train()
    assert trainer.epsilon() <= EPSILON
    return accuracy(model, data.test, PHYSICAL * 4)


def summarize(out: Path) -> str:
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    lines = ["| model | method | trained | lr | epsilon | test accuracy (%) | seeds | CPU time per run (s) |",
             "|---|---|---|---|---|---|---|---|"]
    key = lambda r: (r.get("model", "minilm-cls"), r["method"], r.get("trainable") or "")  # noqa: E731
    for model, method, trainable in sorted({key(r) for r in rows}, key=lambda k: (k[0], k[2], METHODS.index(k[1]))):
        mine = [r for r in rows if key(r) == (model, method, trainable)]
        acc = [100 * r["test_accuracy"] for r in mine]
        sd = f" ± {statistics.stdev(acc):.1f}" if len(acc) > 1 else ""
        trained = "LoRA r 16 (query, value), head" if method.startswith("trainer-lora") else trainable or "all"
        lines.append(f"| {model} | {method} | {trained} | {mine[0]['lr']:g} | {mine[0]['epsilon']:g} | "
                     f"{statistics.mean(acc):.1f}{sd} | {len(acc)} | {statistics.mean(r['cpu_s'] for r in mine):.0f} |")
    table = "\n".join(lines) + "\n"
    (out / "table.md").write_text(table)
    return table


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="dpopt reproduce hf_trainer", description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--seeds", nargs="+", type=int, default=[0])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=32, help="expected logical batch")
    p.add_argument("--clip", type=float, default=0.5)
    p.add_argument("--lr", type=float, default=3e-4, help="full fine-tuning (train, trainer)")
    p.add_argument("--lr-lora", type=float, default=3e-3, help="LoRA adapters (trainer-lora, trainer-lora-grape)")
    p.add_argument("--model", default="minilm-prompt", choices=["minilm-cls", "minilm-prompt"],
                   help="minilm-prompt: mean-pooled embedding, head started at two prompts' embeddings (zero-shot); "
                        "minilm-cls: AutoModelForSequenceClassification's fresh [CLS] head")
    p.add_argument("--trainable", help="train and trainer: only the parameters matching this regular expression")
    p.add_argument("--out", default="runs/hf_trainer")
    p.add_argument("--summarize", action="store_true")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    log = out / "results.jsonl"
    rows = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    done = {(r["method"], r.get("model", "minilm-cls"), r["seed"], r.get("trainable")) for r in rows}
    for seed in [] if a.summarize else a.seeds:
        for method in a.methods:
            trainable = None if method.startswith("trainer-lora") else a.trainable  # LoRA trains its adapters
            if (method, a.model, seed, trainable) in done:
                continue
            lr = a.lr if method in ("train", "trainer") else a.lr_lora
            start = time.process_time()
            acc = run_train(a, seed, lr) if method == "train" else run_trainer(a, method, seed, lr, out)
            row = {"method": method, "model": a.model, "seed": seed, "lr": lr, "epsilon": EPSILON, "epochs": a.epochs,
                   "batch_size": a.batch_size, "clip": a.clip,
                   "trainable": trainable,
                   "test_accuracy": acc, "cpu_s": time.process_time() - start}
            with log.open("a") as f:
                f.write(json.dumps(row) + "\n")
            print(json.dumps(row), flush=True)
    print(summarize(out))
    return 0
