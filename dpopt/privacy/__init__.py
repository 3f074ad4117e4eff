"""Accounting and calibration: the ledger of releases, epsilon(delta), noise for a target epsilon."""

from dpopt.privacy.calibrate import advanced_composition_noise, check_budget, noise_multiplier_for
from dpopt.privacy.correlated import CorrelatedRelease, zcdp_noise_multiplier
from dpopt.privacy.ledger import (AccountingError, CyclicPoissonSampling, FixedOrderParticipation, FixedParticipation,
                                  GaussianRelease, Participation, PoissonSampling, PrivacyLedger, Relation, Release,
                                  epsilon_of, register_release)
from dpopt.privacy.statement import privacy_statement

__all__ = ["AccountingError", "advanced_composition_noise", "CorrelatedRelease", "CyclicPoissonSampling",
           "FixedOrderParticipation",
           "FixedParticipation", "GaussianRelease", "Participation", "PoissonSampling", "PrivacyLedger", "Relation",
           "Release", "check_budget", "register_release", "epsilon_of", "noise_multiplier_for", "privacy_statement",
           "zcdp_noise_multiplier"]
