"""The in-process federation: all clients' state as [n, d] stacks, one vectorised step per round.

Each round: the server asks its participants (public schedule); the ones that do not fail compute their
gradients in one vmapped call, their client step (rules.py) and noisy messages; every message that left a
client is recorded in that client's ledger; the messages that arrive are summed in client order and close
the round on the server. A client's new state is committed only when its message arrived, so a failure
never leaves g_i out of step with what the server added (eq. 16 holds whatever fails).

Failures, per asked client and round: ``crash`` (the client fails before sending: nothing released,
state unchanged) and ``lost`` (the message was sent, hence released and recorded, but never arrived:
state unchanged). Under the ``continue`` policy the round completes with the others; under ``abort`` it
raises ``ClientFailure`` before anything is applied.
"""

from __future__ import annotations

import json
import math
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal

import torch
from tqdm.auto import tqdm

from dpopt.checkpoint import write_atomic
from dpopt.federated.config import Setup, drops_out, participants
from dpopt.federated.problem import Problem
from dpopt.federated.privacy import ClientLedgers, ClientNoise, epsilons_of
from dpopt.federated.rules import ServerState, client_update
from dpopt.privacy import PrivacyLedger
from dpopt.report import chance_warning
from dpopt.export import MODEL_DIR, export_model

Fault = Literal["crash", "lost"]
FaultSchedule = Callable[[int, int], "Fault | None"]


class ClientFailure(RuntimeError):
    """Clients failed in a round under the ``abort`` policy."""


@dataclass
class RoundReport:
    round: int
    asked: list[int]
    delivered: list[int]
    crashed: list[int] = field(default_factory=list)
    lost: list[int] = field(default_factory=list)
    clipped: int = 0


def failure_message(round: int, crashed: list[int], lost: list[int]) -> str:
    parts = ([f"client(s) {crashed} failed before sending"] if crashed else []) + \
            ([f"the message(s) of client(s) {lost} never arrived"] if lost else [])
    return (f"round {round}: {' and '.join(parts)}; the federation is left as it was before the round "
            "(messages already sent are in the clients' ledgers). Use --on-failure continue to finish rounds "
            "with the clients that report.")


class InProcessFederation:
    def __init__(self, setup: Setup, faults: FaultSchedule | None = None) -> None:
        self.setup, self.faults = setup, faults
        n, x0 = setup.config.clients, setup.problem.x0
        self.server = ServerState.start(x0)
        self.v = x0.new_zeros(n, x0.numel()) if setup.method.momentum else None
        self.g = x0.new_zeros(n, x0.numel()) if setup.method.error_feedback else None
        self.noise = ClientNoise(setup.noise, n, setup.secret_key)
        self.ledgers = ClientLedgers(n)

    def fault(self, round: int, client: int) -> Fault | None:
        if drops_out(self.setup.config, round, client):
            return "crash"
        return self.faults(round, client) if self.faults is not None else None

    def step(self) -> RoundReport:
        setup, t = self.setup, self.server.round + 1
        asked = participants(setup.config, t)
        faults = {i: self.fault(t, i) for i in asked}
        working = [i for i in asked if faults[i] != "crash"]
        index = torch.tensor(working, dtype=torch.long)
        grads = setup.problem.oracle(self.server.x, working, t)
        update = client_update(setup.method, setup.clipping, grads,
                               None if self.v is None else self.v[index], None if self.g is None else self.g[index])
        messages = self.noise.add_to(update.delta.clone(), working, t)
        self.ledgers.record(working, setup.noise.release())
        arrived = torch.tensor([faults[i] is None for i in working], dtype=torch.bool)
        report = RoundReport(t, asked, [i for i in working if faults[i] is None],
                             [i for i in asked if faults[i] == "crash"], [i for i in working if faults[i] == "lost"],
                             int(update.clipped.sum()))
        if (report.crashed or report.lost) and setup.config.on_failure == "abort":
            raise ClientFailure(failure_message(t, report.crashed, report.lost))
        kept = index[arrived]
        if self.v is not None:
            self.v[kept] = update.v[arrived]
        if self.g is not None:
            self.g[kept] = update.g[arrived]
        self.server.apply(setup.method, messages[arrived].sum(0), len(report.delivered), setup.config.clients)
        return report


@dataclass
class RunResult:
    metrics: dict[str, Any]
    x: torch.Tensor  # the final server model (flat)


