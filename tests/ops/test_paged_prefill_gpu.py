"""On a Hopper GPU: paged prefill specs (many queries against K/V in pages) are served by the Hopper
kernel reading K and V from their pages through the block table (no gather), in TMA boxes inside pages,
where those have 16 rows or more; smaller pieces are gathered. Every output against float64."""
import pytest
import torch

import paged_specs as ps
import torch_cubridge as tc
from helpers import graph_replay

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _hopper():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the paged prefill kernel is Hopper's (sm_90a)")


def _serve(fn, args, in_place=True):
    return ps.serve(fn, args, "sm90", in_place)


@pytest.mark.parametrize("D,P,sq", [(128, 256, 333), (128, 64, 129), (128, 32, 200), (64, 32, 64), (128, 16, 100),
                                    (64, 16, 200), (256, 160, 90), (256, 80, 100), (256, 48, 70), (96, 64, 70),
                                    (128, 24, 100), (128, 8, 64)])
def test_chunked_prefill_over_pages(D, P, sq):
    """Boxes of a whole 128-key block inside a page (256), of whole pages (64: one thread issues them; 32,
    16: the producer warp's lanes), 80-key blocks inside pages of 160 and 80 (D 256) and boxes of 16 rows of
    pages of 48 under them, D 96 with a zero-filled second column chunk; the keys end inside a block, so
    boxes past them read zeros. Pages of 24 and 8 rows (pieces of 8) are gathered."""
    _serve(ps.chunked_prefill, ps.pages(3, 8, 2, 1500, D, P, torch.bfloat16, sq=sq), in_place=P not in (8, 24))


def test_heads_first_pages_with_lengths_and_one_kv_head():
    _serve(ps.vllm_heads_first, ps.pages(2, 8, 1, 2000, 128, 128, torch.bfloat16, sq=300))


@pytest.mark.parametrize("P", [16, 256])
def test_slots_first_int32_table_negative_tail_and_a_second_call(P):
    args = ps.pages(2, 16, 4, 3000, 128, P, torch.bfloat16, slots_first=True, table_dtype=torch.int32,
                    negative_tail=True, sq=257)
    f, cuda, _ = _serve(ps.flash_slots_first, args[:4])
    ps.second_call(f, cuda, ps.flash_slots_first, 2)


@pytest.mark.parametrize("P", [16, 256])
def test_paged_prefill_under_cuda_graph(P):
    args = tuple(a.cuda() for a in ps.pages(2, 8, 2, 1000, 128, P, torch.bfloat16, sq=128))
    f = tc.compile(ps.chunked_prefill, fallback="raise")
    ref = f(*args).clone()
    assert f.kernels()[-1].low.paged
    assert torch.equal(graph_replay(f, *args), ref)
