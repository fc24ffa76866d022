"""Ops after the attention output (transfer/epilogue.py): PyTorch runs the spec's own ops on the kernel's
output. Each spec transfers with its epilogue, matches float64 at lengths other than the capture's, and
a result that reads the probabilities is refused with that reason."""
import pytest
import torch

import epilogue_specs as es
import torch_cubridge as tc
from helpers import rel_err, serve_through_program
from torch_cubridge.ir.program import Program


def _to64(args):
    return tuple(a.double() if isinstance(a, (torch.Tensor, torch.nn.Module)) else a for a in args)


def _check(fn, make, lengths):
    prog = tc.transfer(fn, *make(lengths[0]))
    assert prog.epilogue, str(prog)
    for S in lengths:
        args = make(S)
        with torch.no_grad():
            got = prog.run(*args)
            ref = fn(*_to64(args))
        _to64(args)  # (a module converted for the reference is converted back below)
        for a in args:
            if isinstance(a, torch.nn.Module):
                a.float()
        assert got.shape == ref.shape and rel_err(got, ref) < 1e-5, (S, rel_err(got, ref))
    return prog


def test_gate_on_the_output():
    gate = {}
    prog = _check(es.gated_output, lambda S: es.qkv(2, 4, S, 16) + (gate.setdefault(S, torch.randn(2, 4, S, 16)),),
                  (33, 50, 7))
    assert [s.op for s in prog.epilogue][-1] == "aten.mul.Tensor"


def test_scale_and_shift_is_generic_in_the_length():
    prog = _check(es.scale_shift, lambda S: es.qkv(2, 4, S, 16), (33, 50, 7))
    assert "Sq" not in dict(prog.requires)


def test_heads_merged_and_projected():
    w = es.weights(64, 1)[0]
    prog = _check(es.merged_and_projected, lambda S: es.qkv(2, 4, S, 16) + (w,), (40, 17, 90))
    assert not {"Sq", "Skv"} & set(dict(prog.requires))  # the epilogue's reshape is fitted to the length


def test_decode_step_merged_and_projected_over_a_growing_cache():
    w = es.weights(64, 1)[0]
    q = torch.randn(2, 4, 1, 16)
    prog = _check(es.decode_projected, lambda S: (q,) + es.qkv(2, 4, S, 16)[1:] + (w,), (40, 17, 90))
    assert dict(prog.requires).get("Sq") == 1 and "Skv" not in dict(prog.requires)


def test_rows_all_masked_before_a_layer_norm(monkeypatch):
    """Verification's structured masks leave rows with every key masked: NaN in the spec, and what the
    epilogue makes of the kernel's zero rows in the program; the rest must match."""
    serve_through_program(monkeypatch)  # the value compared is the program's
    w = es.weights(64, 1)[0]
    mask = torch.zeros(2, 1, 40, 40)
    mask[:, :, 5] = float("-inf")
    f = tc.compile(es.masked_projected_normed, fallback="raise")
    args = es.qkv(2, 4, 40, 16) + (mask, w)
    got = f(*args)
    ref = es.masked_projected_normed(*_to64(args))
    assert torch.isnan(ref[:, 5]).all() and not torch.isnan(ref[:, 4]).any()
    keep = torch.arange(40) != 5
    assert rel_err(got[:, keep], ref[:, keep]) < 1e-5
    assert f.served == {"kernel": 1} and f.entries()[0].result is not None


def test_a_tuple_result_beside_the_projected_output():
    """The output is the epilogue's, the weights are served as None (as a tuple result without an
    epilogue serves them), a value off the score path is the spec's own."""
    w, bias = es.weights(64, 1)[0], torch.randn(64)
    args = es.qkv(2, 4, 40, 16) + (w, bias)
    prog = tc.transfer(es.projected_with_weights, *args)
    assert (prog.out.tuple_len, prog.out.index) == (3, 0)
    for S in (40, 23):
        args = es.qkv(2, 4, S, 16) + (w, bias)
        got = prog.run(*args)
        ref = es.projected_with_weights(*_to64(args))
        assert len(got) == 3 and got[1] is None
        assert rel_err(got[0], ref[0]) < 1e-5 and torch.equal(got[2], bias * 2)


