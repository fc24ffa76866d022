"""The decode kernel's split-KV choice: about the tile's CTAs per multiprocessor, never an empty split."""
import pytest

from torch_cubridge.lower.tiles import decode_ctas_per_sm, decode_tile
from torch_cubridge.ops.runner import decode_split


@pytest.mark.parametrize("ctas,n_blk,sms", [(64, 512, 132), (64, 64, 132), (8, 512, 132), (512, 64, 132),
                                            (256, 2, 132), (1, 313, 132), (64, 1, 132), (3, 5000, 78)])
@pytest.mark.parametrize("PER_SM", [1, 2])
def test_split_covers_every_block_and_fills_the_gpu(ctas, n_blk, sms, PER_SM):
    n, per = decode_split(ctas, n_blk, sms, PER_SM)
    assert 1 <= n <= n_blk and per >= 1
    assert (n - 1) * per < n_blk <= n * per  # every block in exactly one split, the last one not empty
    assert ctas * n >= 0.9 * PER_SM * sms or per <= 3  # a small grid splits until it fills the GPU (or blocks run out)
    if ctas >= PER_SM * sms:
        assert n == 1  # already as many CTAs per multiprocessor as the rule wants: no partials to merge


def test_the_ring_depth_sets_the_ctas_per_multiprocessor():
    """Three K/V blocks in the ring and one CTA per SM where it fits without spills; two and two for large
    head dims and for pages (whose lookups want a second CTA to hide them)."""
    assert decode_tile(128).stages == 3 and decode_ctas_per_sm(decode_tile(128)) == 1
    assert decode_tile(256).stages == 2 and decode_ctas_per_sm(decode_tile(256)) == 2
    assert decode_tile(128, paged=True).stages == 2 and decode_ctas_per_sm(decode_tile(128, paged=True)) == 2
