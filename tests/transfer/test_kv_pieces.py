"""K and V concatenated inside the spec, read in place as their pieces by the decode kernel
(ir/segments.py, decode_kernel.cuh's SegKV): which programs qualify, the words the runner packs, and
the kernel's build. Through the kernel on the GPU: tests/lower/test_coverage_gpu.py."""
import types

import pytest
import torch
import torch.nn.functional as F

import torch_cubridge as tc
from torch_cubridge.ir.segments import segment_operands
from torch_cubridge.lower import lower
from torch_cubridge.ops.pack import SEG_FORMAT, SEG_PIECES
from torch_cubridge.ops.runner import KernelRunner
from zoo import kv_cache_concat, memory_kv, qkv
from test_lower import needs_nvcc, tc_cubin, _sass


def gqa_cached(q, k_new, v_new, k_cache, v_cache):
    k = torch.cat([k_cache, k_new], dim=2)
    v = torch.cat([v_cache, v_new], dim=2)
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


def seq_first(q, k_new, v_new, k_cache, v_cache):
    """[B, S, H, D] caches joined along dim 1 (the keys), the layout flash-attn users keep."""
    k = torch.cat((k_cache, k_new), 1).transpose(1, 2)
    v = torch.cat((v_cache, v_new), 1).transpose(1, 2)
    return torch.softmax(q.transpose(1, 2) @ k.transpose(-1, -2) * q.shape[-1] ** -0.5, -1) @ v


def _cache(B=2, H=8, Hkv=2, cached=40, new=1, D=64, dtype=torch.float32):
    q = torch.randn(B, H, new, D, dtype=dtype)
    kn, vn = (torch.randn(B, Hkv, new, D, dtype=dtype) for _ in range(2))
    return (q, kn, vn) + tuple(torch.randn(B, Hkv, cached, D, dtype=dtype) for _ in range(2))


def test_concatenations_along_the_keys_are_pieces():
    segs = segment_operands(tc.transfer(gqa_cached, *_cache()))
    assert segs.k == (("@arg", "k_cache"), ("@arg", "k_new")) and segs.v == (("@arg", "v_cache"), ("@arg", "v_new"))
    segs = segment_operands(tc.transfer(kv_cache_concat, *_cache(H=2)))
    assert segs is not None and len(segs.k) == 2
    mem = tc.transfer(memory_kv, *qkv(2, 2, 2, 30, 30, 32, torch.float32), torch.randn(1, 2, 4, 32),
                      torch.randn(1, 2, 4, 32))
    segs = segment_operands(mem)  # the memory, broadcast over the batch by an expand step, then the keys
    assert segs is not None and segs.k[0][0] == "@step" and segs.k[1] == ("@arg", "k")


def test_a_join_in_the_sequence_first_layout_is_pieces_and_one_along_heads_is_not():
    """seq_first joins [B, S, H, D] caches along dim 1, then transposes: the transpose is the operand's
    layout, so the join is along its keys. Heads joined (two groups of KV heads) are not pieces."""
    q = torch.randn(2, 1, 4, 32)
    args = (q,) + tuple(torch.randn(2, n, 4, 32) for n in (1, 1, 30, 30))
    segs = segment_operands(tc.transfer(seq_first, *args))
    assert segs is not None and segs.k == (("@arg", "k_cache"), ("@arg", "k_new"))

    def heads_joined(q, k1, k2, v1, v2):
        k, v = torch.cat([k1, k2], 1), torch.cat([v1, v2], 1)
        return torch.softmax(q @ k.transpose(-1, -2), -1) @ v
    q, k, v = qkv(2, 4, 4, 20, 20, 32, torch.float32)
    assert segment_operands(tc.transfer(heads_joined, q, k[:, :2], k[:, 2:], v[:, :2], v[:, 2:])) is None


def _runner_for(prog, dtype):
    ns = types.SimpleNamespace(p=prog, dtype=dtype)
    ns._readable = lambda ts: KernelRunner._readable(ns, ts)
    return ns


@pytest.mark.parametrize("expand", [False, True])
def test_piece_words_address_every_key_of_the_join(expand):
    """The SegKV words, read as the kernel reads them (segment_row: the first piece whose cumulative end
    exceeds the key), reach exactly the row torch.cat puts there, in a broadcast piece too."""
    args = _cache(dtype=torch.bfloat16, cached=37, new=3)
    prog = tc.transfer(gqa_cached, *_cache(dtype=torch.bfloat16))
    ks, vs = [args[3], args[1]], [args[4], args[2]]
    if expand:  # one memory for every sequence: batch stride 0
        ks[0] = torch.randn(1, 2, 37, 64, dtype=torch.bfloat16).expand(2, -1, -1, -1)
    r = _runner_for(prog, torch.bfloat16)
    k0, v0, (ksz, _), (vsz, _), words = KernelRunner._pieces(r, ks, vs)
    w = SEG_FORMAT.unpack(words)
    n = SEG_PIECES
    kp, k_sb, k_sh, k_ss, k_end = w[:n], w[2 * n:3 * n], w[3 * n:4 * n], w[4 * n:5 * n], w[8 * n:9 * n]
    assert ksz == (2, 2, 40, 64) and vsz == (2, 2, 40, 64) and list(k_end) == [37, 40, 40, 40]
    joined = torch.cat(ks, 2)
    for b, h, s in ((0, 0, 0), (1, 1, 36), (1, 0, 37), (0, 1, 39)):
        g = sum(s >= k_end[i] for i in range(n - 1))
        lo = k_end[g - 1] if g else 0
        piece = ks[g]
        addr = kp[g] + 2 * (b * k_sb[g] + h * k_sh[g] + (s - lo) * k_ss[g])  # bytes, bf16
        elem = (addr - piece.data_ptr()) // 2
        got = torch.as_strided(piece, (64,), (1,), piece.storage_offset() + elem)
        assert torch.equal(got, joined[b, h, s]), (b, h, s)


def test_pieces_the_kernel_cannot_read_in_place_are_joined():
    args = _cache(dtype=torch.bfloat16)
    prog = tc.transfer(gqa_cached, *_cache(dtype=torch.bfloat16))
    r = _runner_for(prog, torch.bfloat16)
    odd = torch.randn(2, 2, 41, 65, dtype=torch.bfloat16)[..., 1:]  # rows 2 bytes off 16-byte alignment
    v_cache = torch.randn(2, 2, 41, 64, dtype=torch.bfloat16)
    k0, *_, words = KernelRunner._pieces(r, [odd, args[1]], [v_cache, args[2]])
    w = SEG_FORMAT.unpack(words)
    assert list(w[8 * SEG_PIECES:]) == [42] * (2 * SEG_PIECES)  # K and V each one joined piece of 41 + 1 keys
    assert k0.is_contiguous() and torch.equal(k0, torch.cat([odd, args[1]], 2))


@needs_nvcc
def test_segmented_decode_kernel_builds_without_spills(tmp_path):
    prog = tc.transfer(gqa_cached, *_cache(D=128, dtype=torch.bfloat16))
    low = lower(prog, "sm_90a", "bfloat16", 128, decode=True, segmented=True)
    assert low.segmented and "cubridge::SegKV pg" in low.source
    sass = _sass(tc_cubin(low.source, "sm_90a"), tmp_path)
    assert "HMMA" in sass and "LDL" not in sass and "STL" not in sass