def test_a_spec_taking_star_args(monkeypatch):
    serve_through_program(monkeypatch)
    w = es.weights(64, 1)[0]
    f = tc.compile(es.through_star_args, fallback="raise")
    args = es.qkv(2, 4, 40, 16) + (w,)
    assert rel_err(f(*args), es.merged_and_projected(*_to64(args))) < 1e-5
    assert f.served == {"kernel": 1} and f.entries()[0].result is not None  # the program served it


def test_whole_attention_with_projections_in_and_out():
    ws = es.weights(64, 4)
    prog = _check(es.separate_projections, lambda T: (es.hidden(2, T, 64),) + ws, (40, 17, 90))
    assert prog.q.step and prog.k.step and prog.v.step  # q, k and v made by the prologue from x
    assert not {"Sq", "Skv"} & set(dict(prog.requires))


def test_nanogpt_attention_module():
    torch.manual_seed(0)
    m = es.CausalSelfAttention()
    prog = _check(es.nanogpt_forward, lambda T: (m, es.hidden(2, T, 64)), (40, 17, 90))
    assert prog.mask is not None  # is_causal became the kernel's mask, not PyTorch's
    assert any("c_proj" in str(s.args) for s in prog.epilogue)


def test_a_result_that_reads_the_probabilities_is_refused():
    with pytest.raises(tc.UnsupportedSpec, match="probabilities apart from the attention output"):
        tc.transfer(es.reads_probs_after, *es.qkv(2, 4, 30, 16))


def test_epilogue_round_trips_through_json():
    w = es.weights(64, 1)[0]
    prog = tc.transfer(es.merged_and_projected, *es.qkv(2, 4, 40, 16), w)
    back = Program.from_json(prog.to_json())
    assert back == prog
    args = es.qkv(2, 4, 23, 16) + (w,)
    assert rel_err(back.run(*args), es.merged_and_projected(*_to64(args))) < 1e-5


def test_compiled_function_serves_the_epilogue_spec_on_the_cpu():
    """On the CPU the spec serves; the program is transferred and verified all the same."""
    ws = es.weights(64, 4)
    f = tc.compile(es.separate_projections, fallback="silent")
    x = es.hidden(2, 40, 64)
    assert torch.equal(f(x, *ws), es.separate_projections(x, *ws)) and f.served == {"spec": 1}
    e = f.entries()[-1]
    assert e.result is not None and e.result.program.epilogue and e.result.report.ok
    # what a kernel would serve: the verified program, against the spec in float64
    assert rel_err(e.result.program.run(x, *ws), es.separate_projections(*_to64((x,) + ws))) < 1e-5


def _image_output(q, k, v):
    """The output viewed back onto the image ([B, rows, cols, H*D]): the query axis split in two, a layout
    no output names, so the views go to the epilogue."""
    B, H, S, D = q.shape
    o = torch.softmax(q @ k.transpose(-1, -2) * D ** -0.5, -1) @ v
    return o.view(B, H, 4, S // 4, D).permute(0, 2, 3, 1, 4).reshape(B, 4, S // 4, H * D)


def test_an_output_viewed_back_onto_the_image_takes_its_views_as_the_epilogue():
    def make(S):
        g = torch.Generator().manual_seed(S)
        return tuple(torch.randn(2, 3, S, 16, generator=g) for _ in range(3))
    _check(_image_output, make, [20])  # the views hold the image size: the program is guarded to it


def test_vitdet_attention_transfers_with_its_image_views_in_the_epilogue():
    """transformers' ViTDet attention (no relative positions): its output is reshaped onto the image grid."""
    from transformers import VitDetConfig
    from transformers.models.vitdet.modeling_vitdet import VitDetAttention
    torch.manual_seed(0)
    cfg = VitDetConfig(hidden_size=64, num_attention_heads=4, use_relative_position_embeddings=False)
    mod = VitDetAttention(cfg, input_size=(4, 5)).eval()

    def spec(m, x):
        return m(x)[0]
    x = torch.randn(2, 4, 5, 64)
    prog = tc.transfer(spec, mod, x)
    assert prog.epilogue
    with torch.no_grad():
        assert rel_err(prog.run(mod, x), spec(mod.double(), x.double())) < 1e-5
