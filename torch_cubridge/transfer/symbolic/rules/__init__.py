"""The symbolic walker's op rules, one family per module; importing this package fills RULES.

A new op is one `@rule("name")` function in the family it belongs to.
"""
from . import contractions, factories, gathers, layout, pointwise, reductions, refusals  # noqa: F401  (register)
from .registry import RULES, Call, Rule, aten_name, no_rule, rule

__all__ = ["RULES", "Call", "Rule", "aten_name", "no_rule", "rule"]
