"""The Flower engine (skipped without the ``flower`` extra): the ServerApp strategy and the stateful
ClientApp on Flower's simulation engine give the in-process run, through partial participation,
simulated dropouts (ClientApp exceptions) and a reply lost after the client sent it."""

import pytest
import torch

flwr = pytest.importorskip("flwr")

from flwr.app import Error  # noqa: E402

from dpopt.federated import flower  # noqa: E402
from dpopt.federated.config import FederatedConfig, build_setup  # noqa: E402
from dpopt.federated.simulator import run_inprocess  # noqa: E402

LOST = (3, 1)  # (round, client): the reply is dropped after the client computed and staged its update


def lose_reply(msg, context, call_next):
    """A ClientApp mod: the client runs (state saved, release recorded), but the server gets an error."""
    reply = call_next(msg, context)
    if msg.metadata.message_type == "train" and \
            (int(msg.content["config"]["round"]), int(context.node_config["partition-id"])) == LOST:
        return msg.create_error_reply(Error(code=0, reason="reply lost in transit"))
    return reply


def test_flower_simulation_equals_the_in_process_run():
    config = FederatedConfig(algorithm="clip21-sgd2m", dataset="digits", model="mlp", clients=3, rounds=5,
                             noise_multiplier=0.5, clip=0.05, lr=0.5, beta=0.5, beta_hat=0.5, participation=0.7,
                             dropout=0.2, eval_every=5)
    local = run_inprocess(build_setup(config, key=7), progress=False, log=print,
                          faults=lambda t, i: "lost" if (t, i) == LOST else None)
    remote = flower.run_simulation(config, mods=[lose_reply], secret_seed=7)  # the same replayable noise
    assert local.metrics["failures"]["crashed"] > 0 and local.metrics["failures"]["lost"] == 1
    assert remote.metrics["failures"]["crashed_or_lost"] == sum(local.metrics["failures"].values())
    torch.testing.assert_close(remote.x, local.x, rtol=1e-5, atol=1e-6)
    assert remote.metrics["releases_per_client"] == local.metrics["releases_per_client"]
    assert remote.metrics["epsilon_per_client"] == pytest.approx(local.metrics["epsilon_per_client"])
    assert remote.metrics["test_accuracy"] == pytest.approx(local.metrics["test_accuracy"], abs=1e-3)
