"""The decision engine: every allowed option (strategy × precision × AC × offload ×
micro-batch) estimated exactly, the ones that fit ranked by the throughput model, the
documented rules of tables/rules.csv checked against the same arithmetic, and — when nothing
fits — the single changes that would make it fit.

``options`` searches and ranks, ``rules`` judges the documented rules, ``fixes`` lists the
changes, ``recommend`` puts them together. Every result is data (codes and numbers);
``memplan.report`` writes the sentences.
"""

from .fixes import Fix
from .options import (
    AXES,
    FRAMEWORKS,
    PRIORITIES,
    Basis,
    Option,
    Rejected,
    allowed_strategies,
    basis_for,
    candidate_jobs,
    framework_strategies,
    simplicity_ranks,
)
from .recommend import Reason, Recommendation, recommend_job
from .rules import Rule, RuleVerdict, rules, size_class

__all__ = [
    "AXES",
    "FRAMEWORKS",
    "PRIORITIES",
    "Basis",
    "Fix",
    "Option",
    "Reason",
    "Recommendation",
    "Rejected",
    "Rule",
    "RuleVerdict",
    "allowed_strategies",
    "basis_for",
    "candidate_jobs",
    "framework_strategies",
    "recommend_job",
    "rules",
    "simplicity_ranks",
    "size_class",
]
