"""The user's call site, for warnings: every stage warns at the line that called into the library."""
from __future__ import annotations

import os
import sys


def user_stacklevel() -> int:
    """warnings.warn's stacklevel for its caller that names the first frame outside torch_cubridge, torch
    and transformers: the user's call, wherever inside them (a module's __call__, a model's forward calling
    its attention function) the warning arose."""
    libs = [sys.modules[n] for n in (__package__, "torch", "transformers") if n in sys.modules]
    dirs = tuple(os.path.dirname(m.__file__) + os.sep for m in libs if getattr(m, "__file__", None))
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(dirs):
        frame, level = frame.f_back, level + 1
    return level
