"""A causal fill of finfo.min with a finite padding term added after it (GPT-2's eager attention over a KV cache,
left padded) is not a mask: on a row whose causally kept keys are all padded, the padding brings them level with
the causally filled keys, and the spec's softmax spreads over both. The fill stays in the score, exactly."""
import torch

import torch_cubridge as tc
from corpus.layout_styles import gpt2_cached_eager, gpt2_cached_eager_4d, _gpt2_cached, _gpt2_cached_4d, GPT2_KEYS
from helpers import first, rel_err, to64
from torch_cubridge.ir.expr import call, const, load, var
from torch_cubridge.transfer.masks import extract_mask

MIN = torch.finfo(torch.float32).min


def test_a_finite_fill_under_an_added_finite_term_is_no_mask():
    causal = call("le", var("kv"), var("q"))
    pad = call("mul", call("sub", const(1.0), load("pad", var("b"), var("kv"))), const(MIN))
    written = call("add", call("where", causal, var("s"), const(MIN)), pad)
    score, mask, _ = extract_mask(written)
    assert mask is None and score == written
    # an -inf fill stays -inf whatever finite term is added: still a mask
    score, mask, empty = extract_mask(call("add", call("where", causal, var("s"), const(-float("inf"))), pad))
    assert mask == causal and empty == "zero" and score == call("add", var("s"), pad)


def _left_padded(args, n_kept):
    """Every sequence padded on the left up to its last n_kept keys: rows whose causal keys are all padded."""
    *qkv_, _ = args
    return tuple(qkv_) + ((torch.arange(GPT2_KEYS)[None, :] >= GPT2_KEYS - n_kept).long().expand(2, -1),)


def test_gpt2_over_a_left_padded_cache_matches_the_spec_on_fully_padded_rows():
    torch.manual_seed(0)
    prog = tc.transfer(gpt2_cached_eager, *_gpt2_cached(2, 4, 4, 0, 64, torch.float32))
    for n_kept in (0, 5, 30, GPT2_KEYS):
        args = _left_padded(_gpt2_cached(2, 4, 4, 0, 64, torch.float32), n_kept)
        assert rel_err(first(prog.run(*args)), first(gpt2_cached_eager(*to64(args)))) < 2e-5, n_kept


def test_gpt2_with_the_models_4d_mask_matches_the_spec():
    torch.manual_seed(0)
    prog = tc.transfer(gpt2_cached_eager_4d, *_gpt2_cached_4d(2, 4, 4, 0, 64, torch.float32))
    args = _gpt2_cached_4d(2, 4, 4, 0, 64, torch.float32)
    i = torch.arange(args[0].shape[-2])[:, None] + GPT2_KEYS - args[0].shape[-2]
    pad = torch.arange(GPT2_KEYS) >= GPT2_KEYS - 5  # rows with no unpadded key left to them
    keep = (torch.arange(GPT2_KEYS)[None, :] <= i) & pad
    args = args[:3] + (torch.zeros(keep.shape).masked_fill(~keep, MIN).expand(2, 1, -1, -1),)
    assert rel_err(first(prog.run(*args)), first(gpt2_cached_eager_4d(*to64(args)))) < 2e-5
