"""The decision engine: every allowed option (strategy × precision × AC × offload ×
micro-batch) estimated exactly, the ones that fit ranked by the throughput model, the
documented rules of tables/rules.csv checked against the same arithmetic, and — when nothing
fits — the single changes that would make it fit.

``options`` searches and ranks, ``rules`` judges the documented rules, ``fixes`` lists the
changes, ``recommend`` puts them together, ``whatifs`` computes what the reports print beside
an answer (fragmentation under expandable segments, paged states, the fine-tune modes). Every
result is data (codes and numbers); ``memplan.report`` writes the sentences, and nothing here
imports it.
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
from .whatifs import EstimateWhatIfs, Fragmentation, ModeOutcome, PagedStates, estimate_whatifs, finetune_modes

__all__ = [
    "AXES",
    "FRAMEWORKS",
    "PRIORITIES",
    "Basis",
    "EstimateWhatIfs",
    "Fix",
    "Fragmentation",
    "ModeOutcome",
    "Option",
    "PagedStates",
    "Reason",
    "Recommendation",
    "Rejected",
    "Rule",
    "RuleVerdict",
    "allowed_strategies",
    "basis_for",
    "candidate_jobs",
    "estimate_whatifs",
    "finetune_modes",
    "framework_strategies",
    "recommend_job",
    "rules",
    "simplicity_ranks",
    "size_class",
]
