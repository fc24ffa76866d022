"""PyTorch's own nn.MultiheadAttention as the spec. Its forward hands the attention to SDPA from inside
F.multi_head_attention_forward, where capture's SDPA substitute (a TorchFunctionMode, off while it handles a
call) does not see it: the trace is taken again with SDPA's math backend, which decomposes into plain ops
(capture/trace.py `fused_sdpa`). Its in-projection is one [S, B, 3E] tensor read as [B*H, S, D] through
views: the walk makes q, k and v at their last shapes instead (offscore.make_gathered_operands), and where
the spec never views them with batch and heads apart (need_weights=True, the default: bmm over [B*H, S, D]),
made with that merged dim unflattened (offscore.materialize_unflattened)."""
import copy

import pytest
import torch

import torch_cubridge as tc
from helpers import rel_err
from torch_cubridge.capture.trace import capture, fused_sdpa
from torch_cubridge.errors import UnsupportedSpec

E, HEADS, B, S = 64, 4, 2, 40


def _mha(**kw) -> torch.nn.MultiheadAttention:
    torch.manual_seed(0)
    return torch.nn.MultiheadAttention(E, HEADS, batch_first=True, **kw).eval()


def self_attention(x, mha):
    return mha(x, x, x, need_weights=False)[0]


def causal_self_attention(x, mha):
    m = torch.nn.Transformer.generate_square_subsequent_mask(x.shape[1], device=x.device, dtype=x.dtype)
    return mha(x, x, x, attn_mask=m, need_weights=False, is_causal=True)[0]


def padded_self_attention(x, mha, pad):
    return mha(x, x, x, key_padding_mask=pad, need_weights=False)[0]


def cross_attention(x, mem, mha):
    return mha(x, mem, mem, need_weights=False)[0]


def _args(name: str, s: int = S) -> tuple:
    g = torch.Generator().manual_seed(s)
    x = torch.randn(B, s, E, generator=g)
    if name in ("padded", "weights_padded_causal"):
        pad = torch.zeros(B, s, dtype=torch.bool)
        pad[1, 25:] = True  # the second sequence's last keys are padding
        return x, _mha(), pad
    if name in ("cross", "weights_cross"):
        return x, torch.randn(B, s + 9, E, generator=g), _mha()
    return x, _mha()


def cast(args: tuple, dtype: torch.dtype, device: str = "cpu", modules: dict | None = None) -> tuple:
    """The arguments on `device` in `dtype`, each module on a copy of its own, made once per `modules` (a
    memo kept across calls: one module serves them all, as a model's does)."""
    memo = {} if modules is None else modules

    def conv(a):
        if isinstance(a, torch.nn.Module):
            if id(a) not in memo:
                memo[id(a)] = copy.deepcopy(a).to(device, dtype)
            return memo[id(a)]
        return a.to(device, dtype) if a.is_floating_point() else a.to(device)
    return tuple(conv(a) for a in args)


def _double(args: tuple) -> tuple:
    return cast(args, torch.float64)


def default_call(x, mha):  # need_weights=True, the module's default: its explicit [B*H, S, D] path
    out, _ = mha(x, x, x)
    return out


def default_call_padded_causal(x, mha, pad):
    m = torch.nn.Transformer.generate_square_subsequent_mask(x.shape[1], device=x.device, dtype=x.dtype)
    return mha(x, x, x, key_padding_mask=pad, attn_mask=m)[0]


def default_call_cross(x, mem, mha):
    return mha(x, mem, mem, average_attn_weights=False)[0]


CASES = {"plain": self_attention, "causal": causal_self_attention, "padded": padded_self_attention,
         "cross": cross_attention, "weights": default_call, "weights_padded_causal": default_call_padded_causal,
         "weights_cross": default_call_cross}


@pytest.mark.parametrize("name", list(CASES))
def test_multihead_attention_module_transfers_and_matches_fp64(name):
    """At the example's length and at another (the program is generic in the lengths; the batch is held, as
    for every call with module arguments)."""
    fn = CASES[name]
    with torch.no_grad():
        prog = tc.transfer(fn, *_args(name))
        for s in (S, S + 7):
            args64 = _double(_args(name, s))
            assert rel_err(prog.run(*args64), fn(*args64)) < 1e-6


def encoder_layer(x, layer):
    return layer(x)


@pytest.mark.parametrize("norm_first", [False, True])
def test_a_transformer_encoder_layer_transfers_with_its_feed_forward_as_the_epilogue(norm_first):
    """nn.TransformerEncoderLayer: its self-attention (the module above) between norms, residuals and the
    feed-forward block, which the prologue and epilogue leave to PyTorch."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(E, HEADS, 2 * E, dropout=0.0, batch_first=True,
                                             norm_first=norm_first).eval()
    x = _args("plain")[0]
    with torch.no_grad():
        prog = tc.transfer(encoder_layer, x, layer)
        layer64 = copy.deepcopy(layer).double()
        assert rel_err(prog.run(x.double(), layer64), encoder_layer(x.double(), layer64)) < 1e-6


def decoder_layer(x, memory, layer):
    return layer(x, memory)


def test_a_transformer_decoder_layer_transfers_with_its_cross_attention_left_to_pytorch():
    """nn.TransformerDecoderLayer holds two attentions: the kernel takes the first (self-attention), and
    PyTorch computes the cross attention and the feed-forward block after it, as the epilogue."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerDecoderLayer(E, HEADS, 2 * E, dropout=0.0, batch_first=True).eval()
    g = torch.Generator().manual_seed(2)
    x, memory = torch.randn(B, S, E, generator=g), torch.randn(B, S + 9, E, generator=g)
    with torch.no_grad():
        prog = tc.transfer(decoder_layer, x, memory, layer)
        layer64 = copy.deepcopy(layer).double()
        ref = decoder_layer(x.double(), memory.double(), layer64)
        assert rel_err(prog.run(x.double(), memory.double(), layer64), ref) < 1e-6
    assert prog.epilogue  # the cross-attention block and the feed-forward


def test_sdpa_inside_the_module_is_traced_as_plain_ops():
    """Without the second trace the graph holds the CPU backend's fused op, which no rule reads."""
    x, mha = _args("plain")
    bound = {"x": x, "mha": mha}
    cap = capture(self_attention, bound)
    assert not fused_sdpa(cap.graph)
    targets = {str(n.target) for n in cap.graph.graph.nodes if n.op == "call_function"}
    assert any("softmax" in t for t in targets) and any("bmm" in t for t in targets)


def test_dropout_in_training_is_refused():
    x, mha = _args("plain")
    mha = torch.nn.MultiheadAttention(E, HEADS, batch_first=True, dropout=0.5).train()
    with pytest.raises(UnsupportedSpec):
        tc.transfer(self_attention, x, mha)


@pytest.mark.parametrize("name", ["plain", "weights", "weights_padded_causal"])
def test_a_bf16_module_transfers_without_the_math_backends_upcast(name):
    """In bf16 the math backend computes SDPA in float32 (casts to float32 and back in the trace) unless
    reduced-precision reductions are allowed; the second trace allows them. Replayed, those casts met the
    module's float64 weights in verification (out-projection: float32 against float64) and every bf16 call
    of the module was refused."""
    args = cast(_args(name), torch.bfloat16)
    fn = CASES[name]
    with torch.no_grad():
        prog = tc.transfer(fn, *args)
        args64 = _double(args)
        assert rel_err(prog.run(*args64), fn(*args64)) < 1e-6
    assert not torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()  # the flag is put back
