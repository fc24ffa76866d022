"""On a CUDA device: paged decode specs are served by the decode kernel reading K and V from their
pages through the block table (no gather), every output against float64."""
import pytest
import torch

import paged_specs as ps
import torch_cubridge as tc
from helpers import assert_rows_close, graph_replay, to64

pytestmark = pytest.mark.gpu


def _serve(fn, args):
    return ps.serve(fn, args, "decode")


@pytest.mark.parametrize("D,P", [(128, 16), (128, 256), (64, 64), (64, 32), (64, 24), (48, 16), (32, 16), (256, 16),
                                 (256, 64)])
def test_heads_first_pages_with_lengths(D, P):
    """Page sizes a power of two and not (24): blocks inside a page (64, 256), of whole pages (16, 32), of
    neither (24); D 48 takes the loader with no fixed column per thread, D 32 a pass of 32 rows; D 256 (Gemma)
    reads Q from shared memory and holds 16 rows' table entries a thread."""
    _serve(ps.vllm_heads_first, ps.pages(3, 8, 2, 3000, D, P, torch.bfloat16))


@pytest.mark.parametrize("B,S,P", [(16, 8192, 2), (1, 3000, 16)])
def test_small_pages_and_many_splits(B, S, P):
    """Pages of 2 (several per pass of a thread's rows: a lookup per row) over 2048 pages a split; one
    sequence of 3000 keys in pages of 16 over many splits, most starting inside the table."""
    _serve(ps.vllm_heads_first, ps.pages(B, 16, 8, S, 64, P, torch.bfloat16))


@pytest.mark.parametrize("P", [16, 24, 256])
def test_blocks_skipped_inside_a_split(P):
    """Key blocks 1 and 2 masked out inside splits of many blocks (128 tiles fill the GPU in two splits): the
    kernel loads a block's table entries one block ahead, and must load them again for the block after a skip."""
    args = ps.pages(16, 32, 8, 2000, 128, P, torch.bfloat16)
    args[4][:] = 2000
    _serve(ps.span_dropped, args)


def test_slots_first_int32_table_negative_tail_and_a_second_call():
    args = ps.pages(2, 16, 4, 5000, 128, 16, torch.bfloat16, slots_first=True, table_dtype=torch.int32,
                    negative_tail=True)
    f, cuda, _ = _serve(ps.flash_slots_first, args[:4])
    ps.second_call(f, cuda, ps.flash_slots_first, 1)


def test_paged_decode_under_cuda_graph():
    args = tuple(a.cuda() for a in ps.pages(2, 8, 2, 2000, 128, 16, torch.bfloat16))
    f = tc.compile(ps.vllm_heads_first, fallback="raise")
    ref = f(*args).clone()
    assert f.kernels()[-1].low.paged
    assert torch.equal(graph_replay(f, *args), ref)


def test_a_paged_program_serves_every_table_width():
    """The key length is the block table's width times the page size (transfer/lengths.py), so one
    program, verified at small widths on the CPU and on the call's own inputs on the GPU, serves a decode
    loop whose table widens: no capture per step, every step by the kernel against float64."""
    args = ps.pages(4, 32, 8, 4096, 128, 16, torch.bfloat16)
    f, cuda, _ = _serve(ps.vllm_heads_first, args)
    e = f.entries()[-1]
    assert e.result.generic and e.result.program.k.length[4] == 16
    q, kp, vp, table, _ = cuda
    entries = len(f.entries())
    for width in (table.shape[1] + 1, table.shape[1] + 9, 2 * table.shape[1]):
        t = torch.randint(0, kp.shape[0], (4, width), device="cuda", dtype=table.dtype)
        lens = torch.randint(1, width * 16 + 1, (4,), device="cuda")
        out = f(q, kp, vp, t, lens)
        ref = ps.vllm_heads_first(*to64(tuple(x.cpu() for x in (q, kp, vp, t, lens))))
        assert_rows_close(out, ref, out.dtype)
    assert len(f.entries()) == entries and f.served["spec"] == 0
    assert f.kernels()[-1].low.paged


def test_a_paged_program_serves_pools_of_every_size():
    """The spec never reads the pool's page count (capture/guards.unread_sizes), so the program holds at
    any: a pool grown, shrunk and grown again (a server restarted with another share of free memory), each
    call by the kernel with no new capture, against float64. Slots-first pages, as the flash API lays them,
    and entries of -1 past each sequence, which count from the end of the pool the call passes."""
    args = ps.pages(4, 32, 8, 3000, 128, 16, torch.bfloat16, slots_first=True, table_dtype=torch.int32,
                    negative_tail=True)
    f, cuda, _ = ps.serve(ps.flash_slots_first, args[:4], "decode")
    q, kp, vp, table = cuda
    entries, kernels = len(f.entries()), len(f.kernels())
    for n in (kp.shape[0] + 37, int(table.max()) + 1, 3 * kp.shape[0]):
        pool_k = torch.randn(n, *kp.shape[1:], device="cuda", dtype=kp.dtype)
        pool_v = torch.randn(n, *vp.shape[1:], device="cuda", dtype=vp.dtype)
        out = f(q, pool_k, pool_v, table)
        ref = ps.flash_slots_first(*to64(tuple(x.cpu() for x in (q, pool_k, pool_v, table))))
        assert_rows_close(out, ref, out.dtype)
    assert (len(f.entries()), len(f.kernels())) == (entries, kernels) and f.served["spec"] == 0
    assert f.kernels()[-1].low.paged


