"""The LLM transfer backend: an OpenAI-compatible model writes the CuIR program.

Used for specs the symbolic analysis refuses. The model answers with CuIR
JSON only; the reply is parsed and validated here, never executed, and the
caller (api.transfer_bound) still verifies the program against the spec by
execution, so a wrong answer is rejected there rather than compiled.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import replace
from typing import Any

import torch

from ..capture.trace import Captured
from ..errors import UnsupportedSpec
from ..ir.bind import lookup
from ..ir.program import Program
from ..ir.validate import InvalidProgram
from .llm_prompt import build_messages, retry_message
from .scalars import lift_literals

_FENCE = re.compile(r"```(?:json)?\s*(.*?)```", re.DOTALL)
# what a malformed reply can raise on its way through json / Program.from_json / validate
_BAD_REPLY = (ValueError, KeyError, TypeError, AttributeError, IndexError, RecursionError)


def llm_transfer(cap: Captured, reason: str = "", *, model: str | None = None, base_url: str | None = None,
                 api_key: str | None = None, client: Any = None, attempts: int = 2) -> Program:
    """Ask the configured model for the program of `cap`; retry with the error fed back."""
    model = model or os.environ.get("CUBRIDGE_LLM_MODEL")
    base_url = base_url or os.environ.get("CUBRIDGE_LLM_BASE_URL")
    api_key = api_key or os.environ.get("CUBRIDGE_LLM_API_KEY") or os.environ.get("OPENAI_API_KEY")
    if not model or (client is None and not (base_url or api_key)):
        raise UnsupportedSpec(f"{reason}; no LLM backend configured (set CUBRIDGE_LLM_MODEL and "
                              "CUBRIDGE_LLM_BASE_URL or CUBRIDGE_LLM_API_KEY, or pass llm options)", op="transfer")
    if client is None:
        client = _make_client(base_url, api_key, reason)

    from ..lift.reference import lift_reference
    messages = build_messages(cap, str(lift_reference()), reason)
    error = "no attempt made"
    for _ in range(max(1, attempts)):
        reply = _ask(client, model, messages, reason)
        try:
            prog = parse_program(reply, cap)
        except _BAD_REPLY as e:
            error = f"{type(e).__name__}: {e}"
            messages = messages + [{"role": "assistant", "content": reply or ""}, retry_message(error)]
            continue
        return replace(prog, notes=prog.notes + (f"written by the LLM backend ({model})",))
    raise UnsupportedSpec(f"{reason}; the LLM backend gave no valid program in {max(1, attempts)} "
                          f"attempt(s), last error: {error}", op="llm")


def _make_client(base_url: str | None, api_key: str | None, reason: str) -> Any:
    try:
        import openai
    except ImportError:
        raise UnsupportedSpec(f"{reason}; the LLM backend needs the openai package (pip install openai)",
                              op="llm") from None
    # local OpenAI-compatible servers take any key, but the client refuses to start without one
    return openai.OpenAI(base_url=base_url, api_key=api_key or "unused")


def _ask(client: Any, model: str, messages: list[dict[str, str]], reason: str) -> str:
    try:
        resp = client.chat.completions.create(model=model, messages=list(messages))
        return resp.choices[0].message.content or ""
    except Exception as e:  # an unreachable endpoint leaves the spec unsupported, not the caller crashed
        raise UnsupportedSpec(f"{reason}; LLM backend request failed: {type(e).__name__}: {e}", op="llm") from None


def extract_json(reply: str) -> str:
    """The JSON object in a reply: inside ```json fences if present, else from the first { to the last }."""
    m = _FENCE.search(reply)
    text = m.group(1) if m else reply
    start, end = text.find("{"), text.rfind("}")
    if start < 0 or end < start:
        raise ValueError("the reply holds no JSON object")
    return text[start:end + 1]


def parse_program(reply: str, cap: Captured) -> Program:
    """Reply text -> a valid program bound to the captured spec (raises on anything malformed)."""
    obj = json.loads(extract_json(reply))
    if not isinstance(obj, dict):
        raise ValueError("the reply's JSON is not an object")
    obj["signature"] = list(cap.signature)  # known exactly; not worth a retry
    prog = Program.from_json(json.dumps(obj))
    prog = _resolve_constants(_lift_literals(prog), cap)
    prog.validate()
    _check_bindings(prog, cap)
    return prog


def _lift_literals(p: Program) -> Program:
    """Numbers the model inlined become runtime scalars, as the symbolic backend makes them."""
    used = [int(m.group(1)) for n in [s.name for s in p.scalars] + [x.name for x in p.extras]
            if (m := re.fullmatch(r"p(\d+)", n))]
    start = max(used, default=-1) + 1  # new names p<start>, ... collide with none the model chose
    (score, mask, sink), found = lift_literals([p.score, p.mask, p.sink], start=start)
    return replace(p, score=score, mask=mask, sink=sink, scalars=p.scalars + tuple(found)) if found else p


def _resolve_constants(p: Program, cap: Captured) -> Program:
    """An extra naming a captured constant (its get_attr name) gets the constant's source."""
    extras = []
    for x in p.extras:
        key = x.arg if x.arg in cap.constants else (x.name if x.arg is None and x.value is None else None)
        if key in cap.constants and key not in cap.example:
            owner = cap.constant_paths.get(key)
            x = replace(x, arg=owner, value=None if owner else cap.constants[key].tolist())
        extras.append(x)
    return replace(p, extras=tuple(extras))


def _check_bindings(p: Program, cap: Captured) -> None:
    """Every argument path the program reads exists in the call, with the rank the program assumes."""
    def get(path: str, what: str) -> Any:
        try:
            return lookup(cap.example, path)
        except (TypeError, AttributeError):
            raise InvalidProgram(f"{what} reads {path!r}, which is not an argument path "
                                 f"(paths: {sorted(cap.example)})") from None

    for name in ("q", "k", "v"):
        op = getattr(p, name)
        t = get(op.arg, name)
        if _rank(t) != len(op.dims):
            raise InvalidProgram(f"{name}: {op.arg} has shape {list(getattr(t, 'shape', []))}, "
                                 f"layout {list(op.dims)} has rank {len(op.dims)}")
    for x in p.extras:
        if x.arg is not None:
            if _rank(get(x.arg, f"tensor {x.name}")) != x.rank:
                raise InvalidProgram(f"tensor {x.name}: {x.arg} is not a rank-{x.rank} tensor")
    for s in p.scalars:
        if s.arg is not None:
            get(s.arg, f"scalar {s.name}")


def _rank(t: Any) -> int:
    return t.dim() if isinstance(t, torch.Tensor) else -1
