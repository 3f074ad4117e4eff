"""The ``dpopt`` command. With no arguments it runs the digits demo (``dpopt train`` with its defaults)."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import json
import os
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any, Callable, NoReturn, Sequence

from dpopt import names
from dpopt.names import did_you_mean
from dpopt.algorithms import (ALGORITHMS, DEFAULT_NOISE, DEFAULT_SAMPLING, DEFAULT_TREE_DECODER, DEFAULTS, NON_PRIVATE,
                              applies_to, hyperparameters_for)
from dpopt.algorithms.hyperparameters import all_fields
from dpopt.checkpoint import CHECKPOINT, CheckpointError, check_writable, claim_run_folder, load_checkpoint
from dpopt.clipping import CLIP_MODES
from dpopt.data.datasets import (DATASET_EPOCHS, DATASET_MODEL, DATASETS, DEFAULT_EPOCHS, DEFAULT_MODEL,
                                 DatasetNotFound, check_dataset)
from dpopt.data.samplers import SAMPLINGS
from dpopt.device import add_device_arguments
from dpopt.distributed import DataParallel, from_environment, launch
from dpopt.extras import MissingExtra
from dpopt.grad.engine import MODES, STRATEGIES
from dpopt.grad.graphs import GRAPH_CHOICES
from dpopt.models import MODEL_TRAINABLE, MODELS, check_model
from dpopt.noise.mechanisms import NOISES, TREE_DECODERS, WORKLOADS
from dpopt.privacy import (AccountingError, CyclicPoissonSampling, FixedParticipation, GaussianRelease, PoissonSampling,
                           Relation, epsilon_of, noise_multiplier_for)
from dpopt.report import CURVES, LOG, TENSORBOARD
from dpopt.run import CALIBRATIONS, MODEL_DIR, TrainConfig, extended, resume, saved_steps_per_epoch, train
from dpopt.schedules import SCHEDULES
from dpopt.sharded import SHARDABLE
from dpopt.sharded import refusal as shard_refusal

DEFAULT_EPSILON = 2.0
RUN_FILES = (CHECKPOINT, "metrics.json", LOG, CURVES, TENSORBOARD, MODEL_DIR)  # what dpopt train writes in --out


class _Parser(argparse.ArgumentParser):
    """Short errors: the message, a "did you mean" for a mistyped name, and where the usage is (exit 2)."""

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        if action.choices is not None and value not in action.choices:
            names = [str(c) for c in action.choices]
            raise argparse.ArgumentError(action, f"invalid choice {value!r}{did_you_mean(str(value), names)} "
                                                 f"(choose from {', '.join(names)})")

    def parse_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> argparse.Namespace:
        known, extras = self.parse_known_args(args, namespace)
        if extras:  # refused by the subcommand's parser, with its options to suggest
            command = getattr(known, "command", None)
            sub = next((a.choices[command] for a in self._actions
                        if isinstance(a, argparse._SubParsersAction) and command in a.choices), self)
            options = [o for a in sub._actions for o in a.option_strings]
            sub.error(f"unrecognized arguments: {' '.join(extras)}{did_you_mean(extras[0], options)}")
        return known

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"dpopt: error: {message}\nrun '{self.prog} --help' for usage\n")


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text}")
    return value


def _checked(check: Callable[[str], None], names: Sequence[str]) -> Callable[[str], str]:
    """An argparse type that refuses what ``check`` refuses, with its message and a "did you mean"."""

    def parse(text: str) -> str:
        try:
            check(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"{e}{did_you_mean(text, names)}") from None
        return text

    return parse


def _defaults_text(name: str, default: Any) -> str:
    """'default: 0.5; 0.15/sqrt(steps) for dp-adam, dp-adamw': a hyper-parameter's default and the recipes' own."""
    own: dict[Any, list[str]] = {}
    for algorithm, values in sorted(DEFAULTS.items()):
        if name in values:
            own.setdefault(values[name], []).append(algorithm)
    shown = lambda v: " ".join(map(str, v)) if isinstance(v, tuple) else str(v)  # noqa: E731
    return "; ".join([f"default: {shown(default)}", *(f"{shown(v)} for {', '.join(a)}" for v, a in own.items())])


def _applies_text(name: str) -> str:
    """'dp-adam, dp-adamw, ...': the recipes whose hyper-parameters include ``name`` (all: no text)."""
    users = applies_to(name)
    return "every algorithm" if len(users) == len(ALGORITHMS) else ", ".join(users)


def _own_noise_text() -> str:
    """'tree: dp-ftrl, dp-srgd; mf: dp-memf': the recipes whose own noise is correlated, by mechanism."""
    own: dict[str, list[str]] = {}
    for algorithm, noise in sorted(DEFAULT_NOISE.items()):
        if noise != "gaussian":
            own.setdefault(noise, []).append(algorithm)
    return "; ".join(f"{noise}: {', '.join(names)}" for noise, names in own.items())


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except None (a hyper-parameter's default depends on the algorithm: its help says it)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        return action.help if action.default is None else super()._get_help_string(action)


def _add_train(sub: argparse._SubParsersAction) -> None:
    d = TrainConfig()
    p = sub.add_parser("train", help="private training run (default: the digits demo)",
                       formatter_class=_HelpFormatter)
    p.add_argument("--algorithm", default=d.algorithm, choices=sorted(ALGORITHMS))
    p.add_argument("--dataset", default=d.dataset, type=_checked(check_dataset, sorted(DATASETS)),
                   help=f"{', '.join(sorted(DATASETS))}; or your own: a CSV, JSONL or Parquet file or a "
                        "datasets.save_to_disk folder (a DatasetDict's test split, else 10%% held out)")
    p.add_argument("--text-column", default=d.text_column, help="a dataset file's text column (without one: "
                   "numeric feature columns)")
    p.add_argument("--label-column", default=d.label_column, help="a dataset file's label column (integers, or "
                   "strings numbered in sorted order)")
    p.add_argument("--model", type=_checked(check_model, MODELS),
                   help=f"{', '.join(MODELS)} (default: {DEFAULT_MODEL}; "
                        + "; ".join(f"{m} for {name}" for name, m in DATASET_MODEL.items())
                        + "); or your own: hf:PATH (a save_pretrained folder, loaded as a sequence classifier; its "
                          "tokenizer tokenizes the text) or module:function (function(dataset) -> nn.Module)")
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--epsilon", type=float, help=f"target epsilon (default {DEFAULT_EPSILON} unless "
                        "--noise-multiplier is given, or the algorithm is non-private: "
                        f"{', '.join(sorted(NON_PRIVATE))}); the noise is calibrated to it")
    budget.add_argument("--noise-multiplier", type=float, help="noise std / clip norm; epsilon is then reported")
    p.add_argument("--delta", type=float, default=d.delta)
    p.add_argument("--epochs", type=_positive_int, help=f"passes over the training set (default: {DEFAULT_EPOCHS}; "
                   + "; ".join(f"{e} for {name}" for name, e in DATASET_EPOCHS.items()) + ")")
    p.add_argument("--batch-size", type=_positive_int, default=d.batch_size,
                   help="expected batch size (Poisson) or batch size (shuffle, fixed) (default: 128, or the whole "
                        "training set if smaller)")
    p.add_argument("--physical-batch-size", type=int, default=d.physical_batch_size, metavar="N",
                   help="examples per forward/backward: a logical (sampled) batch is processed in chunks of at most "
                        "N whose clipped sums are added before the noise; same release, memory set by N (default: "
                        "256, or the whole training set if smaller)")
    add_device_arguments(p, d.device, precision=d.precision)
    p.add_argument("--graph", default=d.graph, choices=GRAPH_CHOICES,
                   help="capture each batch shape's forward, backward and clip stage as a CUDA graph and replay it "
                        "(batches padded to a few sizes with rows of weight 0; noise drawn outside the graph; each "
                        "graph checked against the eager step first): on, auto (where it can work, else eager with "
                        "a log line) or off (default)")
    p.add_argument("--clip", type=float, default=d.clip, help="per-example clip norm C")
    p.add_argument("--clipping", default=d.clipping, choices=CLIP_MODES)
    for f in all_fields().values():  # default None: the algorithm's own (hyperparameters_for)
        default = f.default
        flag = names.flag(f.name)
        text = f"{f.metadata['help']} ({_applies_text(f.name)}; {_defaults_text(f.name, default)})"
        if isinstance(default, tuple):
            p.add_argument(flag, type=type(default[0]), nargs=len(default), help=text)
        elif isinstance(default, bool):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, help=text)
        else:
            p.add_argument(flag, type=type(default), help=text)
    p.add_argument("--seed", type=int, default=d.seed,
                   help="public seed: initialisation, projections, directions, dropout (never the noise)")
    secret = p.add_mutually_exclusive_group()
    secret.add_argument("--secret-seed", type=int, metavar="N",
                        help="REPLAYABLE noise and batches, for reproductions and tests: anyone who knows N can "
                             "remove the noise (default: a secret key from OS entropy, kept only in the checkpoint)")
    secret.add_argument("--secure", action="store_true",
                        help="draw every secret number from OS entropy and store no key, not even in the "
                             "checkpoint (a resumed run continues with fresh randomness)")
    p.add_argument("--sampling", default=d.sampling, choices=["auto", *SAMPLINGS],
                   help="poisson (amplified accounting), cyclic (Poisson within --bands groups taken in turn: "
                   "amplified, for gaussian or banded noise) or shuffle/fixed (accounted without amplification); "
                   f"auto: cyclic for {', '.join(sorted(DEFAULT_SAMPLING))} with their own noise (amplified BandMF), "
                   "poisson for gaussian noise, fixed for other correlated noise")
    p.add_argument("--noise", default=d.noise, choices=["auto", *NOISES],
                   help="noise mechanism: gaussian (iid) or correlated (tree, sqrt, banded, mf; need fixed-order "
                   f"batches, or cyclic sampling for banded/sqrt); auto: the algorithm's own ({_own_noise_text()}; "
                   "banded under cyclic sampling; others: gaussian)")
    p.add_argument("--bands", type=int, default=d.bands,
                   help="bands of --noise banded/sqrt/mf, and the period of --sampling cyclic (0: one epoch's steps "
                        "for banded, all for sqrt; under cyclic sampling, chosen for the privacy target)")
    p.add_argument("--workload", default=d.workload, choices=WORKLOADS,
                   help="what an optimised factorization (--noise mf, banded) targets: ones (prefix sums) or true "
                        "(with --momentum and, for dp-srg-memf, --decay)")
    p.add_argument("--tree-decoder", choices=TREE_DECODERS,
                   help="--noise tree: sum (dyadic decomposition) or least-squares (default: sum; "
                        + ", ".join(f"{v} for {a}" for a, v in sorted(DEFAULT_TREE_DECODER.items())) + ")")
    p.add_argument("--lr-schedule", default=d.lr_schedule, choices=SCHEDULES,
                   help="the learning rate over the run, after the warm-up: constant, cosine (annealed to 0) or "
                        "linear (decayed to 0); a run with a schedule cannot be extended")
    p.add_argument("--warmup", type=float, default=d.warmup, metavar="FRACTION_OR_STEPS",
                   help="linear warm-up of the learning rate: a fraction of the run's steps if below 1, else steps")
    p.add_argument("--accountant", default=d.accountant, choices=["pld", "rdp"])
    p.add_argument("--relation", default=d.relation, choices=[r.value for r in Relation])
    p.add_argument("--per-example", default=d.per_example, choices=MODES,
                   help="layer hooks with a torch.func fallback, or torch.func for the whole model")
    p.add_argument("--strategy", default=d.strategy, choices=STRATEGIES,
                   help="per layer: ghost norms + book-keeping, materialised per-example gradients, or auto")
    p.add_argument("--download", action="store_true", help="allow downloading a dataset that is not on disk")
    p.add_argument("--out", help="run folder: checkpoints, metrics.json (from the first evaluation on), train.log, "
                                 "curves.png, TensorBoard events (with tensorboard) and model/; an existing run "
                                 "there is refused unless --overwrite")
    p.add_argument("--overwrite", action="store_true", help="replace the run already in --out")
    p.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every, metavar="N",
                   help="also checkpoint after every N-th step within an epoch, so a crash loses at most N steps "
                        "(0: at epoch ends only)")
    p.add_argument("--calibration", default=d.calibration, choices=CALIBRATIONS,
                   help="how --epsilon sets iid noise: the ledger's accountant (tight, with amplification), or "
                        "DPZero's advanced-composition formula (Lemma 2.2; loose, for faithful reproductions); "
                        "the reported epsilon is always the ledger's")
    p.add_argument("--trainable", metavar="REGEX",
                   help="train only the parameters whose names match this regular expression (e.g. 'head|bias' "
                        "for a head plus BitFit); the others stay frozen at their pretrained values. Default: "
                        "every weight, except " + "; ".join(f"'{p}' for {m}" for m, p in MODEL_TRAINABLE.items())
                        + " ('.' trains every weight)")
    p.add_argument("--resume", metavar="DIR", help="continue the run whose checkpoint is in DIR; a larger --epochs "
                   "extends it, any other flag that differs from the run's is refused")
    p.add_argument("--nproc", type=_positive_int, default=1,
                   help="data-parallel: split each step over N local processes (gloo); under torchrun the "
                        "launcher's RANK/WORLD_SIZE are used instead")
    p.add_argument("--shard", action="store_true",
                   help="with --nproc N or torchrun: shard the parameters, gradients and optimizer state over the "
                        "processes (FSDP2), each holding 1/N of them; the same run as unsharded "
                        f"({', '.join(SHARDABLE)})")
    p.add_argument("--no-progress", action="store_true")


PERIOD_HELP = ("cyclic Poisson sampling (--sampling cyclic, amplified BandMF): q is the rate within one of this "
               "many groups taken in turn (default 1: plain Poisson sampling)")


def _poisson(rate: float, period: int) -> PoissonSampling:
    return PoissonSampling(rate) if period == 1 else CyclicPoissonSampling(rate, period)


def _add_account(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("account", help="epsilon of a DP-SGD-style run")
    p.add_argument("--noise-multiplier", type=float, required=True)
    p.add_argument("--sample-rate", type=float, help="Poisson sampling rate q (omit for no amplification)")
    p.add_argument("--period", type=_positive_int, default=1, help=PERIOD_HELP)
    p.add_argument("--steps", type=_positive_int, required=True)
    p.add_argument("--steps-per-epoch", type=_positive_int, default=1,
                   help="without --sample-rate: each example is in one of every this many steps")
    p.add_argument("--delta", type=float, required=True)
    p.add_argument("--accountant", default="pld", choices=["pld", "rdp"])
    p.add_argument("--relation", default="add-remove", choices=[r.value for r in Relation])
    p.add_argument("--json", action="store_true")


def _add_calibrate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("calibrate", help="noise multiplier for a target (epsilon, delta)")
    p.add_argument("--epsilon", type=float, required=True)
    p.add_argument("--delta", type=float, required=True)
    p.add_argument("--sample-rate", type=float, required=True, help="Poisson sampling rate q")
    p.add_argument("--period", type=_positive_int, default=1, help=PERIOD_HELP)
    length = p.add_mutually_exclusive_group(required=True)
    length.add_argument("--steps", type=_positive_int)
    length.add_argument("--epochs", type=float, help="epochs of round(period/q) steps each")
    p.add_argument("--accountant", default="pld", choices=["pld", "rdp"])
    p.add_argument("--relation", default="add-remove", choices=[r.value for r in Relation])
    p.add_argument("--json", action="store_true")


# Subcommands: name -> (adds its parser, runs it). Feature modules add theirs with ``command``.
COMMANDS: dict[str, tuple[Callable[[argparse._SubParsersAction], None], Callable[[argparse.Namespace], int]]] = {}


def command(name: str, add: Callable[[argparse._SubParsersAction], None]):
    def register(run: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
        COMMANDS[name] = (add, run)
        return run

    return register


def _add_reproduce(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("reproduce", help="run a paper reproduction from the repository's experiments/ folder",
                       add_help=False)  # NAME --help goes to the experiment
    p.add_argument("-h", "--help", action="store_true", help="list the reproductions")
    p.add_argument("name", nargs="?", help="experiment module (experiments/NAME.py); omit to list them")
    p.add_argument("rest", nargs=argparse.REMAINDER, help="arguments for the experiment (try --help)")


def _experiments_dir() -> Path:
    return Path(__file__).resolve().parents[1] / "experiments"


def _summary(path: Path) -> str:
    """The first paragraph of a module's docstring, shortened to one line."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    return textwrap.shorten(" ".join(doc.split("\n\n")[0].split()), 110, placeholder=" ...")


