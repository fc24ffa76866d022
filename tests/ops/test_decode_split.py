"""The decode kernel's split-KV choice: about the tile's CTAs per multiprocessor, never an empty split."""
import pytest

from torch_cubridge.lower.tiles import decode_ctas_per_sm, decode_tile
from torch_cubridge.ops.rules import decode_split


@pytest.mark.parametrize("ctas,n_blk,sms", [(64, 512, 132), (64, 64, 132), (8, 512, 132), (512, 64, 132),
                                            (256, 2, 132), (1, 313, 132), (64, 1, 132), (3, 5000, 78)])
@pytest.mark.parametrize("PER_SM", [1, 2])
@pytest.mark.parametrize("MIN", [1, 4])
def test_split_covers_every_block_and_fills_the_gpu(ctas, n_blk, sms, PER_SM, MIN):
    n, per = decode_split(ctas, n_blk, sms, PER_SM, MIN)
    assert 1 <= n <= n_blk and per >= 1
    if MIN > 1 and per < MIN and PER_SM > 1:  # short splits take the one-CTA rule's
        assert (n, per) == decode_split(ctas, n_blk, sms, 1)
    assert (n - 1) * per < n_blk <= n * per  # every block in exactly one split, the last one not empty
    # a small grid splits until it fills the GPU (or blocks run out), at one CTA per SM where splits are short
    assert ctas * n >= 0.9 * PER_SM * sms or per <= 3 or ctas * n >= 0.9 * sms and per < 2 * MIN
    if ctas >= PER_SM * sms:
        assert n == 1  # already as many CTAs per multiprocessor as the rule wants: no partials to merge


def test_the_ring_depth_sets_the_ctas_per_multiprocessor():
    """Three K/V blocks in the ring and one CTA per SM where it fits without spills; two and two for large
    head dims and for pages (whose lookups want a second CTA to hide them)."""
    assert decode_tile(128).stages == 3 and decode_ctas_per_sm(decode_tile(128)) == 1
    assert decode_tile(256).stages == 2 and decode_ctas_per_sm(decode_tile(256)) == 2
    assert decode_tile(128, paged=True).stages == 2 and decode_ctas_per_sm(decode_tile(128, paged=True)) == 2


def test_short_paged_splits_take_one_cta_per_multiprocessor():
    """B 1, 4k keys, 32:8 heads: 8 tiles would split 32 ways, two blocks each; paged calls take 16 splits of
    four (one CTA per SM); 1k keys keep 16 splits of one (fewer would leave SMs idle); B 8 (16 blocks
    a split) and contiguous calls keep the rule."""
    from torch_cubridge.ops.rules import PAGED_SPLIT_MIN_BLOCKS as MIN
    assert decode_split(8, 64, 132, 2) == (32, 2) and decode_split(8, 64, 132, 2, MIN) == (16, 4)
    assert decode_split(8, 16, 132, 2, MIN) == decode_split(8, 16, 132, 2) == (16, 1)
    assert decode_split(64, 64, 132, 2, MIN) == decode_split(64, 64, 132, 2) == (4, 16)
    assert decode_split(8, 3, 132, 2, MIN) == (3, 1)
