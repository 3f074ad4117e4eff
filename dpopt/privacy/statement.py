"""A human-readable privacy statement for the end of a run (after TF Privacy's
``compute_dp_sgd_privacy_statement``): what was released, under which relation, and what epsilon means."""

from __future__ import annotations

import math

from dpopt.privacy.ledger import FixedParticipation, PoissonSampling, PrivacyLedger, Relation


def privacy_statement(ledger: PrivacyLedger, delta: float, dataset_size: int | None = None,
                      unit: str = "example", secure: bool | None = None) -> str:
    """``secure``: True if the secret randomness came from OS entropy, False if it was derived from the run's
    seed (then the guarantee needs that seed kept secret), None if the caller does not say."""
    eps = ledger.epsilon(delta)
    if math.isinf(eps):
        lines = ["Privacy statement", "-----------------",
                 "This run is NOT differentially private (epsilon = inf): it released statistics without noise."]
        lines += [f"  - {e.steps} releases, noise multiplier {e.noise_multiplier:.4g}." for e in ledger.entries]
        return "\n".join(lines)
    other = "rdp" if ledger.accountant == "pld" else "pld"
    try:
        eps_other: float | None = ledger.epsilon(delta, other)
    except ValueError:
        eps_other = None
    relation = ("adding or removing one " + unit if ledger.relation == Relation.ADD_REMOVE
                else "replacing one " + unit + " by another")
    lines = ["Privacy statement", "-----------------",
             f"This run satisfies ({eps:.4g}, {delta:.3g})-differential privacy with respect to {relation}"
             f" (accountant: {ledger.accountant.upper()}"
             + (f"; {other.upper()} gives epsilon {eps_other:.4g}" if eps_other is not None else "") + ")."]
    for e in ledger.entries:
        if hasattr(e, "describe"):
            lines.append(f"  - {e.describe(unit)}.")
            continue
        part = e.participation
        if isinstance(part, PoissonSampling):
            how = f"Poisson sampling at rate {part.rate:.4g}"
        else:
            assert isinstance(part, FixedParticipation)
            how = f"each {unit} in at most one of every {part.period} steps (no amplification assumed)"
        lines.append(f"  - {e.steps} Gaussian releases, noise multiplier {e.noise_multiplier:.4g}, {how}.")
    if dataset_size:
        lines.append(f"  Training set size: {dataset_size}; delta should stay well below 1/n = {1 / dataset_size:.3g}.")
    lines.append(
        f"Meaning: for any {unit} and any set of outcomes S, P[run on D in S] <= e^{eps:.3g} P[run on D' in S] + {delta:.3g}"
        f" for neighbouring D, D'. The guarantee covers the released model and every intermediate iterate;"
        f" it assumes the clip bound held for every {unit}, which the engine enforces, and that checkpoints"
        f" (which hold the secret noise seed) are not published.")
    if secure is True:
        lines.append("Noise and batches were drawn from OS entropy: nothing stored can reproduce them.")
    elif secure is False:
        lines.append("Noise and batches were derived from the run's seed, so the guarantee also needs that seed "
                     "kept secret: checkpoints and metrics.json record it (metrics.json's training losses are not "
                     "private either). Train with --secure for a model you publish.")
    return "\n".join(lines)
