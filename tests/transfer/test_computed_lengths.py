"""Programs whose q, k or v the prologue computes are generic in the lengths where an argument dim
gives them (transfer/lengths.py): a KV cache concatenated inside the spec serves every cache length
from one capture, where before each decode step captured, transferred and verified again."""
import pytest
import torch

import paged_specs as ps
import torch_cubridge as tc
from helpers import count_captures, first, rel_err, to64
from zoo import PROLOGUE, kv_cache_concat, memory_kv, qkv

ROPE = next(c for c in PROLOGUE if c.name == "rope_in_spec")


def _cache(B: int, H: int, cached: int, new: int, D: int) -> tuple:
    q, kn, vn = (torch.randn(B, H, new, D) for _ in range(3))
    return q, kn, vn, torch.randn(B, H, cached, D), torch.randn(B, H, cached, D)


def _held(prog) -> set[str]:
    return {n for n, _ in prog.requires}


def test_cache_concatenated_in_the_spec_is_generic_in_its_length():
    prog = tc.transfer(kv_cache_concat, *_cache(1, 4, 60, 1, 32))
    assert prog.k.length[:3] == ("k_cache", 2, 1) and prog.v.length[:3] == ("v_cache", 2, 1)
    assert "Skv" not in _held(prog)
    for n in (61, 100, 7):  # the bottom-right causal offset (Skv - Sq) follows the cache
        args = _cache(1, 4, n, 1, 32)
        assert rel_err(first(prog.run(*args)), kv_cache_concat(*to64(args))) < 1e-5
    # several new tokens (speculative decoding): the new keys' count is held, the cache's is free
    prog4 = tc.transfer(kv_cache_concat, *_cache(2, 4, 50, 4, 32))
    assert prog4.k.length[:3] == ("k_cache", 2, 4) and "Skv" not in _held(prog4)
    args = _cache(2, 4, 77, 4, 32)
    assert rel_err(first(prog4.run(*args)), kv_cache_concat(*to64(args))) < 1e-5


def test_a_decode_loop_over_a_growing_cache_captures_once(monkeypatch):
    f = tc.compile(kv_cache_concat, fallback="silent")
    f(*_cache(1, 4, 60, 1, 32))
    calls = count_captures(monkeypatch)
    for n in range(61, 66):
        args = _cache(1, 4, n, 1, 32)
        assert rel_err(f(*args), kv_cache_concat(*to64(args))) < 1e-5
    assert calls == []  # a table hit under the guards, not a capture per step


def test_memory_keys_keep_their_own_count_when_lengths_move():
    """x-transformers' memory key/values: the memory's 4 keys stay 4, the sequence's own keys move.
    S = D here on purpose: a head dim equal to the length must not be taken for a length."""
    mem_k, mem_v = torch.randn(1, 2, 4, 32), torch.randn(1, 2, 4, 32)
    prog = tc.transfer(memory_kv, *qkv(2, 2, 2, 32, 32, 32, torch.float32), mem_k, mem_v)
    assert prog.k.length[:3] == ("k", 2, 4) and "Skv" not in _held(prog) and "Sq" not in _held(prog)
    for S in (9, 50):
        args = qkv(2, 2, 2, S, S, 32, torch.float32) + (mem_k, mem_v)
        assert rel_err(first(prog.run(*args)), memory_kv(*to64(args))) < 1e-5


def test_rope_tables_move_with_the_queries():
    """RoPE applied inside the spec from cos/sin tables of the sequence's length: the prologue's own
    broadcast ties the tables' length to q's and k's, so all four move together."""
    prog = tc.transfer(ROPE.fn, *ROPE.make(1, 2, 2, 40, 32, torch.float32))
    moved = set(prog.k.length[3])
    assert {("q", 2), ("k", 2), ("cos", 0), ("sin", 0)} <= moved, moved
    assert "Sq" not in _held(prog)
    args = ROPE.make(1, 2, 2, 23, 32, torch.float32)
    assert rel_err(first(prog.run(*args)), first(ROPE.fn(*to64(args)))) < 1e-5


def test_a_fixed_latent_query_is_generic_in_the_key_length():
    """A learned latent query's length is no argument's size: it is fixed (the module's own), while the
    keys' length moves as any argument's does. The same program serves inputs of every length."""
    case = next(c for c in PROLOGUE if c.name == "perceiver_latents")
    args = case.make(2, 2, 2, 30, 16, torch.float32)
    prog = tc.transfer(case.fn, *args)
    assert prog.q.length == ("", -1, 8, ()) and not {"Sq", "Skv"} & _held(prog)
    for S in (45, 9):
        a = (args[0],) + case.make(2, 2, 2, S, 16, torch.float32)[1:]
        with torch.no_grad():
            assert rel_err(first(prog.run(*a)), first(case.fn(a[0].double(), *to64(a[1:])))) < 1e-5


