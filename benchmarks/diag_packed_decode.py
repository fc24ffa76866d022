"""Diagnosis: a packed decode step as continuous batching calls it (B 1, a few query rows, one per
sequence, an additive block-diagonal mask over every sequence's keys) through the decode kernel; prints
the GPU verification's report."""
import os
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch_cubridge as tc  # noqa: E402


def packed(query, key, value, attention_mask):
    key = key.repeat_interleave(query.shape[1] // key.shape[1], dim=1)
    value = value.repeat_interleave(query.shape[1] // value.shape[1], dim=1)
    w = torch.matmul(query, key.transpose(2, 3)) * query.shape[-1] ** -0.5 + attention_mask
    w = torch.softmax(w, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(w, value).transpose(1, 2).contiguous()


def main() -> None:
    warnings.simplefilter("ignore")
    lens = [int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "50,130,20,74").split(",")]
    dev, dt = "cuda", torch.bfloat16
    n, S = len(lens), sum(lens)
    q = torch.randn(1, 4, n, 64, device=dev, dtype=dt)
    k, v = (torch.randn(1, 2, S, 64, device=dev, dtype=dt) for _ in range(2))
    mask = torch.full((1, 1, n, S), torch.finfo(dt).min, device=dev, dtype=dt)
    s0 = 0
    for i, L in enumerate(lens):
        mask[..., i, s0:s0 + L] = 0
        s0 += L
    f = tc.compile(packed, fallback="warn")
    out = f(q, k, v, mask)
    for e in f.entries():
        print(e.reason)
        for r in e.reasons.values():
            print(r)
    ref = packed(q.double(), k.double(), v.double(), mask.double())
    print("served", dict(f.served), "rel", float((out.double() - ref).norm() / ref.norm()))
    out_dir = os.environ.get("OUT")
    if out_dir:
        Path(out_dir, "diag_packed_decode.txt").write_text("\n".join(e.reason + "\n" + "\n".join(e.reasons.values()) for e in f.entries()))


if __name__ == "__main__":
    main()
