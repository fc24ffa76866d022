"""The corpus (tests/corpus/*.py): attention specs transcribed by hand from public code, each in its
authors' style, beyond the zoo's. Each module lists CASES (softmax attentions, to be served) and may
list REFUSED (non-softmax attentions, to be refused cleanly)."""
from __future__ import annotations

import copy
import importlib
from pathlib import Path

import torch

from helpers import first, to64
from zoo import Case

_MODULES = [importlib.import_module(f"corpus.{p.stem}") for p in sorted((Path(__file__).resolve().parents[1] / "corpus").glob("*.py"))]
CASES: list[Case] = [c for m in _MODULES for c in m.CASES]
REFUSED: list[Case] = [c for m in _MODULES for c in getattr(m, "REFUSED", [])]

# Softmax attentions of the corpus that are not served yet, and why (the README's status table lists them).
NOT_YET: dict[str, str] = {}

# Served on the CPU at float32 but refused at bfloat16 (the spec serves those calls), and why.
SPEC_SERVES_IN_BF16: dict[str, str] = {}  # Gemma 2 was here until its padded rows were judged in bfloat16

# What a refusal of a non-softmax attention must name: the real cause, not an op met on the way.
REFUSAL_CAUSE: dict[str, str] = {
    "gym_refuse_sigmoid_attention": "neither q.k nor softmax",
    "gym_refuse_linear_attention": "neither q.k nor softmax",
    "gym_refuse_diff_attention": "applied to the probs",  # two softmaxes subtracted (was: nan_to_num had no rule)
}


def reference(case: Case, args: tuple) -> torch.Tensor:
    """The spec's output in float64; in the inputs' float32 where float64 cannot run it (finfo(float64).min
    put into a float32 tensor: Cohere) or leaves rows undefined that every real dtype defines
    (finfo(dtype).min overflowing to -inf under softmax(dtype=float32): BLOOM)."""
    try:
        ref = first(case.fn(*to64(args)))
        if not torch.isnan(ref).any():
            return ref
    except RuntimeError:
        pass
    # tensors and module arguments (a copy: their parameters, a bf16 module's too) in float32
    f32 = tuple(a.float() if isinstance(a, torch.Tensor) and a.is_floating_point()
                else copy.deepcopy(a).float() if isinstance(a, torch.nn.Module) else a for a in args)
    ref = first(case.fn(*f32))
    assert not torch.isnan(ref).any()
    return ref
