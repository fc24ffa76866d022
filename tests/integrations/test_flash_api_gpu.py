"""On a CUDA device: cubridge's flash-attention API served by kernels. The block-table decode at a serving
shape against float64, eagerly and replayed from a CUDA graph; transformers' continuous batching through the
registered flash name (packed prefill, block-table decode, CUDA graphs as transformers sets them for flash)
against transformers' own paged eager, token for token up to the reference's first near-tie."""
import collections
import warnings

import pytest
import torch

import torch_cubridge.integrations.flash_api as tfa
from test_continuous_batching_gpu import KW, _generated, assert_tokens_match, reference_run
from tiny_models import build

pytestmark = pytest.mark.gpu


def _served(name: str) -> collections.Counter:
    return collections.Counter(tfa.compiled()[name].served)


def _reference(q, kc, vc, table, lens, scale):
    """float64: each sequence's keys gathered from its pages, softmax over them."""
    B, _, H, D = q.shape
    P, Hkv = kc.shape[1], kc.shape[2]
    out = torch.empty(B, H, D, dtype=torch.float64, device=q.device)
    for b in range(B):
        n = int(lens[b])
        pages = table[b, : -(-n // P)].long() % kc.shape[0]
        k = kc[pages].reshape(-1, Hkv, D)[:n].double().repeat_interleave(H // Hkv, 1)
        v = vc[pages].reshape(-1, Hkv, D)[:n].double().repeat_interleave(H // Hkv, 1)
        s = torch.einsum("hd,shd->hs", q[b, 0].double(), k) * scale
        out[b] = torch.einsum("hs,shd->hd", torch.softmax(s, -1), v)
    return out


def test_kvcache_decode_at_a_serving_shape_eager_and_in_a_graph():
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    B, H, Hkv, D, P, W = 4, 32, 8, 128, 16, 256
    N = B * W + 7
    kc = torch.randn(N, P, Hkv, D, device=dev, dtype=dt)
    vc = torch.randn(N, P, Hkv, D, device=dev, dtype=dt)
    table = torch.randperm(N - 1, device=dev)[: B * W].view(B, W).int()
    table[3, 1:] = -1  # a short sequence: the rest of its row unused, as transformers fills it
    at = torch.tensor([4000, 999, 2500, 5], dtype=torch.int32, device=dev)
    q = torch.randn(B, 1, H, D, device=dev, dtype=dt)
    kn, vn = torch.randn(B, 1, Hkv, D, device=dev, dtype=dt), torch.randn(B, 1, Hkv, D, device=dev, dtype=dt)
    before = _served("paged_decode")
    out = tfa.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=at, block_table=table,
                                      softmax_scale=D ** -0.5, causal=True)
    assert _served("paged_decode") - before == collections.Counter(kernel=1), tfa.compiled()["paged_decode"].entries()
    want = _reference(q, kc, vc, table, at + 1, D ** -0.5)
    assert (out[:, 0].double() - want).abs().max() < 2e-2
    # a CUDA graph replays the append and the kernel; new positions and values between replays
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        tfa.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=at, block_table=table,
                                    softmax_scale=D ** -0.5, causal=True)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        graphed = tfa.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=at, block_table=table,
                                             softmax_scale=D ** -0.5, causal=True)
    at.copy_(torch.tensor([4001, 1000, 2501, 6], dtype=torch.int32))
    q.copy_(torch.randn_like(q))
    kn.copy_(torch.randn_like(kn))
    g.replay()
    torch.cuda.synchronize()
    want = _reference(q, kc, vc, table, at + 1, D ** -0.5)
    assert (graphed[:, 0].double() - want).abs().max() < 2e-2


def test_generate_batch_through_the_flash_name_is_served_by_kernels():
    try:
        name = tfa.register()
    except RuntimeError as e:
        pytest.skip(str(e))
    ref, prompts, gc = reference_run()
    want = _generated(ref, prompts, gc)
    ours = build("llama", name, torch.bfloat16, "cuda", **KW)
    ours.load_state_dict(ref.state_dict())
    before = {n: _served(n) for n in ("varlen", "paged_decode")}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = _generated(ours, prompts, gc)
    served = {n: _served(n) - before[n] for n in before}
    reasons = [r for c in tfa.compiled().values() for e in c.entries() for r in [e.reason, *e.reasons.values(), *e.spec_calls] if r]
    # the prefill took the packed path and the decode steps the block-table path, every call by a kernel
    assert served["varlen"]["kernel"] > 0 and served["paged_decode"]["kernel"] > 0, (served, reasons)
    assert all(c["spec"] == 0 for c in served.values()), (served, "\n".join(reasons))
    assert_tokens_match(ref, got, want, len(prompts))


@pytest.mark.parametrize("entry", [torch.int32, torch.int64])
def test_one_launch_append_writes_what_pytorch_writes(entry):
    from torch_cubridge.ops.append import paged_append
    torch.manual_seed(1)
    dev, dt = "cuda", torch.bfloat16
    N, P, Hkv, D, B = 40, 16, 8, 128, 6
    kc, vc = torch.randn(N, P, Hkv, D, device=dev, dtype=dt), torch.randn(N, P, Hkv, D, device=dev, dtype=dt)
    table = torch.randperm(N, device=dev)[: B * 4].view(B, 4).to(entry)
    table[1, 2] = -3  # wraps, as torch indexing does
    # positions: real ones, padding (-1), one past the table (writes nothing), one in the wrapped page
    pos = torch.tensor([0, 35, 17, -1, 64, 63], dtype=torch.int32, device=dev)
    # new rows as continuous batching passes them: a transposed view, heads B tokens apart
    k = torch.randn(1, Hkv, B, D, device=dev, dtype=dt).transpose(1, 2).reshape(B, 1, Hkv, D)
    v = torch.randn(Hkv, B, D, device=dev, dtype=dt).transpose(0, 1)[:, None]
    want_k, want_v = kc.clone(), vc.clone()
    keep = pos < 64  # the PyTorch writer has no table bound: leave the past-the-table row out of its call
    tfa._append(want_k, k[keep], table[keep], pos[keep])
    tfa._append(want_v, v[keep], table[keep], pos[keep])
    assert paged_append(kc, vc, k, v, table, pos)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)
    assert not paged_append(kc.float(), vc.float(), k.float(), v.float(), table, pos)  # not a layout it takes
