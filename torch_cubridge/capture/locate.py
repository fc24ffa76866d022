"""Point a refusal at the user's own code: `torch.cos at spec.py:12: s = torch.cos(s)`.

Only the failure path pays for this. The spec is run once more on fake tensors
under a dispatch mode that notes the innermost frame outside torch and
torch_cubridge when the refused aten op first runs. Python control flow on
tensor values is located from the exception's own traceback.
"""
from __future__ import annotations

import os
import sysconfig
import traceback
from typing import Any, Callable

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

_SKIP = tuple(os.path.dirname(m.__file__) + os.sep for m in (torch,)) + (
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,
    sysconfig.get_paths()["stdlib"] + os.sep,
)


def user_frame(frames: list[traceback.FrameSummary]) -> str | None:
    """`file.py:12 in fn `source line`` of the innermost frame in the user's code, if any."""
    for f in reversed(frames):
        path = os.path.abspath(f.filename)
        if f.filename.startswith("<") or path.startswith(_SKIP):
            continue
        line = (f.line or "").strip()
        where = f"{os.path.basename(f.filename)}:{f.lineno} in {f.name}"
        return f"{where} `{line}`" if line else where
    return None


def frame_of_exception(e: BaseException) -> str | None:
    return user_frame(traceback.extract_tb(e.__traceback__))


def torch_name(aten_op: str) -> str:
    """aten.cos.default -> torch.cos (the spelling the user most likely wrote)."""
    parts = aten_op.split(".")
    return "torch." + (parts[1] if parts[0] == "aten" and len(parts) > 1 else parts[0]).lstrip("_")


class _FirstCall(TorchDispatchMode):
    def __init__(self, op: str, nth: int) -> None:
        super().__init__()
        self.op, self.left = op, nth
        self.where: str | None = None

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if self.where is None and self.op in (str(func), f"aten.{func.overloadpacket.__name__}"):
            if self.left == 0:
                self.where = user_frame(traceback.extract_stack())
            self.left -= 1
        return func(*args, **(kwargs or {}))


def occurrence(gm: torch.fx.GraphModule, node_name: str) -> int:
    """How many calls of the same op come before node `node_name` in the graph (execution order)."""
    nodes = list(gm.graph.nodes)
    target = next((n.target for n in nodes if n.name == node_name), None)
    count = 0
    for n in nodes:
        if n.name == node_name:
            return count
        count += n.target == target
    return 0


def locate_op(run: Callable[[], Any], op: str, nth: int = 0) -> str | None:
    """Where `run` (the spec on its bound arguments) makes its nth call of aten `op`; None if not found."""
    finder = _FirstCall(op, nth)
    try:
        with FakeTensorMode(allow_non_fake_inputs=True), finder:
            run()
    except Exception:  # the refusal already stands; locating it is best effort
        pass
    return finder.where
