"""The decode kernel's split-KV choice: about two CTAs per multiprocessor, never an empty split."""
import pytest

from torch_cubridge.ops.runner import decode_split


@pytest.mark.parametrize("ctas,n_blk,sms", [(64, 512, 132), (64, 64, 132), (8, 512, 132), (512, 64, 132),
                                            (256, 2, 132), (1, 313, 132), (64, 1, 132), (3, 5000, 78)])
def test_split_covers_every_block_and_fills_the_gpu(ctas, n_blk, sms):
    n, per = decode_split(ctas, n_blk, sms)
    assert 1 <= n <= n_blk and per >= 1
    assert (n - 1) * per < n_blk <= n * per  # every block in exactly one split, the last one not empty
    assert ctas * n >= 0.9 * 2 * sms or per <= 2  # a small grid splits until it fills the GPU (or blocks run out)
    if ctas >= 2 * sms:
        assert n == 1  # already two CTAs per multiprocessor: no partials to merge
