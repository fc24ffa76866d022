"""Whether a call's gradients must be bitwise-equal run to run: set by a function compiled with
`deterministic=True` while it runs (torch_cubridge/compile.py), read by the op's autograd when it saves the forward
(ops/custom_op.py) beside torch.are_deterministic_algorithms_enabled()."""
from __future__ import annotations

import contextvars

deterministic_calls: contextvars.ContextVar[bool] = contextvars.ContextVar("cubridge_deterministic", default=False)
