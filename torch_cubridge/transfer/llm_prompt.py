"""The prompt of the LLM transfer backend: what CuIR is, worked examples, the spec.

The worked examples are produced by the symbolic backend from tiny specs at
first use, so they always show the CuIR this checkout accepts. The model
writes JSON only; nothing from its reply is ever executed.
"""
from __future__ import annotations

import inspect
import math
from functools import lru_cache
from typing import Any, Callable

import torch

from ..capture.trace import Captured, bind_example, capture
from ..errors import UnsupportedSpec
from ..ir.expr import BINARY, SIZE_VARS, UNARY

SYSTEM = f"""You translate attention functions written in PyTorch into CuIR, a small JSON IR that
a fused flash-attention CUDA kernel is generated from. You write CuIR JSON, never code.

The kernel computes, for every batch b, query head h, query row q and key row kv:
  s = dot(Q[b, h, q, :], K[b, kv_head(h), kv, :])        (the raw, unscaled dot product)
  logit = score(s, b, h, q, kv)     where mask(b, h, q, kv) is true; masked keys get no weight
  out[b, h, q, :] = softmax over kv of logit (plus the optional sink logit) applied to V

A program is one JSON object with these fields:
  signature   the spec's parameter names, in order (given below; copy it)
  q, k, v     {{"arg": argument path, "dims": the tensor's dim order in canonical names
              "b" batch, "h" heads, "s" sequence, "d" head dim}}; a rank-3 tensor has no "b"
  head_map    "group": kv_head = h // (H // Hkv) (expand / repeat_interleave / no GQA);
              "tile": kv_head = h % Hkv (repeat / tile of whole head blocks)
  score       Expr giving the logit; reads s, index and size variables, scalars, loads
  mask        Expr predicate, true keeps (q, kv); null when nothing is masked. It may not read s
  block_rule  "none" when mask is null; "interval" when the mask loads no tensor;
              "prepass" when it loads a tensor
  sink        null, or Expr for a per-(b, h) logit that joins the softmax normaliser only
              (a column concatenated to the scores and dropped after softmax); reads b, h, sizes, loads
  empty_rows  rows whose keys are all masked: "zero" (masked with -inf; the spec gives NaN there)
              or "mean_v" (masked with a large finite negative such as finfo.min: the row averages V)
  extras      tensors read by "load": {{"name", "dtype" (e.g. "float32", "int64"), "rank",
              "arg": argument path or null, "value": null}}. For a captured constant
              (get_attr / _tensor_constantN in the graph) use its get_attr name as "arg"
  scalars     {{"name", "kind": "float" | "int", and at most one source: "value" (a literal of the
              spec), "arg" (read from a call argument), "expr" (an Expr over size variables)}}
  out         {{"dims": the result's dim order, merged heads written "h*d"; "dtype": "q" (follows q)
              or a dtype name; "tuple_len": 0 for a tensor result, else the tuple's length;
              "index": the position of the attention output in that tuple}}
  requires    []            notes   [] (or short strings)

Scalars stay runtime parameters: every number of the spec other than 0, 1, -1 and infinities is
a scalar ($p0, $p1, ... in the text form), referenced as {{"scalar": name}}, never inlined.
Numbers that follow the sequence length (e.g. Skv - Sq) are written with size variables.

Expr JSON:
  {{"const": 2.0}} ("inf" / "-inf" as strings)   {{"var": name}}   {{"scalar": name}}
  {{"op": name, "args": [Expr, ...]}}   {{"op": "load", "attr": tensor name, "args": [one index per dim]}}
  variables: s (score only); index b, h, q, kv; sizes {", ".join(SIZE_VARS)}
  unary ops: {", ".join(sorted(UNARY))}
  binary ops: {", ".join(sorted(BINARY))}
  "where" takes (condition, then, else). Comparisons give booleans; and / or / not combine them.

Reply with a single JSON object (the program) and nothing else."""


# ---- tiny specs the worked examples are generated from -------------------------
def causal_softcap(q, k, v):
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    s = 30.0 * torch.tanh(s / 30.0)
    S = q.shape[-2]
    s = s.masked_fill(torch.ones(S, S, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return s.softmax(-1) @ v


def gqa_window_bshd(q, k, v, window: int = 3):
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))   # [B, S, H, D] in and out
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    i = torch.arange(q.shape[2], device=q.device)
    keep = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < window)
    s = torch.where(keep, s, torch.finfo(s.dtype).min)
    return (s.softmax(-1) @ v).transpose(1, 2).reshape(q.shape[0], q.shape[2], -1)