def _widened(args: tuple, width: int) -> tuple:
    """The same page pool, a block table `width` pages wide and lengths inside it."""
    q, kp, vp, table, _ = args
    B, P = table.shape[0], kp.shape[2]
    t = torch.randint(0, kp.shape[0], (B, width), dtype=table.dtype)
    return q, kp, vp, t, torch.randint(1, width * P + 1, (B,))


def test_pages_through_a_block_table_are_generic_in_the_table_width():
    """Key length = table width x page size: the width moves (the table is the small argument), the
    page size stays pinned, the pool's page count is free (the spec never reads it), and every width and
    pool is one program."""
    args = ps.pages(2, 8, 2, 70, 16, 16, torch.float32)
    prog = tc.transfer(ps.vllm_heads_first, *args)
    assert prog.k.length == ("block_table", 1, 0, (("block_table", 1),), 16), prog.k.length
    assert "Skv" not in _held(prog)
    for width in (2, 9, 31):
        a = _widened(args, width)
        assert rel_err(first(prog.run(*a)), ps.vllm_heads_first(*to64(a))) < 1e-5
    pool = [torch.cat([x, torch.randn(5, *x.shape[1:])]) for x in args[1:3]]  # a bigger pool: same program
    bigger = (args[0], *pool, *args[3:])
    assert rel_err(first(prog.run(*bigger)), ps.vllm_heads_first(*to64(bigger))) < 1e-5
    with pytest.raises(ValueError, match="k_pages.shape"):  # another page size: outside the guards
        prog.run(args[0], args[1][:, :, :8], args[2][:, :, :8], *args[3:])


def test_a_decode_loop_over_a_widening_block_table_captures_once(monkeypatch):
    args = ps.pages(2, 8, 2, 70, 16, 16, torch.float32, slots_first=True)[:4]
    f = tc.compile(ps.flash_slots_first, fallback="silent")
    f(*args)
    calls = count_captures(monkeypatch)
    for width in (6, 7, 20):
        q, kp, vp, table = args
        t = torch.randint(0, kp.shape[0], (2, width))
        assert rel_err(f(q, kp, vp, t), ps.flash_slots_first(*to64((q, kp, vp, t)))) < 1e-5
    assert calls == []


def test_a_large_pinned_argument_is_drawn_once_per_verification(monkeypatch):
    """A page pool keeps its size in every trial: within one verification it is drawn once (each trial
    still draws its own table and queries), outside one every call draws it again."""
    import torch_cubridge.verify.inputs as vi
    from torch_cubridge.verify.reference import module_copies
    monkeypatch.setattr(vi, "BIG", 1 << 10)
    args = ps.pages(2, 8, 2, 70, 16, 16, torch.float32)
    prog = tc.transfer(ps.vllm_heads_first, *args)
    bound = dict(zip(("q", "k_pages", "v_pages", "block_table", "seq_lens"), args))
    sizes = vi.example_sizes(prog, bound)
    with module_copies():
        a, b = (vi.make_inputs(prog, bound, sizes, seed=s) for s in (1, 2))
        assert a["k_pages"] is b["k_pages"] and not torch.equal(a["k_pages"], args[1])
        assert not torch.equal(a["q"], b["q"]) and not torch.equal(a["block_table"], b["block_table"])
    c, d = (vi.make_inputs(prog, bound, sizes, seed=s) for s in (1, 2))
    assert not torch.equal(c["k_pages"], d["k_pages"])


def test_the_length_rules_are_remembered_for_the_same_program_and_reads_only(monkeypatch):
    """A model's layers ask the same question: one symbolic run per program and read shapes. Another
    cache length, stride or dtype is another question (the rule holds the sizes' example values)."""
    import importlib
    lengths = importlib.import_module("torch_cubridge.transfer.lengths")
    prog = tc.transfer(kv_cache_concat, *_cache(1, 4, 60, 1, 32))
    runs: list[int] = []
    found = lengths._found

    def counted(*a):
        runs.append(1)
        return found(*a)
    monkeypatch.setattr(lengths, "_found", counted)
    monkeypatch.setattr(lengths, "_MEMO", type(lengths._MEMO)())
    args = lambda: dict(zip(("q", "k_new", "v_new", "k_cache", "v_cache"), _cache(1, 4, 60, 1, 32)))  # noqa: E731
    first_rules = lengths.with_lengths(prog, args())
    again = lengths.with_lengths(prog, args())
    assert len(runs) == 1 and again.k.length == first_rules.k.length == prog.k.length
    other = args()
    other["k_cache"] = other["k_cache"].transpose(1, 2).contiguous().transpose(1, 2)  # same sizes, other strides
    lengths.with_lengths(prog, other)
    lengths.with_lengths(prog, dict(zip(("q", "k_new", "v_new", "k_cache", "v_cache"), _cache(1, 4, 70, 1, 32))))
    assert len(runs) == 3
