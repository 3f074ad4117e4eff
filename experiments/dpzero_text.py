"""DPZero fine-tuning the pretrained MiniLM on Rotten Tomatoes, few-shot (DPZero Table 2 style, L259-283).

Setting (paper, RoBERTa-355M: prompt-based fine-tuning from the zero-shot model, 512 examples per class,
batch 64, 10,000 steps, lambda 1e-3, lr 1e-6, eps in {2, 6}, delta 1e-5; DP first-order methods 1,000 steps):
here all-MiniLM-L6-v2 (22.6M parameters, every one trained; ``--trainable REGEX`` trains a subset, e.g. the
prompt head alone) on ``rotten-tomatoes-512`` (1,024 training
snippets, sequence 64), through ``dpopt.train.build_run``: Poisson batches, noise calibrated by the PLD
accountant for the run's exact number of steps, the trainer's secret streams. Far fewer steps than the paper
(two shared CPU cores). Accuracy on a fixed 1,000-snippet subset of the test split every ``--eval-every`` steps.

Models: ``minilm-prompt`` (default; the encoder as it embeds sentences, with a head initialised at the
embeddings of "This movie is terrible." / "This movie is great.": the zero-shot classifier, the analogue of
the paper's prompt-based start) or ``minilm-cls`` (a fresh classification head on the pooler).

``--tune LR...``: MeZO at these learning rates scored on held-out *training-split* snippets not in the
few-shot sample (no test data). Default: ``dpzero`` at each eps, ``mezo`` (non-private, same lr),
``dp-grape`` at each eps with ``--grape-steps`` steps (Adam, rank 16, refresh every 100 steps); each finished
run is appended to ``text.jsonl`` and skipped when the command runs again. Baselines: the majority class and
both models untrained (``minilm-prompt`` untrained = zero-shot). "Steps to converge": the first evaluation
whose accuracy is within one point of the run's best.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from dpopt.algorithms import Projection, ZerothOrder
from dpopt.data.samplers import take
from dpopt.noise.rng import derive_seed
from dpopt.run import TrainConfig, accuracy, build_run

ZEROTH_ORDER = ("dpzero", "mezo")  # the rest (dp-grape, dp-adam) take the --grape-* settings
PAPER = {"dpzero": {6.0: "92.2 ± 0.3", 2.0: "91.8 ± 0.1"}, "mezo": "92.5 ± 0.3", "zero-shot": "79.0"}  # SST-2


def test_subset(data: dict[str, torch.Tensor], size: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(derive_seed(0, "public", "dpzero test subset"))
    return take(data, torch.randperm(len(data["labels"]), generator=g)[:size].sort().values)


def held_out(size: int) -> dict[str, torch.Tensor]:
    """``size`` training-split snippets that are not in the few-shot sample: for tuning without test data."""
    from dpopt.data.text import rotten_tomatoes

    full, few = rotten_tomatoes().train, rotten_tomatoes(per_class=512).train
    used = {tuple(row.tolist()) for row in few["input_ids"]}
    rest = torch.tensor([i for i, row in enumerate(full["input_ids"]) if tuple(row.tolist()) not in used])
    g = torch.Generator().manual_seed(derive_seed(0, "public", "dpzero held-out"))
    return take(full, rest[torch.randperm(len(rest), generator=g)[:size]].sort().values)


def finite_difference_scale(model: str, trainable: str | None, batch_size: int = 64) -> list[float]:
    """Quantiles (50, 90, 99, 100 %) of |s_i| at the pretrained point on one batch: the scale to clip at."""
    from dpopt.grad.zeroth_order import Direction, finite_differences

    run = build_run(TrainConfig(algorithm="mezo", dataset="rotten-tomatoes-512", model=model, epochs=1,
                                trainable=trainable), log=lambda _: None)
    s = finite_differences(run.optimizer.engine, take(run.data.train, torch.arange(batch_size)),
                           Direction(run.optimizer.params, 0), 1e-3).values.abs()
    return torch.quantile(s, torch.tensor([0.5, 0.9, 0.99, 1.0], dtype=s.dtype)).tolist()


def one_run(algorithm: str, epsilon: float | None, steps: int, args: argparse.Namespace,
            test: dict[str, torch.Tensor]) -> dict[str, Any]:
    zeroth = algorithm in ZEROTH_ORDER
    batch = args.batch_size
    per_epoch = round(1024 / batch)
    if steps % per_epoch:
        raise ValueError(f"steps must be a multiple of the {per_epoch} steps of an epoch (calibration is per epoch)")
    hp = (ZerothOrder(lr=args.lr, smoothing=args.smoothing) if zeroth
          else Projection(lr=args.grape_lr, rank=16, subspace_every=100))
    config = TrainConfig(algorithm=algorithm, dataset="rotten-tomatoes-512", model=args.model, epsilon=epsilon,
                         delta=1e-5, epochs=steps // per_epoch, batch_size=batch,
                         clip=args.clip if zeroth else args.grape_clip, seed=args.seed, hyperparameters=hp,
                         trainable=args.trainable)
    run = build_run(config, log=lambda msg: print("  " + msg, flush=True))
    history = [{"step": 0, "test_accuracy": accuracy(run.model, test, 256), "epsilon": 0.0}]
    losses: list[float] = []
    start = time.process_time()
    for t in range(steps):
        torch.manual_seed(derive_seed(config.seed, "public", "step", run.optimizer.steps))  # as dpopt.train does
        result = run.optimizer.step(run.data.train)
        if result.loss is not None:
            losses.append(result.loss)
        if (t + 1) % args.eval_every == 0 or t + 1 == steps:
            history.append({"step": t + 1, "test_accuracy": accuracy(run.model, test, 256),
                            "epsilon": run.ledger.epsilon(config.delta),
                            "train_loss": sum(losses[-args.eval_every:]) / max(1, len(losses[-args.eval_every:]))})
            print(f"  {algorithm} eps={epsilon} step {t + 1}: " + json.dumps(history[-1]), flush=True)
    best = max(h["test_accuracy"] for h in history)
    return {"algorithm": algorithm, "epsilon": epsilon, "steps": steps, "config": config.to_dict(),
            "final_accuracy": history[-1]["test_accuracy"], "best_accuracy": best,
            "steps_to_converge": next(h["step"] for h in history if h["test_accuracy"] >= best - 0.01),
            "noise_multiplier": run.optimizer.privatizer.noise.noise_multiplier,
            "final_epsilon": run.ledger.epsilon(config.delta), "cpu_s": time.process_time() - start,
            "history": history}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="dpopt reproduce dpzero_text")
    p.add_argument("--steps", type=int, default=1024, help="DPZero / MeZO steps (a multiple of an epoch)")
    p.add_argument("--model", default="minilm-prompt", choices=["minilm-cls", "minilm-prompt"],
                   help="MiniLM with a fresh head, or as a sentence embedder with a prompt-initialised head")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--clip", type=float, default=10.0)
    p.add_argument("--smoothing", type=float, default=1e-3)
    p.add_argument("--epsilons", type=float, nargs="+", default=[2.0, 6.0])
    p.add_argument("--algorithms", nargs="+", default=["dpzero", "mezo", "dp-grape"],
                   help="zeroth-order (dpzero, mezo) and first-order ones (dp-grape; dp-adam where nothing is "
                        "projectable, e.g. the head alone); the --grape-* settings apply to the first-order ones")
    p.add_argument("--grape-steps", type=int, default=128)
    p.add_argument("--grape-lr", type=float, default=1e-3)
    p.add_argument("--grape-clip", type=float, default=1.0)
    p.add_argument("--eval-every", type=int, default=128)
    p.add_argument("--test-size", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trainable", metavar="REGEX",
                   help="train only the matching parameters (e.g. '^head' for the prompt head alone)")
    p.add_argument("--tune", type=float, nargs="+", metavar="LR",
                   help="instead: MeZO at these learning rates for --steps steps, scored on --test-size held-out "
                        "training-split snippets (no test data)")
    p.add_argument("--out", default="experiments/results/dpzero")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    log = out / "text.jsonl"
    done = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    key = lambda r: (r["config"]["model"], r["algorithm"], r["epsilon"], r["steps"],  # noqa: E731
                     r["config"]["batch_size"], r["config"]["hyperparameters"]["lr"], r["config"]["clip"],
                     r["config"].get("trainable"))

    if a.tune:
        print("|s_i| quantiles 50/90/99/100%: " + json.dumps(finite_difference_scale(a.model, a.trainable)),
              flush=True)
        tune = held_out(a.test_size)
        for lr in a.tune:
            a.lr = lr
            record = one_run("mezo", None, a.steps, a, tune)
            record["tuning"] = "held-out training-split snippets"
            with (out / "text_tuning.jsonl").open("a") as f:
                f.write(json.dumps(record) + "\n")
        return 0
    probes = {model: build_run(TrainConfig(algorithm="mezo", dataset="rotten-tomatoes-512", model=model, epochs=1,
                                           seed=a.seed), log=lambda _: None) for model in ("minilm-cls", "minilm-prompt")}
    test = test_subset(probes["minilm-cls"].data.test, a.test_size)
    positive = float(test["labels"].float().mean())
    baselines = {"majority": max(positive, 1 - positive), "test_size": a.test_size,
                 "untrained_fresh_head": accuracy(probes["minilm-cls"].model, test, 256),
                 "zero_shot_prompt": accuracy(probes["minilm-prompt"].model, test, 256)}
    del probes
    print("baselines: " + json.dumps(baselines), flush=True)
    (out / "text_baselines.json").write_text(json.dumps(baselines, indent=2))
    plan = []
    for algorithm in a.algorithms:
        steps = a.steps if algorithm in ZEROTH_ORDER else a.grape_steps
        for eps in ([None] if algorithm == "mezo" else a.epsilons):
            plan.append((algorithm, eps, steps))
    for algorithm, eps, steps in plan:
        zeroth = algorithm in ZEROTH_ORDER
        wanted = (a.model, algorithm, eps, steps, a.batch_size, a.lr if zeroth else a.grape_lr,
                  a.clip if zeroth else a.grape_clip, a.trainable)
        if any(key(r) == wanted for r in done):
            continue
        print(f"{algorithm} eps={eps}: {steps} steps", flush=True)
        record = one_run(algorithm, eps, steps, a, test)
        with log.open("a") as f:
            f.write(json.dumps(record) + "\n")
        done.append(record)
    return 0
