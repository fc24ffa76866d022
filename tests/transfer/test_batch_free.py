"""A program whose prologue names the batch size moves with it where probes show it may (Program.batch):
continuous batching's decode steps change the number of sequences every few steps, and each new count
used to capture, transfer and verify again (transfer/generalize._batch_free)."""
import pytest
import torch

import paged_specs as ps
import torch_cubridge as tc
from helpers import count_captures, first, rel_err, to64
from torch_cubridge.verify.cpu import verify_shapes
from torch_cubridge.verify.gpu import gpu_shapes


def _batch(args: tuple, B: int, seed: int = 0) -> tuple:
    """The call's arguments at B sequences: new queries, a new table over the same pool, new lengths."""
    g = torch.Generator().manual_seed(seed)
    q, kp, vp, table, *rest = args
    q = torch.randn(B, *q.shape[1:], generator=g, dtype=q.dtype)
    table = torch.randint(0, kp.shape[0], (B, table.shape[1]), generator=g, dtype=table.dtype)
    if rest:
        rest = [torch.randint(1, table.shape[1] * kp.shape[2] + 1, (B,), generator=g)]
    return (q, kp, vp, table, *rest)


def test_a_paged_program_moves_with_the_batch():
    """The views' B is fitted to the batch, the table's and lengths' rows move with it (the symbolic trace
    found them equal to q's batch), and the pool's head dim, equal to B here, does not."""
    args = ps.pages(2, 8, 2, 70, 16, 16, torch.float32)  # B 2 = Hkv 2
    prog = tc.transfer(ps.vllm_heads_first, *args)
    assert set(prog.batch) == {("q", 0), ("block_table", 0), ("seq_lens", 0)}, prog.batch
    assert "B" not in dict(prog.requires) and not any("q.shape[0] ==" in str(g) and "block_table" not in str(g)
                                                      for g in prog.guards), (prog.requires, prog.guards)
    for B in (3, 5, 2):
        a = _batch(args, B, seed=B)
        assert rel_err(first(prog.run(*a)), ps.vllm_heads_first(*to64(a))) < 1e-5, B
    # both verifications run it at a batch size other than the call's too
    bound = dict(zip(("q", "k_pages", "v_pages", "block_table", "seq_lens"), args))
    assert {s["B"] for s in verify_shapes(prog, bound, True)} >= {2, 3}
    assert {s["B"] for s in gpu_shapes(prog, bound)} >= {2, 3}
    with pytest.raises(ValueError, match="holds only where"):  # a table of another batch than q's
        prog.run(*_batch(args, 3)[:3], _batch(args, 4)[3], _batch(args, 3)[4])


def test_a_decode_loop_over_changing_batch_sizes_captures_once(monkeypatch):
    """Sequences join and leave between steps: one program serves every batch size of two or more."""
    args = ps.pages(2, 8, 2, 70, 16, 16, torch.float32, slots_first=True)[:4]
    f = tc.compile(ps.flash_slots_first, fallback="silent")
    f(*args)
    calls = count_captures(monkeypatch)
    for B in (3, 7, 2, 4):
        a = _batch(args, B, seed=B)
        assert rel_err(f(*a), ps.flash_slots_first(*to64(a))) < 1e-5, B
    assert calls == []


def flattened_rows(q, k_pages, v_pages, block_table):
    """The gather flattened over sequences and pages together ([B * per * P, Hkv, D] rows), then split
    again: the view's B * S is no affine form of B and the lengths, so the batch stays held."""
    B, H, _, D = q.shape
    Hkv, P = k_pages.shape[1], k_pages.shape[2]
    k = k_pages[block_table].permute(0, 1, 3, 2, 4).reshape(B * block_table.shape[1] * P, Hkv, D)
    v = v_pages[block_table].permute(0, 1, 3, 2, 4).reshape(B * block_table.shape[1] * P, Hkv, D)
    k, v = (x.reshape(B, -1, Hkv, D).transpose(1, 2) for x in (k, v))
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)


@pytest.mark.parametrize("spec,B,slots", [(flattened_rows, 2, False), (ps.flash_slots_first, 1, True)])
def test_the_batch_stays_held_where_no_probe_shows_it_may_move(spec, B, slots):
    """A literal of B times a length (no affine fit), or a call of one sequence (a signature of its own):
    B is held, and a call at another batch size is outside the program's guards."""
    args = ps.pages(B, 8, 2, 70, 16, 16, torch.float32, slots_first=slots)[:4]
    prog = tc.transfer(spec, *args)
    assert prog.batch == () and ("B", B) in prog.requires, (prog.batch, prog.requires)
    assert rel_err(first(prog.run(*args)), spec(*to64(args))) < 1e-5
    with pytest.raises(ValueError, match="holds only where"):
        prog.run(*_batch(args, 3))
