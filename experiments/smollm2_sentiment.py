"""SmolLM2-135M-Instruct fine-tuned privately on Rotten Tomatoes as a prompted next-token task, against its
zero-shot accuracy.

Task (``dpopt.language_models``): ``"<snippet> Sentiment:"`` (48 tokens, the snippet cut to fit), class c
scored by the next-token logit of " negative" / " positive"; loss: cross-entropy over the two label words'
logits; accuracy: the label word with the higher next-token log-probability. Data: ``rotten-tomatoes-512``'s
1,024 training snippets (512 per class, the DPZero/DP-GRAPE few-shot setting) and a fixed subset of
``--test-size`` test-split snippets. Zero-shot: the untrained model on that subset.

Trained: the last ``--top-blocks`` transformer blocks (default 1; 0: none), the final norm and the label
words' head rows (``split_blocks``); the blocks below are frozen, so their output is a fixed function of each
snippet and is computed once (cached under ``$DPOPT_DATA`` or ``~/.cache/dpopt``; a lower cut is derived from a
cached higher one) instead of at every step: the gradients, the losses and the privacy guarantee are those of
training the same parameters on the full model. One setting per recipe and cut (``SETTINGS``), fixed before any
run: no tuning, no test data used to choose. With ``--top-blocks 0`` DP-GRAPE projects the head (rank 1, the
head not excluded from projection), the one matrix trained. Each run is
``make_private(..., algorithm=A, epsilon=6, delta=1e-5)``: Poisson batches, noise calibrated by the PLD
accountant for the run's steps, per-example clipping (DP-Adam, DP-GRAPE) or the clipped finite differences
(DPZero), a closure per step. Results: ``results.jsonl`` (one row per run, skipped when the command runs again)
and ``table.md``.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from dpopt import make_private
from dpopt.checkpoint import write_atomic
from dpopt.data.datasets import data_home
from dpopt.data.samplers import take
from dpopt.data.text import rotten_tomatoes
from dpopt.language_models import (PromptedClassifier, PromptEncoder, decoder_over, label_ids, smollm2,
                                   split_blocks)
from dpopt.noise.rng import derive_seed
from dpopt.task import accuracy, classification_loss

SETTINGS: dict[int, dict[str, dict[str, Any]]] = {  # per --top-blocks and recipe: epochs of 16 steps, lr, clip
    1: {"dp-adam": {"epochs": 8, "lr": 5e-4, "clip": 1.0},
        "dp-grape": {"epochs": 8, "lr": 5e-4, "clip": 1.0, "rank": 16},
        "dpzero": {"epochs": 16, "lr": 1e-4, "clip": 5.0}},
    0: {"dp-adam": {"epochs": 8, "lr": 2e-4, "clip": 1.0},
        "dp-grape": {"epochs": 8, "lr": 2e-4, "clip": 1.0, "rank": 1, "projection_exclude": "classifier"},
        "dpzero": {"epochs": 16, "lr": 5e-5, "clip": 5.0}},
}
ALGORITHMS = ("dp-adam", "dp-grape", "dpzero")


@torch.no_grad()
def features(bottom: torch.nn.Module, data: dict[str, torch.Tensor], batch: int = 32) -> dict[str, torch.Tensor]:
    """The frozen blocks' output for each example (batches of similar length, cut to their longest prompt)."""
    mask = data["attention_mask"]
    lengths = mask.sum(1)
    out = torch.zeros(*mask.shape, bottom.config.hidden_size)
    for chunk in lengths.argsort().split(batch):
        span = int(lengths[chunk].max())
        out[chunk, :span] = bottom(input_ids=data["input_ids"][chunk, :span],
                                   attention_mask=mask[chunk, :span], use_cache=False).last_hidden_state
    return {"inputs_embeds": out, "attention_mask": mask, "labels": data["labels"]}


def cache_file(top_blocks: int, test_size: int) -> Path:
    return data_home() / f"smollm2-sentiment-features-top{top_blocks}-test{test_size}.pt"


@torch.no_grad()
def run_blocks(decoder: torch.nn.Module, data: dict[str, torch.Tensor], batch: int = 128) -> dict[str, torch.Tensor]:
    """``data``'s hidden states carried through ``decoder``'s blocks (features of a lower cut from a higher one)."""
    hidden = torch.cat([decoder(inputs_embeds=h, attention_mask=m, use_cache=False).last_hidden_state
                        for h, m in zip(data["inputs_embeds"].split(batch), data["attention_mask"].split(batch))])
    return dict(data, inputs_embeds=hidden)


def prepared(top_blocks: int, test_size: int, log) -> tuple[PromptedClassifier, dict, dict]:
    """The trainable top and the train / test features (cached; a lower cut is derived from a cached higher one)."""
    model, tokenizer = smollm2()
    for p in model.parameters():
        p.requires_grad_(False)
    classifier = PromptedClassifier(model, label_ids(tokenizer))
    bottom, top = split_blocks(classifier, top_blocks)
    layers = list(classifier.body.layers)
    higher = [t for t in range(top_blocks + 1, len(layers) + 1) if cache_file(t, test_size).is_file()]
    if cache_file(top_blocks, test_size).is_file():
        train, test = torch.load(cache_file(top_blocks, test_size))
    elif higher:
        middle = decoder_over(classifier.body, None, layers[len(layers) - higher[0]:len(layers) - top_blocks],
                              torch.nn.Identity())
        train, test = (run_blocks(middle.eval(), d) for d in torch.load(cache_file(higher[0], test_size)))
        write_atomic(cache_file(top_blocks, test_size), lambda f: torch.save((train, test), f))
    else:
        data = rotten_tomatoes(per_class=512, tokenizer=PromptEncoder(tokenizer))
        g = torch.Generator().manual_seed(derive_seed(0, "public", "smollm2 test subset"))
        chosen = torch.randperm(len(data.test["labels"]), generator=g)[:test_size].sort().values
        start = time.time()
        train, test = features(bottom.eval(), data.train), features(bottom.eval(), take(data.test, chosen))
        log(f"features of {len(train['labels'])} + {len(test['labels'])} snippets in {time.time() - start:.0f} s")
        write_atomic(cache_file(top_blocks, test_size), lambda f: torch.save((train, test), f))
    for p in top.parameters():
        p.requires_grad_(True)
    return top, train, test