@pytest.mark.parametrize("spec,slots", [(ps.flash_slots_first, True), (ps.vllm_heads_first, False)])
def test_a_paged_program_serves_every_batch_size(spec, slots):
    """Sequences join and leave between decode steps: one program, fitted to the batch (Program.batch),
    serves 2 to 40 sequences by the kernel with no new capture, the same layout twice (the second by the
    host's replay), each against float64. (One sequence is a call signature of its own: a size of 1.)"""
    args = ps.pages(4, 32, 8, 3000, 128, 16, torch.bfloat16, slots_first=slots, table_dtype=torch.int32)
    n = 5 if spec is ps.vllm_heads_first else 4
    f, cuda, _ = ps.serve(spec, args[:n], "decode")
    assert f.kernels()[-1].p.batch, f.kernels()[-1].p.batch
    kp, vp, table = cuda[1], cuda[2], cuda[3]
    entries, kernels = len(f.entries()), len(f.kernels())
    for B in (2, 7, 40, 7, 3):
        q = torch.randn(B, *cuda[0].shape[1:], device="cuda", dtype=cuda[0].dtype)
        t = torch.randint(0, kp.shape[0], (B, table.shape[1]), device="cuda", dtype=table.dtype)
        extra = (torch.randint(1, table.shape[1] * 16 + 1, (B,), device="cuda"),) if n == 5 else ()
        a = (q, kp, vp, t, *extra)
        for _ in range(2):
            out = f(*a)
            ref = spec(*to64(tuple(x.cpu() for x in a)))
            assert_rows_close(out, ref, out.dtype)
    assert (len(f.entries()), len(f.kernels())) == (entries, kernels) and f.served["spec"] == 0
    assert f.served["kernel"] == 11


@pytest.mark.parametrize("D,DV", [(192, 128), (64, 128)])
def test_value_pages_of_their_own_head_dim(D, DV):
    """Multi-head latent attention's paged cache (V 128 under Q and K 192), and V wider than K: read in
    place, V through its own row pitch."""
    q, kp, vp, table, _ = ps.pages(3, 8, 2, 2000, D, 16, torch.bfloat16, slots_first=True)
    vp = torch.randn(*vp.shape[:-1], DV, dtype=torch.bfloat16)
    f, _, out = _serve(ps.flash_slots_first, (q, kp, vp, table))
    assert out.shape[-1] == DV and f.kernels()[-1].value_dim == DV


def test_a_pool_of_2_31_pages_is_served_by_the_spec():
    """The kernels read table entries in 32 bits (paged.cuh Entry), so a pool of 2^31 pages or more is refused at
    the call (runner._pages, and the C Decoder hands it to the runner) and the spec serves it; the same program
    still serves the next call with a small pool. The large pool is one page viewed 2^31 + 8 times (stride 0)."""
    args = tuple(a.cuda() for a in ps.pages(2, 8, 2, 300, 64, 16, torch.bfloat16))
    f = tc.compile(ps.vllm_heads_first, fallback="raise")
    f(*args)
    assert f.served["spec"] == 0 and f.kernels()[-1].low.paged
    q, kp, vp, table, lens = args
    big = tuple(x[:1].expand(2 ** 31 + 8, *x.shape[1:]) for x in (kp, vp))
    table = table % 7 + 2 ** 31  # entries a 32-bit read would get wrong (every page is the same memory here)
    out = f(q, *big, table, lens)
    assert f.served["spec"] == 1
    assert torch.equal(out, ps.vllm_heads_first(q, *big, table, lens))
    f(*args)
    assert f.served["spec"] == 1


_EMPTY_POOL = """
import sys, torch
sys.path[:0] = {search!r}
import paged_specs as ps, torch_cubridge as tc
args = tuple(a.cuda() for a in ps.pages(2, 8, 2, 300, 64, 16, torch.bfloat16))
f = tc.compile(ps.vllm_heads_first)
f(*args)
assert f.served["spec"] == 0 and f.kernels()[-1].low.paged
q, kp, vp, table, lens = args
kernel = f.served["kernel"]
try:
    f(q, kp[:0], vp[:0], table, lens)
    print("EMPTY served", f.served["kernel"] - kernel)
except Exception as e:
    print("EMPTY raised", f.served["kernel"] - kernel, type(e).__name__)
out = f(*args)
torch.cuda.synchronize()
ok = (out.float() - ps.vllm_heads_first(*args).float()).abs().max().item() < 2e-2
print("AFTER", ok, f.served["kernel"] - kernel)
"""


def test_an_empty_pool_goes_to_the_spec_and_leaves_the_context_usable():
    """An empty pool of pages has no page to clamp a table entry into: the runner (and the C Decoder, which
    hands it over) refuses it, and the spec computes the call, here raising its own IndexError. Run in a
    fresh process: a kernel reading no pool, or a device-side assert, would leave the CUDA context unusable,
    which the next call then shows (and which must not reach this worker's other tests)."""
    import subprocess
    import sys
    from paths import ROOT, SEARCH
    code = _EMPTY_POOL.format(search=[str(ROOT), *map(str, SEARCH)])
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    import re
    said = r.stdout + r.stderr[-2000:]
    empty, after = re.search(r"^EMPTY \w+ (\d+)", r.stdout, re.M), re.search(r"^AFTER (\w+) (\d+)", r.stdout, re.M)
    assert empty and after, said
    assert empty.group(1) == "0", said  # no kernel launched on the empty pool
    assert after.groups() == ("True", "1"), said  # the next call's kernel ran, and was right