@command("reproduce", _add_reproduce)
def _reproduce(args: argparse.Namespace) -> int:
    folder = _experiments_dir()
    if not (folder / "__init__.py").is_file() or not (folder.parent / "pyproject.toml").is_file():
        raise ValueError("dpopt reproduce needs a source checkout: the experiments/ folder is not part of the "
                         "installed package (clone the repository, pip install -e . and run it there)")
    names = sorted(p.stem for p in folder.glob("*.py") if not p.stem.startswith("_"))
    if args.help or not args.name:
        width = max(map(len, names))
        print("usage: dpopt reproduce NAME [ARGS ...]   (dpopt reproduce NAME --help: the experiment's own flags)\n")
        print("\n".join(f"{n:<{width}}  {_summary(folder / f'{n}.py')}" for n in names))
        return 0
    if args.name not in names:
        raise ValueError(f"unknown experiment {args.name!r}{did_you_mean(args.name, names)} "
                         f"(choose one of {', '.join(names)})")
    if str(folder.parent) not in sys.path:
        sys.path.insert(0, str(folder.parent))
    module = importlib.import_module(f"experiments.{args.name}")
    return int(module.main(args.rest) or 0)


def _add_bench(sub: argparse._SubParsersAction) -> None:
    from dpopt import bench

    bench.add_arguments(sub.add_parser("bench", help="time and memory of a step: PyTorch vs dpopt vs Opacus",
                                       formatter_class=_HelpFormatter))