def one_run(top: PromptedClassifier, train: dict, test: dict, algorithm: str, seed: int, args) -> dict[str, Any]:
    s = SETTINGS[args.top_blocks][algorithm]
    model = copy.deepcopy(top).train()
    hp = {k: v for k, v in s.items() if k not in ("epochs", "clip")}
    torch.manual_seed(derive_seed(seed, "public", "smollm2 run"))
    model, optimizer, batches = make_private(
        model, None, train, classification_loss, algorithm=algorithm, batch_size=args.batch_size,
        epochs=s["epochs"], epsilon=args.epsilon, delta=args.delta, clip=s["clip"], secret_seed=seed,
        physical_batch_size=args.batch_size * 2, hyperparameters=hp)
    start = time.process_time()
    for epoch in range(s["epochs"]):
        for batch in batches:
            optimizer.step(lambda: classification_loss(model, batch))
        print(f"  {algorithm} seed {seed} epoch {epoch + 1}: epsilon {optimizer.epsilon(args.delta):.2f}", flush=True)
    return {"algorithm": algorithm, "seed": seed, "test_accuracy": accuracy(model, test, 128),
            "epsilon": optimizer.epsilon(args.delta), "delta": args.delta, "steps": optimizer.ledger.steps,
            "batch_size": args.batch_size, "top_blocks": args.top_blocks, "trained": sum(
                p.numel() for p in model.parameters() if p.requires_grad), **s, "cpu_s": time.process_time() - start}


def table(rows: list[dict[str, Any]]) -> str:
    zero = next((r["test_accuracy"] for r in rows if r["algorithm"] == "zero-shot"), None)
    lines = ["| method | trained | test accuracy (%), mean ± std (seeds) | spread (max - min) | gain over zero-shot "
             "| gain > spread | epsilon | steps | trained numbers | lr | clip |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    if zero is not None:
        lines.append(f"| zero-shot | nothing | {100 * zero:.1f} | | | | 0 | 0 | 0 | | |")
    for top in sorted({r["top_blocks"] for r in rows if "top_blocks" in r}, reverse=True):
        what = "final norm, head" if top == 0 else f"last {top} block{'s' * (top > 1)}, final norm, head"
        for algorithm in ALGORITHMS:
            runs = sorted((r for r in rows if r["algorithm"] == algorithm and r["top_blocks"] == top),
                          key=lambda r: r["seed"])
            if not runs:
                continue
            acc = [100 * r["test_accuracy"] for r in runs]
            mean, std = statistics.mean(acc), statistics.stdev(acc) if len(acc) > 1 else 0.0
            spread = max(acc) - min(acc)
            gain = mean - 100 * zero if zero is not None else float("nan")
            r = runs[0]
            lines.append(f"| {algorithm} | {what} | {mean:.1f} ± {std:.1f} ({', '.join(f'{a:.1f}' for a in acc)}) | "
                         f"{spread:.1f} | {gain:+.1f} | {'yes' if gain > spread else 'no'} | {r['epsilon']:.2f} | "
                         f"{r['steps']} | {r['trained']:,} | {r['lr']:g} | {r['clip']:g} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="dpopt reproduce smollm2_sentiment")
    p.add_argument("--algorithms", nargs="+", default=list(ALGORITHMS), choices=ALGORITHMS)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--epsilon", type=float, default=6.0)
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--top-blocks", type=int, default=1, choices=sorted(SETTINGS),
                   help="trained blocks (the last ones), with the final norm and head (0: those two alone)")
    p.add_argument("--test-size", type=int, default=500)
    p.add_argument("--out", default="experiments/results/smollm2_sentiment")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    log = out / "results.jsonl"
    rows = lambda: [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []  # noqa: E731
    top, train, test = prepared(a.top_blocks, a.test_size, lambda m: print(m, flush=True))

    def record(row: dict[str, Any]) -> None:
        with log.open("a") as f:
            f.write(json.dumps(row) + "\n")
        (out / "table.md").write_text(table(rows()))
        print(json.dumps(row), flush=True)

    if not any(r["algorithm"] == "zero-shot" for r in rows()):
        record({"algorithm": "zero-shot", "test_accuracy": accuracy(top, test, 128), "test_size": a.test_size})
    for algorithm in a.algorithms:
        for seed in a.seeds:
            settings = {"seed": seed, "top_blocks": a.top_blocks, "batch_size": a.batch_size,
                        **SETTINGS[a.top_blocks][algorithm]}
            if any(r["algorithm"] == algorithm and all(r.get(k) == v for k, v in settings.items())
                   and abs(r["epsilon"] - a.epsilon) < 0.05 for r in rows()):
                continue
            record(one_run(top, train, test, algorithm, seed, a))
    print(table(rows()))
    return 0
