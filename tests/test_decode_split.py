"""The decode kernel's split-KV choice: whole waves of resident CTAs, never an empty split."""
import pytest

from torch_cubridge.ops.runner import decode_split


@pytest.mark.parametrize("ctas,n_blk,slots", [(64, 512, 396), (64, 64, 396), (8, 512, 396), (512, 64, 396),
                                              (256, 2, 396), (1, 313, 264), (64, 1, 396), (3, 5000, 1056)])
def test_split_covers_every_block_and_fills_waves(ctas, n_blk, slots):
    n, per = decode_split(ctas, n_blk, slots)
    assert 1 <= n <= n_blk and per >= 1
    assert (n - 1) * per < n_blk <= n * per  # every block in exactly one split, the last one not empty
    if ctas < slots and n_blk >= 4:  # a small grid is split until it fills the GPU
        assert ctas * n >= 0.9 * slots or n_blk / n <= 3  # or splits are down to a few blocks
    waves = ctas * n / slots
    if waves >= 1 and n > 1:
        assert waves / -(-ctas * n // slots) >= 0.85  # no mostly-empty last wave
