"""On a CUDA device: nn.MultiheadAttention and the Transformer layers as specs (tests/transfer/test_multihead_attention.py
transfers them on the CPU), each call served by the kernel in bf16 and held to the same module in float64 on
the CPU, a separate copy, so the kernel is never compared with itself."""
import warnings

import pytest
import torch

import torch_cubridge as tc
from helpers import rel_err
from test_multihead_attention import CASES, E, HEADS, _args, cast, decoder_layer, encoder_layer

pytestmark = pytest.mark.gpu

TOL = 2e-2  # bf16 operands and projections


def _served(f, fn, calls: list) -> None:
    """Every call by the kernel and within bf16 of the float64 module."""
    ours, ref64 = {}, {}
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for args in calls:
            got = f(*cast(args, torch.bfloat16, "cuda", ours)).double().cpu()
            ref = fn(*cast(args, torch.float64, "cpu", ref64))
            assert rel_err(got, ref) < TOL, rel_err(got, ref)
    assert f.served["spec"] == 0 and f.served["kernel"] == len(calls), \
        (f.served, [e.reasons or e.reason for e in f.entries()])


@pytest.mark.parametrize("name", list(CASES))
def test_multihead_attention_module_is_served_by_the_kernel(name):
    """Seven call forms (need_weights off and on, causal, key padding, cross), at the first call's length and
    at a longer one."""
    fn = CASES[name]
    first, longer = _args(name, 40), _args(name, 200)
    mha = first[-2] if name in ("padded", "weights_padded_causal") else first[-1]
    longer = tuple(mha if isinstance(a, torch.nn.Module) else a for a in longer)  # one module, as in a model
    _served(tc.compile(fn, fallback="raise"), fn, [first, longer])


@pytest.mark.parametrize("norm_first", [False, True])
def test_transformer_encoder_layer_is_served_by_the_kernel(norm_first):
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(E, HEADS, 2 * E, dropout=0.0, batch_first=True,
                                             norm_first=norm_first).eval()
    xs = [_args("plain", s)[0] for s in (40, 130)]
    _served(tc.compile(encoder_layer, fallback="raise"), encoder_layer, [(x, layer) for x in xs])


def test_transformer_decoder_layer_is_served_by_the_kernel():
    torch.manual_seed(0)
    layer = torch.nn.TransformerDecoderLayer(E, HEADS, 2 * E, dropout=0.0, batch_first=True).eval()
    g = torch.Generator().manual_seed(2)
    calls = [(torch.randn(2, s, E, generator=g), torch.randn(2, s + 9, E, generator=g), layer) for s in (40, 96)]
    _served(tc.compile(decoder_layer, fallback="raise"), decoder_layer, calls)
