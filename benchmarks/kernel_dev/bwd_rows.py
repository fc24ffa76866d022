"""Float64 references and a per-row diagnosis for benchmarks/kernel_dev/bwd_check.py (runs on CPU too).

Two references for dQ, dK and dV:
- end to end: float64 autograd of the spec at the bf16 inputs, what a user's gradient is held to;
- kernel inputs: the float64 backward of the O the kernel is handed. Every FlashAttention-style backward,
  ours included, takes delta = rowsum(dO * O) from the stored O, which is bf16. With O rounded, delta is off
  by dO . (O - O_exact), which shifts dS by P times that and dQ by it times the row's P-weighted mean key. A
  row that keeps few keys, one of them dominant (causal rows 1..4, a document's first rows), has a dQ far
  smaller than that shift, so its end-to-end row error reaches 0.3..2 in any such kernel: a CPU emulation of
  the kernel's roundings (fp32 products, P and dS in bf16) gives 0.03..2 on the causal and document specs
  with delta from the bf16 O, and 4e-3..6e-3 with delta from the exact O. dK and dV sum over many rows' dS
  and barely move. The kernel-inputs reference uses the kernel's own delta, so it holds the kernel to its
  own roundings (~5e-3), where a race or an indexing slip stands out.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from torch_cubridge.ir.interpreter import run_program


def lse_program(p):
    """The program also returning its rows' natural-log LSE in float64."""
    return replace(p, out=replace(p.out, tuple_len=2, index=0, lse_index=1, lse_dims=("b", "h", "s"),
                                  lse_dtype="float64"))


def kernel_reference(p, q, k, v, extras, o_given, do) -> tuple[torch.Tensor, ...]:
    """dQ, dK, dV in float64 with delta taken from o_given, as the kernel does.

    The softmax's logit gradient is P (dP - delta_exact); the kernel's is P (dP - delta_given). Their
    difference, c_q P with c = delta_exact - delta_given, is the gradient of sum_q c_q LSE_q, so autograd of
    <dO, O> + <c, LSE> through the float64 interpreter gives the kernel-input backward for any score and
    mask. Rows with no key (LSE -inf) take no correction."""
    q64, k64, v64 = (x.detach().double().cpu().requires_grad_() for x in (q, k, v))
    ex = [e.cpu() if isinstance(e, torch.Tensor) else e for e in extras]
    o, lse = run_program(lse_program(p), q64, k64, v64, *ex)
    do64 = do.double().cpu()
    c = (do64 * (o.detach() - o_given.double().cpu())).sum(-1)
    live = torch.isfinite(lse)
    loss = (o * do64).sum() + (c * torch.where(live, lse, torch.zeros_like(lse))).sum()
    return torch.autograd.grad(loss, (q64, k64, v64))


def row_errors(got: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Per row (last dim): max abs error / the row's max abs (at least 1e-3 of the tensor's max abs)."""
    g, r = got.double().cpu(), ref.double().cpu()
    floor = max(r.abs().max().item(), 1e-30) * 1e-3
    return (g - r).abs().amax(-1) / r.abs().amax(-1).clamp_min(floor)


def live_keys(fn, q, k, extras) -> torch.Tensor | None:
    """Keys each query row keeps, counted from the spec's P (the spec run with V the identity); None where the
    spec does not take that V."""
    try:
        skv = k.shape[-2]
        eye = torch.eye(skv, dtype=torch.float64).expand(*k.shape[:-1], skv)
        ex = [e.cpu() if isinstance(e, torch.Tensor) else e for e in extras]
        pr = fn(q.detach().double().cpu(), k.detach().double().cpu(), eye, *ex)
        return (pr.abs() > 0).sum(-1)
    except Exception:  # a spec that reads V's shape: the diagnosis goes without the counts
        return None


def diagnose(label: str, err: torch.Tensor, ref: torch.Tensor, block: int, tol: float,
             live: torch.Tensor | None = None, worst: int = 6) -> list[str]:
    """Lines naming the worst rows of one gradient ([B, H, S] errors): where each sits in its block of `block`
    rows (offset, first or last row, the tail block), its live keys, and where the bad rows gather."""
    B, H, S = err.shape
    flat = err.flatten()
    n_blocks = -(-S // block)
    tail = S % block
    scale = ref.double().abs().amax().item()
    lines = []
    for i in flat.argsort(descending=True)[:worst].tolist():
        b, h, s = i // (H * S), (i // S) % H, i % S
        off, blk = s % block, s // block
        where = ["first row" if off == 0 else "", "last row" if off == block - 1 else "",
                 "tail block" if tail and blk == n_blocks - 1 else ""]
        keys = f", keeps {int(live[b, h, s])} keys" if live is not None else ""
        size = ref[b, h, s].double().abs().max().item() / max(scale, 1e-30)
        lines.append(f"    {label} row (b {b}, h {h}, {s}): err {err[b, h, s]:.2e}, block {blk} offset {off}"
                     f"{' (' + ', '.join(w for w in where if w) + ')' if any(where) else ''}{keys}, "
                     f"row max {size:.1e} of the tensor's")
    bad = (err > tol).nonzero()
    if len(bad):
        offs = bad[:, 2] % block
        edge = ((offs == 0) | (offs == block - 1)).float().mean().item()
        in_tail = (bad[:, 2] // block == n_blocks - 1).float().mean().item() if tail else 0.0
        heads = sorted({(int(b), int(h)) for b, h, _ in bad.tolist()})
        lines.append(f"    {label}: {len(bad)} rows over {tol} of {B * H * S}; {edge:.0%} at a block's first or "
                     f"last row (by chance {min(2, block) / block:.0%}), {in_tail:.0%} in the tail block; "
                     f"(b, h) {heads[:8]}{' ...' if len(heads) > 8 else ''}; rows {sorted(set(bad[:, 2].tolist()))[:16]}")
        if live is not None:
            few = live[bad[:, 0], bad[:, 1], bad[:, 2]].float()
            lines.append(f"    {label}: bad rows keep {int(few.min())}..{int(few.max())} keys "
                         f"(median {int(few.median())}; all rows median {int(live.float().median())})")
    return lines