@command("bench", _add_bench)
def _bench(args: argparse.Namespace) -> int:
    from dpopt import bench

    return bench.run(args)


def _add_federated(sub: argparse._SubParsersAction) -> None:
    from dpopt.federated import cli as federated

    federated.add_arguments(sub.add_parser(
        "federated", help="federated training with local DP: Clip-SGD, Clip21-SGD, Clip21-SGD2M",
        formatter_class=_HelpFormatter))


@command("federated", _add_federated)
def _federated(args: argparse.Namespace) -> int:
    from dpopt.federated import cli as federated

    return federated.run(args)


def _add_audit(sub: argparse._SubParsersAction) -> None:
    from dpopt.audit import cli as audit_cli

    audit_cli.add_arguments(sub.add_parser("audit", help="empirical privacy audit: a lower bound on epsilon "
                                           "from canaries, against the epsilon the run claims"))


@command("audit", _add_audit)
def _audit(args: argparse.Namespace) -> int:
    from dpopt.audit import cli as audit_cli

    return audit_cli.run(args)


def parser() -> argparse.ArgumentParser:
    top = _Parser(prog="dpopt", description="Differentially private training for PyTorch.")
    sub = top.add_subparsers(dest="command")
    for add, _ in COMMANDS.values():
        add(sub)
    return top


