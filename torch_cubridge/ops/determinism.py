"""How the op carries a call's wish for bitwise-equal gradients run to run (compile(deterministic=True), or
torch.use_deterministic_algorithms(True) as the forward runs: torch_cubridge/compile.py decides).

The op call that needs gradients names its kernel with SUFFIX (ops/op_calls.py): the op's schema is
unchanged, a traced graph differs between the two modes (so torch.compile's caches never hand one mode's
backward to the other), and the backward reads the mode back from the name it saved (ops/custom_op.py)."""
from __future__ import annotations

SUFFIX = "#deterministic"


def split(kernel_id: str) -> tuple[str, bool]:
    """The registered kernel id, and whether the op call asked for bitwise-equal gradients."""
    return (kernel_id[:-len(SUFFIX)], True) if kernel_id.endswith(SUFFIX) else (kernel_id, False)
