"""``dpopt federated``: one federated run with local DP, in process or on Flower; with ``--out DIR`` it writes
DIR/metrics.json and DIR/model/ (the final server model, exported as ``dpopt train`` exports its own), under
``dpopt train``'s conventions (an existing run refused unless ``--overwrite``, the folder checked to be
writable before anything runs)."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import sys
from typing import Any

from tqdm.auto import tqdm

from dpopt.checkpoint import claim_run_folder
from dpopt.data.datasets import DATASETS
from dpopt.device import add_device_arguments
from dpopt.federated.config import ENGINES, FAILURE_POLICIES, FederatedConfig, build_setup
from dpopt.federated.partition import SPLITS
from dpopt.federated.privacy import CALIBRATIONS
from dpopt.federated.rules import ALGORITHMS, CLIP_MODES
from dpopt.federated.simulator import ClientFailure, run_inprocess, save_outputs
from dpopt.models import MODELS
from dpopt.names import add_renamed_flags
from dpopt.export import MODEL_DIR

RUNTIMES = ("simulation", "deployment")
RUN_FILES = ("metrics.json", MODEL_DIR)  # what a run writes in --out
RANDOMNESS_NOTE = {
    "os-entropy-key": "Client noise and batches came from a key drawn from OS entropy for this run; nothing "
                      "stores it.",
    "secret-seed": "REPLAYABLE noise: --secret-seed was given, so anyone who knows it can regenerate and remove "
                   "the clients' noise.",
}


def _batch_size(text: str) -> int | None:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, or 0 for all local data; got {text}")
    return value or None


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = FederatedConfig()
    p.add_argument("--algorithm", default=d.algorithm, choices=ALGORITHMS)
    p.add_argument("--dataset", default=d.dataset, choices=sorted(DATASETS))
    p.add_argument("--model", default=d.model, choices=sorted(MODELS))
    p.add_argument("--clients", type=int, default=d.clients, help="number of clients n")
    p.add_argument("--rounds", type=int, default=d.rounds, help="communication rounds T")
    budget = p.add_mutually_exclusive_group(required=True)
    budget.add_argument("--epsilon", type=float, help="per-client target epsilon (local DP); the noise is calibrated")
    budget.add_argument("--noise-multiplier", type=float,
                        help="sigma_omega / sensitivity (the paper's noise-to-clip ratio); 0 = no privacy")
    p.add_argument("--delta", type=float, default=d.delta)
    p.add_argument("--calibration", default=d.calibration, choices=CALIBRATIONS,
                   help="with --epsilon: the PLD accountant, or the paper's closed form via advanced composition "
                        "(Corollary 1, epsilon < 1)")
    p.add_argument("--clip", type=float, default=d.clip, help="clip radius tau of every message")
    p.add_argument("--clipping", default=d.clipping, choices=CLIP_MODES,
                   help="one norm for the whole message, or --clip per parameter tensor (sensitivity clip*sqrt(K))")
    add_renamed_flags(p, tau="--clip", noise_calibration="--calibration")
    p.add_argument("--lr", type=float, default=d.lr, help="server step size gamma")
    p.add_argument("--beta", type=float, help="client momentum beta (clip21-sgd2m; default 0.1)")
    p.add_argument("--beta-hat", type=float, help="shift and server damping beta-hat (clip21-sgd2m; default 1)")
    p.add_argument("--batch-size", type=_batch_size, default=d.batch_size,
                   help="examples per client and round (0: all local data)")
    p.add_argument("--split", default=d.split, choices=SPLITS, help="how the training set is split over clients")
    p.add_argument("--dirichlet-alpha", type=float, default=d.dirichlet_alpha)
    p.add_argument("--participation", type=float, default=d.participation,
                   help="fraction of clients the server asks each round")
    p.add_argument("--dropout", type=float, default=d.dropout,
                   help="probability that an asked client fails before sending (simulated failures)")
    p.add_argument("--on-failure", default=d.on_failure, choices=FAILURE_POLICIES,
                   help="finish the round with the clients that report, or stop with an error")
    p.add_argument("--seed", type=int, default=d.seed,
                   help="public seed: partition, initialisation, participation, dropout (never the noise)")
    p.add_argument("--secret-seed", type=int, metavar="N",
                   help="REPLAYABLE client noise and batches, for reproductions and tests: anyone who knows N can "
                        "remove the noise (default: a key from OS entropy, drawn per run and never stored)")
    p.add_argument("--secure", action="store_true", help=argparse.SUPPRESS)  # refused: the default now
    p.add_argument("--eval-every", type=int, default=d.eval_every)
    add_device_arguments(p, d.device)
    p.add_argument("--engine", default="inprocess", choices=ENGINES)
    p.add_argument("--flower-runtime", default="simulation", choices=RUNTIMES,
                   help="with --engine flower: Flower's simulation engine (Ray), or a SuperLink and n SuperNode "
                        "processes over loopback")
    p.add_argument("--out", help="run folder: metrics.json and model/; an existing run there is refused unless "
                                 "--overwrite")
    p.add_argument("--overwrite", action="store_true", help="replace the run already in --out")
    p.add_argument("--no-progress", action="store_true")


def config_from(args: argparse.Namespace) -> FederatedConfig:
    names = {f.name for f in dataclasses.fields(FederatedConfig)}
    return FederatedConfig(**{k: v for k, v in vars(args).items() if k in names})


def _flower() -> Any:
    if importlib.util.find_spec("flwr") is None:
        raise ValueError("--engine flower needs Flower: pip install 'dpopt[flower]' (flwr[simulation])")
    from dpopt.federated import flower

    return flower


def run(args: argparse.Namespace) -> int:
    if args.secure:
        raise ValueError("--secure is gone: the clients' noise now comes from OS entropy by default (a key "
                         "drawn per run, never stored); --secret-seed N makes it replayable")
    config = config_from(args)
    if args.engine == "flower" and config.device != "cpu":
        raise ValueError(f"--device {config.device} runs the in-process engine on that device; Flower's clients "
                         "and server run on the CPU (drop --device or use --engine inprocess)")
    mode = "os-entropy-key" if args.secret_seed is None else "secret-seed"
    deployment = args.engine == "flower" and args.flower_runtime == "deployment"
    if args.out is not None:
        claim_run_folder(args.out, RUN_FILES, args.overwrite)
    elif deployment:
        raise ValueError("--flower-runtime deployment writes its Flower app and logs to --out; give --out DIR")
    try:
        if deployment:
            _flower()
            build_setup(config)
            from dpopt.federated.deploy import run_deployment

            metrics = run_deployment(config, args.out, secret_seed=args.secret_seed)
        else:
            if args.engine == "inprocess":
                setup = build_setup(config, key=args.secret_seed)
                result = run_inprocess(setup, progress=not args.no_progress)
            else:
                flower = _flower()
                setup = build_setup(config)  # refuse bad input before Flower starts; its model exports the result
                with tqdm(total=config.rounds, desc=f"{config.algorithm} on Flower",
                          disable=args.no_progress) as bar:
                    result = flower.run_simulation(config, bar, secret_seed=args.secret_seed)
            metrics = {**result.metrics, "secret_randomness": mode}  # the server cannot know; the launcher does
            if args.out is not None:
                save_outputs(args.out, metrics, setup.problem, result.x)
    except ClientFailure as e:
        print(f"dpopt: error: {e}", file=sys.stderr)
        return 3
    print(f"test accuracy {metrics['test_accuracy']:.4f}; per-client epsilon {metrics['epsilon']:.4g} "
          f"(delta {metrics['delta']:g}, local DP) after {metrics['rounds']} rounds"
          + (f"; wrote {args.out}/metrics.json" if args.out is not None else ""))
    print(RANDOMNESS_NOTE[mode])
    return 0