def _run_training(parallel: DataParallel | None, config: TrainConfig | None, out: str | None,
                  resume_from: str | None, progress: bool, epochs: int | None = None,
                  state: dict[str, Any] | None = None, shard: bool = False) -> None:
    """One process's part of ``dpopt train`` (all of it without ``parallel``); rank 0 prints. ``state``: the
    checkpoint of ``resume_from`` where this process has read it already; ``shard``: the ranks shard the model."""
    if parallel is not None:
        parallel.sharded = shard
    metrics = (resume(resume_from, progress, parallel=parallel, epochs=epochs, state=state) if resume_from
               else train(config, out, progress, parallel=parallel))
    if parallel is None or parallel.lead:
        eps = metrics["epsilon"]
        print(f"test accuracy {metrics['test_accuracy']:.4f} at epsilon {eps:{'.4f' if eps >= 0.01 else '.3g'}} "
              f"(delta {metrics['delta']:g}) after {metrics['steps']} steps, {metrics['wall_time_s']:.1f} s")


FREE_ON_RESUME = {"resume", "no_progress", "nproc", "shard", "download", "epochs"}  # how to run; epochs: see extended


def _given(argv: list[str]) -> set[str]:
    """The options given on the command line: ``argv`` parsed again with every default suppressed."""
    top = parser()
    for action in top._actions:
        if isinstance(action, argparse._SubParsersAction):
            for p in action.choices.values():
                for a in p._actions:
                    a.default = argparse.SUPPRESS
    return set(vars(top.parse_args(argv))) - {"command"}


