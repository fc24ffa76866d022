"""Lift: the reference program is parsed from the kernel's own annotations."""
import pytest

from torch_cubridge.lift.annotations import AnnotationError, parse_annotations
from torch_cubridge.lift.reference import KERNELS, REQUIRED_HOOKS, lift_reference


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


def _flatten(steps, full_tile):
    """The reference's step names, in order, for one query tile with one key block."""
    out = []
    for s in steps:
        d = dict(s.attrs)
        if s.step == "loop":
            out.append("loop kv")
            out += _flatten(s.body, full_tile)
            out.append("endloop kv")
        elif s.step == "hook":
            if d["name"] == "mask" and full_tile:
                continue  # full tiles skip the element mask
            out.append(f"hook {d['name']}")
        elif s.step == "skip":
            out.append(f"skip {d['when']}")
        elif s.step == "store" and d.get("when") == "requested":
            continue  # the log-sum-exp output is optional
        else:
            out.append(f"{s.step} {next(iter(d.values()))}")
    return out


def test_interpreter_follows_the_lifted_reference():
    """The interpreter executes the orchestration the kernel's annotations describe, step for step."""
    import torch
    import torch_cubridge as tc
    from torch_cubridge.ir.interpreter import tracing
    from zoo import causal_sdpa

    args = tuple(torch.randn(1, 1, 20, 16) for _ in range(3))  # one query tile, one key block
    prog = tc.transfer(causal_sdpa, *args)
    ref = lift_reference()
    with tracing() as steps:
        prog.run(*args)
    assert steps == _flatten(ref.steps, full_tile=False)  # the diagonal tile is partial: mask runs


def test_hopper_kernel_lifts_to_the_same_reference():
    """The sm_90a kernel's own annotations give the same orchestration and hook sites, so one
    program fills either kernel and the interpreter follows both step for step."""
    fa2 = lift_reference(kernel=KERNELS["sm80"])
    hopper = lift_reference(kernel=KERNELS["sm90"])
    assert hopper.hooks() == fa2.hooks()
    assert hopper.steps == fa2.steps


def test_decode_kernel_lifts_to_the_same_hooks_and_block_loop():
    """The split-KV decode kernel fills the same hook sites in the same per-block order; only its
    tile (packed rows) differs, and its splits merge by LSE after the loop."""
    fa2 = lift_reference(kernel=KERNELS["sm80"])
    dec = lift_reference(kernel=KERNELS["decode"])
    assert dec.hooks() == fa2.hooks()
    loop = [s for s in dec.steps if s.step == "loop"]
    assert loop == [s for s in fa2.steps if s.step == "loop"]
    assert [s.step for s in dec.steps] == [s.step for s in fa2.steps]
