"""Flower adapters (flwr >= 1.20 message API): a ServerApp strategy and a ClientApp around the same core.

Spec §9. The server (``Clip21Strategy``) keeps x and g; each round it asks its participants, sums the
messages that arrive in client order and closes the round with ``ServerState.apply``: the same code as the
in-process simulator. The ClientApp is rebuilt for every message, so a client keeps v_i, g_i, its ledger
and its staged update in the run's ``Context.state`` (Flower's stateful-ClientApp pattern).

Staged commit: a client sends c_i and stages its new (v_i, g_i); the server tells it, in its next
message, the last round whose message it aggregated ("accepted-round"), and the client then commits or
discards the staged state. So a reply lost on the way leaves g_i equal to what the server added (eq. 16
holds), while the client's ledger still counts the message, which did leave the client.

Clients are identified by ``partition-id`` from their node config; a SuperNode may also hold a
``secret-seed`` there (replayable noise, for reproductions), which never reaches the server; without it
each client process draws its own key from OS entropy, which nothing stores. Flower's own DP mods are not
stacked on top: they clip and noise model updates, a different mechanism (spec §9).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch

try:
    from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp
    from flwr.serverapp.strategy import Strategy
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError("the Flower engine needs the flower extra: pip install 'dpopt[flower]' "
                      "(flwr[simulation])") from e

from dpopt.federated.config import FederatedConfig, Setup, build_setup, drops_out, participants
from dpopt.federated.privacy import client_ledger, client_stream
from dpopt.federated.rules import ServerState, client_update
from dpopt.federated.simulator import ClientFailure, RunResult, failure_message, finish, save_outputs
from dpopt.noise.rng import secret_key
from dpopt.privacy import PrivacyLedger

CONFIG_KEY = "dpopt-config"
OUT_KEY = "out"
ARRAYS, META = "dpopt.client.arrays", "dpopt.client.meta"


def _flat(record: ArrayRecord, key: str) -> torch.Tensor:
    return torch.tensor(record[key].numpy())


def _array(t: torch.Tensor) -> Array:
    return Array(t.detach().clone())


@functools.lru_cache(maxsize=4)
def _setup(config_json: str, key: int | bytes | None) -> Setup:
    torch.set_num_threads(1)
    return build_setup(FederatedConfig.from_json(config_json), key=key)


# ---------------------------------------------------------------------------------------------- client


class ClientState:
    """A client's persistent state in ``Context.state``: committed v_i, g_i, a staged update, its ledger."""

    def __init__(self, setup: Setup, record: RecordDict) -> None:
        d = setup.problem.x0.numel()
        self.arrays = record.array_records.get(ARRAYS, ArrayRecord())
        meta = record.config_records.get(META, ConfigRecord({"pending-round": 0, "ledger": ""}))
        self.pending_round = int(meta["pending-round"])
        self.ledger = PrivacyLedger.from_dict(json.loads(str(meta["ledger"]))) if meta["ledger"] else client_ledger()
        zeros = torch.zeros(d)
        self.v = _flat(self.arrays, "v") if "v" in self.arrays else (zeros.clone() if setup.method.momentum else None)
        self.g = _flat(self.arrays, "g") if "g" in self.arrays else (zeros.clone() if setup.method.error_feedback else None)

    def settle(self, accepted_round: int) -> None:
        """Commit the staged update if the server aggregated that round's message, else drop it."""
        if self.pending_round:
            if self.pending_round == accepted_round:
                self.v = _flat(self.arrays, "pending-v") if "pending-v" in self.arrays else self.v
                self.g = _flat(self.arrays, "pending-g") if "pending-g" in self.arrays else self.g
            self.pending_round = 0

    def save(self, record: RecordDict, staged: dict[str, torch.Tensor | None], round: int) -> None:
        arrays = {k: _array(t) for k, t in [("v", self.v), ("g", self.g), ("pending-v", staged.get("v")),
                                             ("pending-g", staged.get("g"))] if t is not None}
        record[ARRAYS] = ArrayRecord(arrays)
        record[META] = ConfigRecord({"pending-round": round, "ledger": json.dumps(self.ledger.to_dict())})