def _resume_differences(args: argparse.Namespace, given: set[str], saved: TrainConfig) -> list[str]:
    """The flags given beside --resume whose values differ from the run's, as '--flag value (the run has x)'."""
    run = {**dataclasses.asdict(saved.hyperparameters),
           **{f.name: getattr(saved, f.name) for f in dataclasses.fields(saved)},
           "out": args.resume, "overwrite": False}
    differences = []
    for name in sorted(given - FREE_ON_RESUME):
        value, theirs = getattr(args, name), run[name]
        value = tuple(value) if isinstance(value, list) else value
        if name == "out":
            value, theirs = Path(value).resolve(), Path(theirs).resolve()
        if value != theirs:
            theirs = "none given: the default" if theirs is None else theirs  # e.g. --physical-batch-size
            differences.append(f"{names.flag(name)} {value} (the run has {theirs})")
    return differences


@command("train", _add_train)
def _train(args: argparse.Namespace) -> int:
    progress = not args.no_progress
    config = epochs = state = None
    follower = int(os.environ.get("RANK", "0")) > 0  # under torchrun: rank 0 reads the checkpoint and sends it
    if args.resume and follower:
        epochs = args.epochs if "epochs" in _given(args.argv) else None
    elif args.resume:
        state = load_checkpoint(args.resume)
        saved = TrainConfig.from_dict(state["config"])
        given = _given(args.argv)
        differences = _resume_differences(args, given, saved)
        if differences:
            raise ValueError("--resume continues the run as configured, and only a larger --epochs may extend it; "
                             f"these flags differ from the run's: {'; '.join(differences)}")
        epochs = args.epochs if "epochs" in given else None
        extended(saved, epochs, saved_steps_per_epoch(state))  # refuses before anything starts
        check_writable(args.resume)
    else:
        fields = {f.name for f in dataclasses.fields(TrainConfig)} - {"hyperparameters"}
        values = {k: v for k, v in vars(args).items() if k in fields}
        if (values["epsilon"] is None and values["noise_multiplier"] is None
                and values["algorithm"] not in NON_PRIVATE):
            values["epsilon"] = DEFAULT_EPSILON
        hp = hyperparameters_for(args.algorithm, names.flag, **{name: getattr(args, name) for name in all_fields()})
        config = TrainConfig(**values, hyperparameters=hp)
        config.validate()
        if args.out is not None:
            resumable = (Path(args.out) / CHECKPOINT).is_file()  # a federated run's folder has none
            claim_run_folder(args.out, RUN_FILES, args.overwrite,
                             hint=f"continue it with --resume {args.out}, " if resumable else "")
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if args.nproc > 1 and launched > 1:
        raise ValueError(f"--nproc {args.nproc} under a launcher that already started {launched} processes "
                         "(WORLD_SIZE is set); drop --nproc")
    if args.shard and not (follower and args.resume):  # rank 0 checks a resumed run for every rank
        _check_shard(TrainConfig.from_dict(state["config"]) if config is None else config, max(args.nproc, launched))
    if args.nproc > 1:
        del state  # each launched process reads the checkpoint itself; not one copy held here throughout
        launch(args.nproc, _run_training, config, args.out, args.resume, progress, epochs, None, args.shard)
    else:
        parallel = from_environment()
        try:
            _run_training(parallel, config, args.out, args.resume, progress, epochs, state, args.shard)
        finally:
            if parallel is not None:
                parallel.close()
    return 0