def documents_with_sinks(q, k, v, doc, sinks):
    same = doc[:, None, :, None] == doc[:, None, None, :]
    s = (q @ k.transpose(-1, -2) * 0.5).masked_fill(~same, float("-inf"))
    col = sinks.view(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[2], 1)
    return torch.cat([s, col], dim=-1).softmax(-1)[..., :-1] @ v


def _qkv(h: int, hkv: int, b: int = 1, s: int = 8, d: int = 4, bshd: bool = False) -> tuple:
    g = torch.Generator().manual_seed(0)  # a private generator: building the prompt leaves the global RNG alone
    shape = (lambda n: (b, s, n, d)) if bshd else (lambda n: (b, n, s, d))
    return tuple(torch.randn(*shape(n), generator=g) for n in (h, hkv, hkv))


EXAMPLES: tuple[tuple[Callable, Callable[[], tuple]], ...] = (
    (causal_softcap, lambda: _qkv(2, 2)),
    (gqa_window_bshd, lambda: _qkv(4, 2, bshd=True)),
    (documents_with_sinks, lambda: _qkv(2, 2, b=2) + (torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2], [0, 0, 1, 1, 1, 1, 1, 1]]),
                                               torch.ones(2))),
)


@lru_cache(maxsize=1)
def worked_examples() -> tuple[str, ...]:
    """Each example: the spec's source, its captured graph and the symbolic backend's program."""
    from . import symbolic_transfer
    out = []
    for fn, make in EXAMPLES:
        try:
            cap = capture(fn, bind_example(fn, make(), {}))
            prog = symbolic_transfer(cap)
        except UnsupportedSpec:
            continue  # an example the symbolic backend stops accepting is left out, not fatal
        out.append("\n".join([
            f"### Example: {fn.__name__}", "Spec:", inspect.getsource(fn).strip(),
            "Arguments:", describe_arguments(cap), "Captured graph:", graph_code(cap),
            "Program (text form):", str(prog), "Program (JSON):", prog.to_json()]))
    return tuple(out)


# ---- the spec at hand -------------------------------------------------------------
def graph_code(cap: Captured) -> str:
    return cap.graph.code.strip()


def _describe(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        return f"tensor shape {list(v.shape)} dtype {str(v.dtype).replace('torch.', '')}"
    if isinstance(v, torch.nn.Module):
        return f"module {type(v).__name__}"
    return f"{type(v).__name__} = {v!r}"


def describe_arguments(cap: Captured) -> str:
    lines = [f"signature: {list(cap.signature)}"]
    placeholder = {p: f"arg{i}_1" for i, p in enumerate(cap.tensor_paths)}
    for path, val in cap.example.items():
        where = f"  (graph input {placeholder[path]})" if path in placeholder else ""
        lines.append(f"  {path}: {_describe(val)}{where}")
    for name, t in sorted(cap.constants.items()):
        owner = cap.constant_paths.get(name)
        src = f"module attribute {owner}" if owner else "captured constant"
        vals = f" values {t.tolist()}" if isinstance(t, torch.Tensor) and t.numel() <= 64 else ""
        lines.append(f"  {name} (get_attr): {_describe(t)}, {src}{vals}")
    return "\n".join(lines)


def build_messages(cap: Captured, reference: str, reason: str) -> list[dict[str, str]]:
    user = "\n\n".join([
        "The expert kernel every program runs in (its reference program; a program fills the hooks "
        "score, mask, sink and block_class):\n" + reference,
        "Worked examples (written by the symbolic analysis):",
        *worked_examples(),
        "### Your task",
        "The symbolic analysis refused this spec: " + (reason or "(no reason given)"),
        "Arguments:\n" + describe_arguments(cap),
        "Captured graph (aten level):\n" + graph_code(cap),
        "Write the CuIR program for this spec as a single JSON object. It is checked by running it "
        "against the spec on fresh inputs at several shapes; a wrong program is rejected.",
    ])
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]


def retry_message(error: str) -> dict[str, str]:
    return {"role": "user", "content": f"That reply was rejected: {error}\n"
                                       "Reply with the corrected program as a single JSON object only."}
