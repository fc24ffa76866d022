"""Lift: the reference program is parsed from the kernel's own annotations."""
import pytest

from torch_cubridge.lift.annotations import AnnotationError, parse_annotations
from torch_cubridge.lift.reference import REQUIRED_HOOKS, lift_reference


def test_reference_from_kernel_source():
    ref = lift_reference()
    hooks = ref.hooks()
    assert set(REQUIRED_HOOKS) <= set(hooks)
    assert hooks["mask"] == "partial"  # full tiles skip the element mask
    loop = next(s for s in ref.steps if s.step == "loop")
    order = [s.step if s.step != "hook" else dict(s.attrs)["name"] for s in loop.body]
    # block classification decides skipping before any load; score before mask before softmax
    assert order.index("block_class") < order.index("skip") < order.index("load")
    assert order.index("score") < order.index("mask") < order.index("softmax")
    tail = [s.step if s.step != "hook" else dict(s.attrs)["name"] for s in ref.steps]
    assert tail.index("sink") < tail.index("epilogue") < tail.index("store")


def test_malformed_annotations_fail():
    with pytest.raises(AnnotationError, match="unknown step"):
        parse_annotations("// @cuir frobnicate x=1")
    with pytest.raises(AnnotationError, match="never closed"):
        lift_reference("// @cuir loop axis=kv\n// @cuir hook name=score")
    with pytest.raises(AnnotationError, match="no hook site"):
        lift_reference("// @cuir loop axis=kv\n// @cuir hook name=score\n// @cuir endloop axis=kv")
