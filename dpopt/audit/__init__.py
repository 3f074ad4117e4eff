"""Empirical privacy auditing (``dpopt audit``): canary-based lower bounds on a run's epsilon.

Importing this package registers the audit setups of every family (``canaries.py``, ``correlated.py``,
``federated.py``, ``scalar.py``).
"""

from dpopt.audit import canaries, correlated, federated, scalar  # noqa: F401  (register the audit setups)
from dpopt.audit.auditor import (AUDIT_SETUPS, AuditResult, AuditSetup, AuditSpec, Observation, audit,
                                 poisson_gaussian_llr, poisson_privatizer, record_releases, register_audit)
from dpopt.audit.bounds import (ThresholdTest, clopper_pearson_upper, epsilon_from_rates, epsilon_lower_bound,
                                threshold_audit)

__all__ = ["AUDIT_SETUPS", "AuditResult", "AuditSetup", "AuditSpec", "Observation", "ThresholdTest", "audit",
           "clopper_pearson_upper", "epsilon_from_rates", "epsilon_lower_bound", "poisson_gaussian_llr",
           "poisson_privatizer", "record_releases", "register_audit", "threshold_audit"]
