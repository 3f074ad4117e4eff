"""Accounting and calibration: the ledger of releases, epsilon(delta), noise for a target epsilon."""

from dpopt.privacy.calibrate import check_budget, noise_multiplier_for
from dpopt.privacy.ledger import (AccountingError, FixedParticipation, GaussianRelease, Participation,
                                  PoissonSampling, PrivacyLedger, Relation, epsilon_of)
from dpopt.privacy.statement import privacy_statement

__all__ = ["AccountingError", "FixedParticipation", "GaussianRelease", "Participation", "PoissonSampling",
           "PrivacyLedger", "Relation", "check_budget", "epsilon_of", "noise_multiplier_for", "privacy_statement"]