def _check_shard(config: TrainConfig, processes: int) -> None:
    """Refuse ``--shard`` where there is nothing to shard over or the run cannot shard yet, before it starts."""
    if processes < 2:
        raise ValueError("--shard splits the model over several processes: add --nproc N (N >= 2), or launch with "
                         "torchrun --nproc-per-node N")
    why = shard_refusal(config.algorithm, config.noise_kind, config.clipping, config.precision)
    if why is not None:
        raise ValueError(f"{why}; or drop --shard")


@command("account", _add_account)
def _account(args: argparse.Namespace) -> int:
    if args.sample_rate is None and args.period != 1:
        raise ValueError("--period is the cyclic period of Poisson sampling: give --sample-rate too")
    part = (_poisson(args.sample_rate, args.period) if args.sample_rate is not None
            else FixedParticipation(args.steps_per_epoch))
    eps = epsilon_of([GaussianRelease(args.noise_multiplier, part, args.steps)], args.delta, args.accountant,
                     args.relation)
    print(json.dumps({"epsilon": eps}) if args.json else f"epsilon = {eps:.6g} at delta = {args.delta:g}")
    return 0


@command("calibrate", _add_calibrate)
def _calibrate(args: argparse.Namespace) -> int:
    part = _poisson(args.sample_rate, args.period)
    steps = args.steps if args.steps is not None else max(1, round(args.epochs * round(args.period / args.sample_rate)))
    z = noise_multiplier_for(args.epsilon, args.delta, part, steps, args.accountant, args.relation)
    print(json.dumps({"noise_multiplier": z, "steps": steps}) if args.json else f"noise multiplier = {z:.6g}")
    return 0


def _show_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int, file: Any = None,
                  line: str | None = None) -> None:
    """A warning as a CLI user reads it: one line, like the errors, without the source line that raised it."""
    print(f"dpopt: warning: {message}", file=file or sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    top = parser()
    args = top.parse_args(argv or ["train"])
    args.argv = argv or ["train"]
    with warnings.catch_warnings():
        warnings.showwarning = _show_warning
        try:
            return COMMANDS[args.command][1](args)
        except (ValueError, AccountingError, DatasetNotFound, CheckpointError, MissingExtra) as e:
            top.exit(2, f"dpopt: error: {e}\n")


if __name__ == "__main__":
    sys.exit(main())
