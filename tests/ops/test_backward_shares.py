"""How a backward call is split into launches (ops/backward_shares.py): every (batch, KV head) pair in exactly
one share, each share within the scratch budget unless that leaves it too few CTAs, whole batches before runs of
heads."""
from __future__ import annotations

import itertools

import pytest

from torch_cubridge.ops.backward_shares import Share, plan_shares, share_words


def _pairs(shares: list[Share]) -> list[tuple[int, int]]:
    return [(b, h) for s in shares for b in range(s.b0, s.b0 + s.nb) for h in range(s.hk0, s.hk0 + s.nhk)]


@pytest.mark.parametrize("B, Hkv, fit, busy", itertools.product((1, 3, 8), (1, 4, 7, 16), (1, 2, 5, 40),
                                                               (0, 1, 3, 100)))
def test_every_pair_is_in_one_share_and_shares_keep_the_budget(B, Hkv, fit, busy):
    shares = plan_shares(B, Hkv, pair_bytes=1000, budget_bytes=1000 * fit, ctas_per_pair=10, min_ctas=10 * busy)
    assert sorted(_pairs(shares)) == [(b, h) for b in range(B) for h in range(Hkv)]
    biggest = max(s.nb * s.nhk for s in shares)
    assert biggest <= max(fit, busy, 1) or biggest == B * Hkv
    assert all(s.nb == 1 or s.nhk == Hkv for s in shares)  # whole batches, or heads of one batch


def test_the_bench_shape_splits_into_batches_and_a_small_call_stays_whole():
    pair = 4 * 4096 * 130  # a query head's accumulator and rows at S 4096, D 128 (Hopper)
    shares = plan_shares(8, 16, pair, 16 * pair, ctas_per_pair=32, min_ctas=264)
    assert shares == [Share(b, 1, 0, 16) for b in range(8)]
    assert plan_shares(2, 4, 4 * 320 * 66, 33_000, ctas_per_pair=3, min_ctas=264) == [Share(0, 2, 0, 4)]
    assert plan_shares(1, 16, pair, pair * 4, ctas_per_pair=128, min_ctas=264) == [
        Share(0, 1, h, 4) for h in (0, 4, 8, 12)]


@pytest.mark.parametrize("B, Hkv, group, fit", [(3, 4, 1, 1), (3, 4, 1, 6), (2, 8, 4, 3), (5, 2, 8, 1), (1, 16, 1, 5)])
def test_a_shares_scratch_holds_its_pairs_once_in_order(B, Hkv, group, fit):
    """The words the host packs per share, read by bwd_slot's rule (b * slot_heads + h - slot_base, with the grid's
    b from b0 and query heads from h0): every (batch, query head) of the share lands in its own slot, the slots
    0 .. pairs - 1, batch-major, as the preprocess and postprocess walk them."""
    for sh in plan_shares(B, Hkv, 1000, 1000 * fit, ctas_per_pair=1, min_ctas=0):
        b0, hk0, h0, slot_heads, slot_base = share_words(sh, group)
        assert (b0, hk0) == (sh.b0, sh.hk0)
        slots = [b * slot_heads + h - slot_base for b in range(b0, b0 + sh.nb) for h in range(h0, h0 + sh.nhk * group)]
        assert slots == list(range(sh.nb * sh.nhk * group))
