"""On a CUDA device: specs with ops after the attention output (and projections before it) served by
the kernel, the epilogue run by PyTorch on its output, against float64."""
import copy

import pytest
import torch

import epilogue_specs as es
import torch_cubridge as tc
from helpers import rel_err

pytestmark = pytest.mark.gpu


def _serve(fn, args):
    f = tc.compile(fn, fallback="raise")
    cuda = tuple(a.cuda() if isinstance(a, (torch.Tensor, torch.nn.Module)) else a for a in args)
    with torch.no_grad():
        out = f(*cuda)
    assert f.served["spec"] == 0, [e.reasons or e.reason for e in f.entries()]
    with torch.no_grad():
        # a module's .double() converts it in place: the reference takes a copy, so the next call's module is unchanged
        ref = fn(*(copy.deepcopy(a).cpu().double() if isinstance(a, (torch.Tensor, torch.nn.Module)) else a
                   for a in cuda))
    assert rel_err(out.float().cpu(), ref) < 1e-2
    return f


def test_merged_and_projected():
    w = es.weights(64 * 2, 1, torch.bfloat16)[0]
    _serve(es.merged_and_projected, es.qkv(2, 2, 333, 64, torch.bfloat16) + (w,))


@pytest.mark.parametrize("Sq", [1, 4])
def test_decode_step_projected(Sq):
    """The decode kernel's output through the epilogue."""
    q, k, v = es.qkv(2, 4, 500, 64, torch.bfloat16)
    w = es.weights(64 * 4, 1, torch.bfloat16)[0]
    f = _serve(es.decode_projected, (q[:, :, :Sq].contiguous(), k, v, w))
    assert f.kernels()[-1].p.epilogue


def test_one_token_prompt_projected():
    """Sq = Skv = 1 (a one-token prompt without a cache), heads merged and projected: served by a kernel."""
    w = es.weights(64 * 4, 1, torch.bfloat16)[0]
    _serve(es.merged_and_projected, es.qkv(2, 4, 1, 64, torch.bfloat16) + (w,))


def test_gate_and_scale_shift():
    args = es.qkv(2, 4, 200, 64, torch.bfloat16)
    _serve(es.gated_output, args + (torch.randn(2, 4, 200, 64, dtype=torch.bfloat16),))
    _serve(es.scale_shift, args)


def test_nanogpt_attention_module_in_bf16():
    torch.manual_seed(0)
    m = es.CausalSelfAttention(256, 4).to(torch.bfloat16)
    f = _serve(es.nanogpt_forward, (m, es.hidden(2, 300, 256, torch.bfloat16)))
    _serve(es.nanogpt_forward, (m, es.hidden(2, 77, 256, torch.bfloat16)))  # a new compile, same spec
    assert f.kernels()[-1].p.epilogue


def test_masked_projected_and_layer_normed():
    """An additive mask and a LayerNorm after the projection (BERT-style blocks): verification's masks
    with whole rows masked are judged by rows, and the served call matches fp64."""
    q, k, v = es.qkv(2, 4, 300, 64, torch.bfloat16)
    mask = torch.zeros(2, 1, 300, 300, dtype=torch.bfloat16)
    mask[..., 250:] = -1e4  # the last keys masked for every query (padding)
    _serve(es.masked_projected_normed, (q, k, v, mask, es.weights(256, 1, torch.bfloat16)[0]))


def test_tuple_result_with_weights_and_a_bias():
    """A module-style result (output, weights, bias): the kernel serves the output through the epilogue,
    the weights are None, the bias is the spec's own."""
    q, k, v = es.qkv(2, 4, 200, 64, torch.bfloat16)
    w, bias = es.weights(256, 1, torch.bfloat16)[0], torch.randn(256, dtype=torch.bfloat16)
    f = tc.compile(es.projected_with_weights, fallback="raise")
    with torch.no_grad():
        out, weights, b2 = f(q.cuda(), k.cuda(), v.cuda(), w.cuda(), bias.cuda())
    ref = es.projected_with_weights(*(a.double() for a in (q, k, v, w, bias)))
    assert f.served["kernel"] == 1 and weights is None
    assert rel_err(out.float().cpu(), ref[0]) < 1e-2 and torch.equal(b2.cpu(), bias * 2)


def test_an_output_viewed_back_onto_the_image():
    """ViTDet's and SAM's layout: the output reshaped onto the image grid, its views the epilogue's."""
    from transformers import VitDetConfig
    from transformers.models.vitdet.modeling_vitdet import VitDetAttention
    torch.manual_seed(0)
    cfg = VitDetConfig(hidden_size=128, num_attention_heads=2, use_relative_position_embeddings=False)
    mod = VitDetAttention(cfg, input_size=(14, 14)).eval().to(torch.bfloat16)

    def spec(m, x):
        return m(x)[0]
    f = _serve(spec, (mod, torch.randn(2, 14, 14, 128, dtype=torch.bfloat16)))
    assert f.kernels()[-1].p.epilogue
