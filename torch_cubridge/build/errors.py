"""Errors raised while turning CUDA source into a cubin."""

from __future__ import annotations


class BuildError(RuntimeError):
    """Compilation failed or no compiler could run; `log` holds the compiler output."""

    def __init__(self, message: str, log: str = "", *, compiler: str = "") -> None:
        self.log = log
        self.compiler = compiler
        text = f"{compiler}: {message}" if compiler else message
        if log.strip():
            text += "\n--- compiler log ---\n" + log.rstrip()
        super().__init__(text)


class CompilerUnavailable(BuildError):
    """The requested backend (library, headers or binary) is not installed."""