def make_client_app(config_json: str | None = None, key: int | bytes | None = None,
                    mods: Sequence[Callable] = ()) -> ClientApp:
    """The ClientApp. ``config_json``/``key`` are given by the in-process simulation launcher; a SuperNode
    reads the config from the run config and a secret seed, if the run has one, from its own node config
    (without one, each client process draws its own key from OS entropy)."""
    app = ClientApp(mods=list(mods))

    def setup_of(context: Context) -> tuple[Setup, int]:
        seed = key
        if config_json is None:
            seed = int(context.node_config["secret-seed"]) if "secret-seed" in context.node_config else None
        return _setup(config_json or str(context.run_config[CONFIG_KEY]), seed), int(context.node_config["partition-id"])

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        setup, i = setup_of(context)
        conf = msg.content["config"]
        t = int(conf["round"])
        state = ClientState(setup, context.state)
        state.settle(int(conf["accepted-round"]))
        if drops_out(setup.config, t, i):
            raise RuntimeError(f"simulated dropout of client {i} in round {t}")
        x = _flat(msg.content["model"], "x")
        grads = setup.problem.oracle(x, [i], t)
        update = client_update(setup.method, setup.clipping, grads, None if state.v is None else state.v[None],
                               None if state.g is None else state.g[None])
        message = update.delta[0].clone()
        if setup.noise.std > 0:
            message.add_(client_stream(setup.secret_key, i, "noise").normals([message.shape], t)[0],
                         alpha=setup.noise.std)
        state.ledger.record(setup.noise.release())
        state.save(context.state, {"v": None if update.v is None else update.v[0],
                                   "g": None if update.g is None else update.g[0]}, t)
        return msg.create_reply(RecordDict({
            "message": ArrayRecord({"c": _array(message)}),
            "stats": MetricRecord({"partition-id": i, "clipped": int(update.clipped[0]),
                                   "releases": state.ledger.steps})}))

    @app.query()
    def query(msg: Message, context: Context) -> Message:
        """Who am I (partition id), and my ledger (for the run's final accounting)."""
        meta = context.state.config_records.get(META)
        ledger = str(meta["ledger"]) if meta is not None else json.dumps(client_ledger().to_dict())
        return msg.create_reply(RecordDict({"identity": ConfigRecord(
            {"partition-id": int(context.node_config["partition-id"]), "ledger": ledger})}))

    return app


# ---------------------------------------------------------------------------------------------- server


