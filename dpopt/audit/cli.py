"""``dpopt audit``: run the audit of one algorithm and print the bound (``--json`` for machines)."""

from __future__ import annotations

import argparse
import json

from dpopt.algorithms import ALGORITHMS
from dpopt.audit.auditor import AUDIT_SETUPS, AuditSpec, audit
from dpopt.device import add_device_arguments


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = AuditSpec()
    p.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    p.add_argument("--algorithm", default="dp-sgd", choices=sorted(set(ALGORITHMS) | set(AUDIT_SETUPS)))
    p.add_argument("--epsilon", type=float, default=d.epsilon, help="budget the audited run's noise is calibrated to")
    p.add_argument("--delta", type=float, default=d.delta, help="delta of the claim and of the bound")
    p.add_argument("--steps", type=int, default=d.steps, help="steps of the audited run")
    p.add_argument("--sample-rate", type=float, default=d.sample_rate, help="Poisson sampling rate of the run")
    p.add_argument("--canaries", type=int, help="number of canaries (default: the family's setup decides)")
    p.add_argument("--confidence", type=float, default=d.confidence, help="confidence of the lower bound")
    p.add_argument("--calibration", type=float, default=d.calibration,
                   help="fraction of the canaries that only choose the test's threshold")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the canary draw (which canaries are present)")
    p.add_argument("--secret-seed", type=int, metavar="N",
                   help="key the audited runs' secret streams from N, for a reproducible audit (default: fresh "
                        "OS entropy for every run)")
    add_device_arguments(p)
    p.add_argument("--json", action="store_true",
                   help='print {"epsilon_claimed": ..., "epsilon_lower": ..., "confidence": ...}')


def run(args: argparse.Namespace) -> int:
    spec = AuditSpec(epsilon=args.epsilon, delta=args.delta, steps=args.steps, sample_rate=args.sample_rate,
                     canaries=args.canaries, confidence=args.confidence, calibration=args.calibration,
                     seed=args.seed, secret_seed=args.secret_seed, device=args.device)
    result = audit(args.algorithm, spec)
    if args.json:
        print(json.dumps({"epsilon_claimed": result.epsilon_claimed, "epsilon_lower": result.epsilon_lower,
                          "confidence": result.confidence}))
    else:
        print(result.statement())
    return 0