def run_inprocess(setup: Setup, progress: bool = True, faults: FaultSchedule | None = None,
                  log: Callable[[str], None] = print) -> RunResult:
    """Run all rounds, evaluating every ``eval_every`` rounds and at the end; returns the metrics."""
    config = setup.config
    fed = InProcessFederation(setup, faults)
    history: list[dict[str, Any]] = []
    failures = {"crashed": 0, "lost": 0}
    start = time.perf_counter()
    bar = tqdm(range(config.rounds), desc=f"{config.algorithm} ({config.clients} clients)", disable=not progress)
    for _ in bar:
        report = fed.step()
        failures["crashed"] += len(report.crashed)
        failures["lost"] += len(report.lost)
        if report.round % config.eval_every == 0 or report.round == config.rounds:
            history.append({"round": report.round, **setup.problem.evaluate(fed.server.x),
                            "clipped_fraction": report.clipped / max(1, len(report.asked))})
            bar.set_postfix(acc=f"{history[-1].get('test_accuracy', float('nan')):.4f}")
    metrics = finish(setup, fed.server, fed.ledgers.to_dict(), history, failures, time.perf_counter() - start,
                     "inprocess", log)
    return RunResult(metrics, fed.server.x)


def finish(setup: Setup, server: ServerState, ledgers: list[dict], history: list[dict[str, Any]],
           failures: dict[str, int], wall: float, engine: str, log: Callable[[str], None]) -> dict[str, Any]:
    """The run's metrics (shared by both engines): per-client epsilon from the clients' ledgers."""
    config = setup.config
    book = [PrivacyLedger.from_dict(d) for d in ledgers]
    eps = epsilons_of(book, config.delta)
    final = setup.problem.evaluate(server.x)
    metrics = {
        "algorithm": config.algorithm, "engine": engine, "dataset": config.dataset, "model": config.model,
        "clients": config.clients, "rounds": server.round, **final,
        "epsilon": max(eps), "epsilon_per_client": eps, "delta": config.delta,
        "releases_per_client": [ledger.steps for ledger in book], "noise_std": setup.noise.std,
        "noise_multiplier": setup.noise.noise_multiplier, "sensitivity": setup.clipping.sensitivity,
        "relation": "replace-one (one example or a client's whole dataset)",
        "accountant": "exact Gaussian composition of each client's ledger",
        "failures": failures, "ledgers": ledgers, "wall_time_s": wall, "history": history, "config": json.loads(config.to_json()),
    }
    if setup.problem.classes is not None and "test_accuracy" in final:
        d, n = server.x.numel(), config.clients
        warning = chance_warning(
            final["test_accuracy"], setup.problem.classes, f"sigma * sqrt(d / n) / clip, d = {d} parameters, n = {n} "
            "clients: the noise of the mean message over its largest clipped norm", setup.noise.std * math.sqrt(d / n)
            / config.clip, history[-1].get("clipped_fraction", 0.0) if history else 0.0,
            "more clients, fewer --rounds, a larger --epsilon or a smaller model",
            f"a round moves the server at most lr * clip = {config.lr * config.clip:.3g}; raise --lr or --clip")
        if warning is not None:
            metrics["warning"] = warning
            warnings.warn(warning, stacklevel=2)
    log(f"{config.algorithm} on {engine}: test accuracy {final.get('test_accuracy', float('nan')):.4f} after "
        f"{server.round} rounds; every client is ({max(eps):.4g}, {config.delta:g})-DP against the server "
        f"(local DP, replace-one)")
    return metrics



def save_outputs(out: str | Path, metrics: dict[str, Any], problem: Problem, x: torch.Tensor) -> None:
    """``out/metrics.json`` and ``out/model/``: the final server model ``x`` exported as ``dpopt train`` exports
    its model (``export_model``: ``model/model.pt``, the state_dict and no secret), each written atomically."""
    if problem.model is None:
        raise ValueError("this federated problem has no model to export")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / "metrics.json", lambda f: f.write(json.dumps(metrics, indent=2).encode()))
    trainable = [p for p in problem.model.parameters() if p.requires_grad]
    torch.nn.utils.vector_to_parameters(x.detach().clone(), trainable)  # a copy: x stays the server's
    export_model(problem.model, out / MODEL_DIR)