class Clip21Strategy(Strategy):
    """Server side of Clip-SGD / Clip21-SGD / Clip21-SGD2M: unweighted sums of the messages, x and g."""

    def __init__(self, setup: Setup, bar: Any = None) -> None:
        self.setup = setup
        self.server = ServerState.start(setup.problem.x0)
        self.nodes: dict[int, int] = {}
        self.accepted = [0] * setup.config.clients
        self.asked = [0] * setup.config.clients
        self.failures = {"crashed_or_lost": 0}
        self.history: list[dict[str, Any]] = []
        self.clipped = 0
        self.bar = bar

    def discover(self, grid: Grid, timeout: float = 600.0) -> None:
        """Wait for the n SuperNodes and learn which client (partition id) each node is; nodes that have not
        answered are asked again until ``timeout``."""
        n, deadline = self.setup.config.clients, time.monotonic() + timeout
        while len(nodes := list(grid.get_node_ids())) < n:
            if time.monotonic() > deadline:
                raise ClientFailure(f"only {len(nodes)} of {n} SuperNodes connected within {timeout:.0f} s")
            time.sleep(0.2)
        replies, errors = self._query(grid, nodes, deadline)
        for reply in replies:
            self.nodes[int(reply.content["identity"]["partition-id"])] = reply.metadata.src_node_id
        if sorted(self.nodes) != list(range(n)):
            raise ClientFailure(f"the SuperNodes' partition ids are {sorted(self.nodes)}; expected 0..{n - 1} "
                                "(set --node-config 'partition-id=i num-partitions=n' on each SuperNode)"
                                + (f"; errors: {'; '.join(errors)}" if errors else ""))

    def _query(self, grid: Grid, nodes: Iterable[int], deadline: float) -> tuple[list[Message], list[str]]:
        """Ask each node who it is (and for its ledger), asking again the ones that have not answered until
        ``deadline`` (monotonic clock); stops early on error replies, which are returned."""
        waiting, replies, errors = set(nodes), [], []
        while waiting and not errors and time.monotonic() < deadline:
            messages = [grid.create_message(RecordDict(), MessageType.QUERY, node, "query") for node in waiting]
            for reply in grid.send_and_receive(messages, timeout=max(1.0, deadline - time.monotonic())):
                if reply.has_error():
                    errors.append(reply.error.reason)
                elif reply.metadata.src_node_id in waiting:
                    waiting.discard(reply.metadata.src_node_id)
                    replies.append(reply)
        return replies, errors

    def ledgers(self, grid: Grid, timeout: float = 600.0) -> list[dict]:
        """Every client's ledger, read from the clients themselves (they know what they released). A client
        that cannot be reached is charged one release per round it was asked (an upper bound)."""
        out = []
        for asked in self.asked:
            ledger = client_ledger()
            if asked:
                ledger.record(replace(self.setup.noise.release(), steps=asked))
            out.append(ledger.to_dict())
        for reply in self._query(grid, self.nodes.values(), time.monotonic() + timeout)[0]:
            identity = reply.content["identity"]
            out[int(identity["partition-id"])] = json.loads(str(identity["ledger"]))
        return out

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        x = ArrayRecord({"x": _array(self.server.x)})
        asked = participants(self.setup.config, server_round)
        for i in asked:
            self.asked[i] += 1
        return [grid.create_message(
            RecordDict({"model": x, "config": ConfigRecord({"round": server_round,
                                                             "accepted-round": self.accepted[i]})}),
            MessageType.TRAIN, self.nodes[i], str(server_round)) for i in asked]

    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        got: dict[int, torch.Tensor] = {}
        clipped = 0
        for reply in replies:
            if reply.has_error():
                continue
            got[int(reply.content["stats"]["partition-id"])] = _flat(reply.content["message"], "c")
            clipped += int(reply.content["stats"]["clipped"])
        asked = participants(self.setup.config, server_round)
        failed = [i for i in asked if i not in got]
        if failed and self.setup.config.on_failure == "abort":
            raise ClientFailure(failure_message(server_round, failed, []))
        self.failures["crashed_or_lost"] += len(failed)
        for i in got:
            self.accepted[i] = server_round
        total = torch.stack([got[i] for i in sorted(got)]).sum(0) if got else torch.zeros_like(self.server.x)
        self.server.apply(self.setup.method, total, len(got), self.setup.config.clients)
        self.clipped = clipped
        if self.bar is not None:
            self.bar.update(1)
        return ArrayRecord({"x": _array(self.server.x)}), MetricRecord({"delivered": len(got), "failed": len(failed)})

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        return []  # evaluation is centralised (``evaluate``)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        return None

    def evaluate(self, server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        config = self.setup.config
        if server_round == 0 or (server_round % config.eval_every and server_round != config.rounds):
            return None
        result = self.setup.problem.evaluate(self.server.x)
        asked = len(participants(config, server_round))
        self.history.append({"round": server_round, **result, "clipped_fraction": self.clipped / max(1, asked)})
        if self.bar is not None:
            self.bar.set_postfix(acc=f"{result.get('test_accuracy', float('nan')):.4f}")
        return MetricRecord(result)

    def summary(self) -> None:
        c = self.setup.config
        logging.getLogger("flwr").info("%s: %d clients, clip %g (%s), noise std %g, %d rounds", c.algorithm,
                                       c.clients, c.clip, c.clipping, self.setup.noise.std, c.rounds)


def make_server_app(config_json: str | None = None, results: dict[str, Any] | None = None,
                    bar: Any = None) -> ServerApp:
    """The ServerApp: discovery, the rounds (``Strategy.start``), the clients' ledgers, the metrics.
    ``results`` (in-process launch) receives the metrics; a run config ``out`` gets ``metrics.json``."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        torch.set_num_threads(1)
        setup = build_setup(FederatedConfig.from_json(config_json or str(context.run_config[CONFIG_KEY])))
        # (the server draws nothing secret: its setup's key is never used)
        strategy = Clip21Strategy(setup, bar)
        start = time.perf_counter()
        strategy.discover(grid)
        strategy.start(grid, ArrayRecord({"x": _array(setup.problem.x0)}), num_rounds=setup.config.rounds,
                       evaluate_fn=strategy.evaluate)
        metrics = finish(setup, strategy.server, strategy.ledgers(grid), strategy.history, strategy.failures,
                         time.perf_counter() - start, "flower", logging.getLogger("flwr").info)
        if results is not None:
            results.update(metrics=metrics, x=strategy.server.x.clone())
        if OUT_KEY in context.run_config and context.run_config[OUT_KEY]:
            save_outputs(str(context.run_config[OUT_KEY]), metrics, setup.problem, strategy.server.x)

    return app


# Entry points for SuperLink / SuperNode deployments (the Flower app's components).
server_app = make_server_app()
client_app = make_client_app()


def run_simulation(config: FederatedConfig, bar: Any = None, mods: Sequence[Callable] = (),
                   cpus: int = 2, secret_seed: int | None = None) -> RunResult:
    """Run on Flower's simulation engine (Ray), with one virtual SuperNode per client; the clients' key is
    ``secret_seed`` (replayable) or drawn here from OS entropy, and reaches the clients only."""
    from flwr.simulation import run_simulation as flwr_run_simulation

    root = str(Path(__file__).resolve().parents[2])  # Ray workers import dpopt from here
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in [root, os.environ.get("PYTHONPATH", "")] if p)
    results: dict[str, Any] = {}
    config_json = config.to_json()
    flwr_run_simulation(
        make_server_app(config_json, results, bar),
        make_client_app(config_json, secret_key(secret_seed), mods),
        num_supernodes=config.clients,
        backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                        "init_args": {"num_cpus": cpus, "include_dashboard": False}})
    if not results:
        raise RuntimeError("the Flower simulation ended without results; see the log above")
    return RunResult(results["metrics"], results["x"])
