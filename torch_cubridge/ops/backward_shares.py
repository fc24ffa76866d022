"""How one backward call is split into launches (bwd_config.cuh BwdArgs' b0, hk0, slot_heads).

The backward's scratch, dQ's float32 accumulator above all, is twice dQ's own size for the whole call;
FlexAttention's backward holds none. A call is therefore run as a sequence of shares, each a rectangle of
(batch, KV head) pairs with scratch of its own: whole batches where one batch's scratch fits the budget,
else runs of KV heads within one batch. A share keeps at least `min_ctas` CTAs where the call has them, so the
machine stays full and the tail of a launch is short against its body.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Share:
    """Batches [b0, b0 + nb) by KV heads [hk0, hk0 + nhk): one launch of each backward kernel."""
    b0: int
    nb: int
    hk0: int
    nhk: int


def share_words(share: Share, group: int) -> tuple[int, int, int, int, int]:
    """BwdArgs' b0, hk0, h0, slot_heads and slot_base for a share of KV heads with `group` query heads each:
    bwd_config.cuh's bwd_slot puts (b, h) at b * slot_heads + h - slot_base, the share's pairs at 0, 1, ..."""
    heads = share.nhk * group
    return share.b0, share.hk0, share.hk0 * group, heads, share.b0 * heads + share.hk0 * group


def plan_shares(batches: int, kv_heads: int, pair_bytes: int, budget_bytes: int, ctas_per_pair: int,
                min_ctas: int) -> list[Share]:
    """The shares of a call: pair_bytes is one (batch, KV head) pair's scratch (its query heads'), budget_bytes
    the most one share may hold (min_ctas permitting), ctas_per_pair the main kernel's CTAs per pair (its key
    blocks)."""
    total = batches * kv_heads
    fit = max(1, budget_bytes // max(1, pair_bytes))
    busy = -(-min_ctas // max(1, ctas_per_pair))
    per = min(total, max(fit, busy))  # pairs per share
    if per >= kv_heads:  # whole batches
        nb = per // kv_heads
        return [Share(b, min(nb, batches - b), 0, kv_heads) for b in range(0, batches, nb)]
    runs = -(-kv_heads // per)  # runs of KV heads as even as they divide
    nhk = -(-kv_heads // runs)
    return [Share(b, 1, h, min(nhk, kv_heads - h)) for b in range(batches) for h in range(0, kv_heads, nhk)]
