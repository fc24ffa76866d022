"""Ops refused with a reason of their own, rather than "no symbolic rule": their results are not a
function of the positions and inputs that a kernel could compute per score element.
"""
from __future__ import annotations

from typing import NoReturn

from ....errors import UnsupportedSpec
from .registry import Call, rule


@rule("native_dropout", "bernoulli", "rand", "randn", "rand_like", "randn_like", "randint")
def random(c: Call) -> NoReturn:
    raise UnsupportedSpec("random numbers (dropout in training?) cannot be compiled", op=c.op)


@rule("topk", "sort", "argsort", "kthvalue", "nonzero", "masked_select", "unique")
def select_by_value(c: Call) -> NoReturn:
    raise UnsupportedSpec("selection by value (top-k, sort, nonzero) is not an attention score", op=c.op)
