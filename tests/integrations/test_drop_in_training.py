"""A training step through the drop-in: with attn_implementation="cubridge", each attention call of a model in
training mode goes through the custom op and its autograd (on the CPU the op's forward is the interpreter, as a
GPU kernel would be: interpreted_op.py; the backward is the backward runner's), and the loss and every
parameter's gradient match eager's, on a left-padded batch. In float32: eager itself is NaN in float64 there
(a padded query row's fills add to -inf, and its NaN values reach the loss), while float32 has room for them.
Families with a softcap and a sliding window (gemma2), learnable sinks (gpt_oss), q/k norms (qwen3)."""
from __future__ import annotations

import warnings

import pytest
import torch

import torch_cubridge.integrations.transformers as tcx
from interpreted_op import serve_by_op
from tiny_models import pair

FAMILIES = ["llama", "gemma2", "gpt_oss", "qwen3"]
PAD = 5  # left padding: padded query rows are filled whole (finfo.min); the shifted loss reads the last one
TOL = 1e-4  # float32 against float32 eager: a gradient's relative error (float32 rounding, summed otherwise)
FLOOR = 1e-4


@pytest.fixture(scope="module", autouse=True)
def _registered():
    tcx.register()


def _assert_close(got: dict, want: dict, label: str) -> None:
    """Each parameter's gradient within TOL of eager's, relative to its own norm, floored at FLOOR of the
    largest one's: a gradient that is zero in exact arithmetic (a key bias: softmax ignores a shift of every
    key's score by q.b) is rounding noise in both, not a relative error."""
    assert got.keys() == want.keys()
    top = max(float(w.double().norm()) for w in want.values())
    for name, g in got.items():
        w = want[name].double()
        err = float((g.double() - w).norm()) / max(float(w.norm()), FLOOR * top)
        assert err < TOL, f"{label}: {name} gradient off by {err:.2e}"


def _padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(1, 128, (2, 14), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :PAD] = 0
    return ids, mask


def _assert_step_matches(made: list, got: tuple, want: tuple, label: str) -> None:
    """Calls went through the custom op, and the step's loss and gradients are eager's."""
    (got_loss, got_grads), (want_loss, want_grads) = got, want
    assert sum(r.forward_calls for r in made) > 0, "no attention call went through the custom op"
    assert abs(float(got_loss - want_loss)) <= 1e-5 * abs(float(want_loss))
    _assert_close(got_grads, want_grads, label)


def _step(model, ids, mask, labels=None):
    """One training step's loss and gradients (labels: the inputs', padding ignored, unless given)."""
    model.train()
    model.zero_grad()
    labels = ids.masked_fill(mask == 0, -100) if labels is None else labels
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", FAMILIES)
def test_a_training_step_matches_eager(monkeypatch, family):
    made = serve_by_op(monkeypatch)
    tcx.clear_tables()
    ref, ours = pair(family, dtype=torch.float32, attention_dropout=0.0)
    ids, mask = _padded_batch()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = _step(ref, ids, mask)
        got = _step(ours, ids, mask)
    _assert_step_matches(made, got, want, family)


def _seq2seq_pair(family: str, **kw):
    from transformers import AutoConfig, AutoModelForSeq2SeqLM
    models = []
    for impl in ("eager", "cubridge"):
        torch.manual_seed(0)
        cfg = AutoConfig.for_model(family, **kw)
        models.append(AutoModelForSeq2SeqLM.from_config(cfg, attn_implementation=impl, dtype=torch.float32))
    models[1].load_state_dict(models[0].state_dict())
    return models


@pytest.mark.parametrize("family,kw", [
    ("t5", dict(vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, dropout_rate=0.0,
                relative_attention_num_buckets=8, relative_attention_max_distance=16, decoder_start_token_id=0,
                pad_token_id=0)),
])
def test_a_seq2seq_training_step_matches_eager(monkeypatch, family, kw):
    """An encoder-decoder with a learnable relative-position table (T5): the table's gradient comes through
    the backward of the score hook that reads it."""
    made = serve_by_op(monkeypatch)
    tcx.clear_tables()
    ref, ours = _seq2seq_pair(family, **kw)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(1, 128, (2, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0  # right-padded encoder input
    labels = torch.randint(1, 128, (2, 7), generator=g)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want, got = (_step(model, ids, mask, labels) for model in (ref, ours))
    assert any("relative_attention_bias" in n for n in got[1])
    _assert_step_matches(made, got, want, family)


def test_a_masked_lm_training_step_matches_eager(monkeypatch):
    """BERT: a bidirectional padding mask, whose padded query rows still see every real key."""
    from transformers import AutoConfig, BertForMaskedLM
    made = serve_by_op(monkeypatch)
    tcx.clear_tables()
    models = []
    for impl in ("eager", "cubridge"):
        torch.manual_seed(0)
        cfg = AutoConfig.for_model("bert", vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        models.append(BertForMaskedLM._from_config(cfg, attn_implementation=impl, dtype=torch.float32))
    models[1].load_state_dict(models[0].state_dict())
    ids = torch.randint(1, 128, (2, 12), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[0, -4:] = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want, got = (_step(m, ids, mask) for m in models)
    _assert_step_matches(made, got, want, "bert")


@pytest.mark.parametrize("how", ["checkpointing", "compiled"])
def test_a_training_step_under_checkpointing_or_torch_compile(monkeypatch, how):
    """model.gradient_checkpointing_enable() (each layer's forward recomputed in the backward, through the op
    again) and torch.compile(model) (the op and its autograd inside dynamo's graph): the same step as eager."""
    made = serve_by_op(monkeypatch)
    tcx.clear_tables()
    ref, ours = pair("llama", dtype=torch.float32, attention_dropout=0.0)
    ids, mask = _padded_batch()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = _step(ref, ids, mask)
        with torch.no_grad():
            ours.train()(input_ids=ids, attention_mask=mask)  # compiles the attention before any trace
        if how == "checkpointing":
            ours.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            got = _step(ours, ids, mask)
        else:
            torch._dynamo.reset()
            loss, grads = _step(torch.compile(ours), ids, mask)
            got = loss, {n.removeprefix("_orig_mod."): g for n, g in grads.items()}
    _assert_step_matches(made, got, want, f"llama {how}")
