"""On any CUDA device, the FA2-class kernel (sm_80 and up; on Hopper under CUBRIDGE_KERNEL=sm80): paged
prefill specs with pages of whole 64-key blocks are served with K and V read from their pages through the
block table (no gather): a block by its page's strided copy, or row by row where the head dim's 16-byte
chunks do not divide the threads (D 96); smaller pages are gathered (lower/choice.py says why).
Every output against float64."""
import pytest
import torch

import paged_specs as ps
import torch_cubridge as tc
from helpers import graph_replay

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _fa2_kernel(monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    monkeypatch.setenv("CUBRIDGE_KERNEL", "sm80")  # Hopper keeps its own kernel otherwise


def _serve(fn, args, in_place=True):
    return ps.serve(fn, args, "sm80", in_place)


@pytest.mark.parametrize("D,P,sq", [(128, 256, 333), (128, 64, 129), (96, 64, 70), (256, 128, 70), (128, 16, 100),
                                    (64, 8, 200), (128, 24, 100)])
def test_chunked_prefill_over_pages(D, P, sq):
    """Pages of 64 to 256 rows read in place (D 96 row by row, the others a block at a time); the keys end
    inside a block. Pages of 8, 16 and 24 gathered."""
    _serve(ps.chunked_prefill, ps.pages(3, 8, 2, 1500, D, P, torch.bfloat16, sq=sq), in_place=P % 64 == 0)


@pytest.mark.parametrize("P", [64, 256])
def test_slots_first_int32_table_negative_tail_and_a_second_call(P):
    args = ps.pages(2, 16, 4, 3000, 128, P, torch.float16, slots_first=True, table_dtype=torch.int32,
                    negative_tail=True, sq=257)
    f, cuda, _ = _serve(ps.flash_slots_first, args[:4])
    ps.second_call(f, cuda, ps.flash_slots_first, 1)


def test_value_pages_of_their_own_head_dim():
    """Multi-head latent attention's paged cache (V 128 under Q and K 192), many queries."""
    q, kp, vp, table, _ = ps.pages(2, 8, 2, 1000, 192, 64, torch.bfloat16, slots_first=True, sq=100)
    vp = torch.randn(*vp.shape[:-1], 128, dtype=torch.bfloat16)
    f, _, out = _serve(ps.flash_slots_first, (q, kp, vp, table))
    assert out.shape[-1] == 128


def test_paged_prefill_under_cuda_graph():
    args = tuple(a.cuda() for a in ps.pages(2, 8, 2, 1000, 128, 64, torch.bfloat16, sq=128))
    f = tc.compile(ps.chunked_prefill, fallback="raise")
    ref = f(*args).clone()
    assert f.kernels()[-1].low.paged and f.kernels()[-1].low.tile.kernel == "sm80"
    assert torch.equal(graph_replay(f, *args), ref)
