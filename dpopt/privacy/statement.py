"""A human-readable privacy statement for the end of a run (after TF Privacy's
``compute_dp_sgd_privacy_statement``): what was released, under which relation, and what epsilon means."""

from __future__ import annotations

import math

from dpopt.privacy.ledger import (CyclicPoissonSampling, FixedParticipation, PoissonSampling, PrivacyLedger, Relation,
                                  poisson_count)


RANDOMNESS = {
    "os-entropy-key": "Noise and batches came from a secret key drawn from OS entropy, held in memory and, where "
                      "the run has a folder, in its checkpoint alone (never in metrics.json or the exported model).",
    "secret-seed": "REPLAYABLE noise: --secret-seed was given, so anyone who knows the secret seed can regenerate "
                   "and remove the noise; this guarantee holds only while that seed stays secret.",
    "secure": "Noise and batches were drawn from OS entropy draw by draw: nothing stored can reproduce them.",
}


def privacy_statement(ledger: PrivacyLedger, delta: float, dataset_size: int | None = None,
                      unit: str = "example", randomness: str | None = None) -> str:
    """``randomness``: how the secret streams were keyed (a key of ``RANDOMNESS``), None if the caller does
    not say."""
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
             f"Guarantee: ({eps:.4g}, {delta:.3g})-differential privacy with respect to {relation}, by "
             f"{ledger.accountant.upper()} accounting (the run's --accountant)."]
    if eps_other is not None:
        lines.append(f"Cross-check: {other.upper()} accounting bounds epsilon by {eps_other:.4g}"
                     + (" (delta alone covers the privacy loss at this noise)" if eps_other == 0 else "")
                     + "; an independent upper bound, not the guarantee.")
    for e in ledger.entries:
        if hasattr(e, "describe"):
            lines.append(f"  - {e.describe(unit)}.")
            continue
        part = e.participation
        if isinstance(part, CyclicPoissonSampling) and part.period == 1:
            how = f"Poisson sampling at rate {part.rate:.4g} (cyclic, with one group: plain Poisson sampling)"
        elif isinstance(part, CyclicPoissonSampling):
            how = (f"Poisson sampling at rate {part.rate:.4g} within {part.period} groups taken in turn (each {unit} "
                   f"in at most one of every {part.period} steps: {poisson_count(part, e.steps)} sampled releases)")
        elif isinstance(part, PoissonSampling):
            how = f"Poisson sampling at rate {part.rate:.4g}"
        else:
            assert isinstance(part, FixedParticipation)
            how = f"each {unit} in at most one of every {part.period} steps (no amplification assumed)"
        lines.append(f"  - {e.steps} Gaussian releases, noise multiplier {e.noise_multiplier:.4g}, {how}.")
    if dataset_size:
        share = delta * dataset_size
        lines.append(f"  Training set size: {dataset_size}; delta is {share:.2g} times 1/n = {1 / dataset_size:.3g}"
                     + (", well below it." if share <= 0.1 else
                        f"; the usual rule is delta well below 1/n (e.g. --delta {0.1 / dataset_size:.0e})."))
    lines.append(
        f"Meaning: for any {unit} and any set of outcomes S, P[run on D in S] <= e^{eps:.3g} P[run on D' in S] + {delta:.3g}"
        f" for neighbouring D, D'. The guarantee covers the released model and every intermediate iterate;"
        f" it assumes the clip bound held for every {unit}, which the engine enforces, and that checkpoints"
        f" (which hold the secret key) are not published.")
    if randomness is not None:
        lines.append(RANDOMNESS[randomness])
    return "\n".join(lines)
