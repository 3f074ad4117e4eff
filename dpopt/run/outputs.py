"""What a run writes and reports: metrics.json, the exported model, the chance-level warning, the epsilon bar."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from dpopt import report
from dpopt.checkpoint import write_atomic
from dpopt.plan import mechanism
from dpopt.privacy import PoissonSampling, PrivacyLedger
from dpopt.privacy.statement import privacy_statement
from dpopt.run.build import Run


def chance_warning(run: Run, last: dict[str, Any]) -> str | None:
    """``report.chance_warning`` for a run whose last evaluation is ``last``: the noise-to-signal ratio
    sigma * sqrt(d) / B is the norm of the noise N(0, sigma^2 C^2 I_d) over the largest norm of a clipped sum of
    B (expected batch) examples, B * C; clipped is the fraction of the last epoch's examples clipped."""
    d = sum(p.numel() for p in run.optimizer.params)
    ratio = run.optimizer.privatizer.noise.noise_multiplier * math.sqrt(d) / run.config.batch_size
    return report.chance_warning(
        last["test_accuracy"], run.data.num_classes, f"sigma * sqrt(d) / B, d = {d} parameters, "
        f"B = {run.config.batch_size}", ratio, last.get("clipped_fraction", 0.0),
        "use a larger --batch-size or --epsilon, or train fewer weights (a smaller model, or --trainable: e.g. "
        "a pretrained model's head)",
        f"each step moves at most lr * C = {run.config.hyperparameters.lr * run.config.clip:.3g}; raise --clip or --lr")


def bar_epsilon(ledger: PrivacyLedger, delta: float) -> str:
    """The epsilon spent so far, for the progress bar after every step: by RDP where it applies (cached per
    release, so microseconds a step; an upper bound like the PLD guarantee, usually a little above it), else
    by the run's accountant; labelled with the accountant used."""
    try:
        return f"{ledger.epsilon(delta, 'rdp'):.3g} (RDP)"
    except ValueError:
        return f"{ledger.epsilon(delta):.3g} ({ledger.accountant.upper()})"


def write_metrics(out: Path, metrics: dict[str, Any]) -> None:
    write_atomic(out / "metrics.json", lambda f: f.write(json.dumps(metrics, indent=2).encode()))


def metrics_of(run: Run, history: list[dict[str, Any]], nonfinite: int, wall: float, cpu: float,
               finished: bool) -> dict[str, Any]:
    """metrics.json: the run so far (``finished`` False after an evaluation before the last), never a secret."""
    config = run.config
    metrics = {
        "algorithm": config.algorithm, "dataset": config.dataset, "model": config.model,
        "noise": mechanism(config, run.total_steps), "sampling": config.sampling_kind,
        "test_accuracy": history[-1]["test_accuracy"], "epsilon": run.ledger.epsilon(config.delta),
        "delta": config.delta, "steps": run.optimizer.steps, "epochs": config.epochs,
        "noise_multiplier": run.optimizer.privatizer.noise.noise_multiplier,
        "sample_rate": (run.sampler.participation.rate if isinstance(run.sampler.participation, PoissonSampling)
                        else None),
        "accountant": config.accountant, "relation": config.relation, "nonfinite_examples": nonfinite,
        "wall_time_s": wall, "cpu_time_s": cpu, "threads": torch.get_num_threads(),
        "device": str(run.optimizer.device), "precision": config.precision, "history": history,
        "ledger": run.ledger.to_dict(),
        "secret_randomness": config.randomness, "config": config.public_dict(), "finished": finished,
    }
    metrics["privacy_statement"] = privacy_statement(run.ledger, config.delta, len(run.data),
                                                     randomness=config.randomness)
    return metrics
