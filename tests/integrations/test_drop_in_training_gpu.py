"""GPU: a bf16 training step through the drop-in (attn_implementation="cubridge"), the attention's forward and
backward on the kernels, against the same step of eager in float32 from the same weights. Ours must be as
close to it as eager in bf16 is (x1.5, plus a small floor): the loss, all gradients together, and each
parameter's gradient (x3 there, a single parameter's bf16 error being noisier). Every backward is the backward
kernel's, left-padded too (its padded query rows hold finfo.min on every key: a uniform softmax whose LSE is
the fill), and where the score reads a learnable tensor (T5's position bias) too."""
from __future__ import annotations

import collections
import warnings

import pytest
import torch

import torch_cubridge.integrations.transformers as tcx
from torch_cubridge.ops import backward_runner
from tiny_models import build

pytestmark = pytest.mark.gpu
FAMILIES = ["llama", "gemma2", "gpt_oss", "qwen3"]
SIZE = dict(hidden_size=256, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
            attention_dropout=0.0)
# gpt_oss routes each token to both of its two experts: with top-1 routing a near tie sends a token to another
# expert in bf16 than in float32, a jump in its gradient that eager in bf16 makes at other tokens
OVERRIDES = {"gpt_oss": dict(num_experts_per_tok=2)}
B, S, PAD = 2, 160, 37


@pytest.fixture(scope="module", autouse=True)
def _registered():
    tcx.register()


def _batch(padded: bool) -> dict[str, torch.Tensor]:
    ids = torch.randint(1, 128, (B, S), generator=torch.Generator().manual_seed(4)).cuda()
    mask = torch.ones_like(ids)
    if padded:
        mask[0, :PAD] = 0
    return dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))


def _step(model, inputs: dict[str, torch.Tensor]) -> tuple[float, dict[str, torch.Tensor]]:
    """One training step's loss and every parameter's gradient; floating inputs in the model's dtype."""
    model.train()
    model.zero_grad()
    out = model(**{k: (v.to(model.dtype) if v.is_floating_point() else v) for k, v in inputs.items()})
    out.loss.backward()
    return float(out.loss), {n: p.grad.double() for n, p in model.named_parameters() if p.grad is not None}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _backward_served() -> collections.Counter:
    return sum((r.served for r in backward_runner._RUNNERS.values()), start=collections.Counter())


def _backward_reasons() -> set[str]:
    """Why the kernel does not serve a program's backward, for every program that has one."""
    return {why for r in backward_runner._RUNNERS.values() for why in r._why.values()}


def _forward_served(model) -> collections.Counter:
    """Who served the attention forwards of `model`'s modules."""
    return sum((c.served for m, c in tcx.table_items() if any(m is x for x in model.modules())),
               start=collections.Counter())


def _assert_as_close_as_eager16(family: str, got: tuple, eager16: tuple, want: tuple) -> None:
    """Ours (bf16) against float32 eager, as close as eager in bf16 is: the loss and all gradients together
    (x1.5 plus a small floor), and each parameter's gradient (x3 plus a floor)."""
    (loss, grads), (loss16, grads16), (loss32, grads32) = got, eager16, want
    assert abs(loss - loss32) <= 1.5 * abs(loss16 - loss32) + 2e-3 * abs(loss32), (loss, loss16, loss32)
    assert grads.keys() == grads32.keys()
    flat = [torch.cat([g[n].flatten() for n in grads32]) for g in (grads, grads16, grads32)]
    assert _rel(flat[0], flat[2]) <= 1.5 * _rel(flat[1], flat[2]) + 1e-3, (_rel(flat[0], flat[2]),
                                                                           _rel(flat[1], flat[2]))
    top = max(float(g.norm()) for g in grads32.values())
    for n, w in grads32.items():
        floor = 1e-2 * max(float(w.norm()), 1e-2 * top)
        err, err16 = float((grads[n] - w).norm()), float((grads16[n] - w).norm())
        assert err <= 3 * err16 + floor, f"{family}: {n} off by {err:.3e} (eager bf16 {err16:.3e})"


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left-padded"])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_bf16_training_step_on_the_kernels_is_as_close_to_float32_as_eager(family, padded):
    tcx.clear_tables()
    kw = {**SIZE, **OVERRIDES.get(family, {})}
    ref = build(family, "eager", torch.float32, "cuda", **kw)
    base = build(family, "eager", torch.bfloat16, "cuda", **kw)
    ours = build(family, "cubridge", torch.bfloat16, "cuda", **kw)
    base.load_state_dict(ref.state_dict())
    ours.load_state_dict(ref.state_dict())
    inputs = _batch(padded)
    before = _backward_served()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want, eager16, got = (_step(m, inputs) for m in (ref, base, ours))
    served = _backward_served() - before
    fwd = _forward_served(ours)
    assert fwd["kernel"] > 0 and fwd["spec"] == 0, fwd
    assert sum(served.values()) == fwd["kernel"], (served, fwd)  # every kernel forward had its backward
    assert served == {"kernel": fwd["kernel"]}, (served, _backward_reasons())
    _assert_as_close_as_eager16(family, got, eager16, want)


def _encoder_models(family: str) -> tuple[type, dict]:
    """The model class and tiny config of an encoder or encoder-decoder family: T5 (a learnable
    relative-position table the self-attention scores read), whisper (audio features in, an encoder without a
    mask), bert (a bidirectional padding mask)."""
    from transformers import BertForMaskedLM, T5ForConditionalGeneration, WhisperForConditionalGeneration
    if family == "t5":
        return T5ForConditionalGeneration, dict(vocab_size=128, d_model=256, d_kv=64, d_ff=256, num_layers=2,
                                                num_heads=4, dropout_rate=0.0, relative_attention_num_buckets=8,
                                                relative_attention_max_distance=32, decoder_start_token_id=0,
                                                pad_token_id=0)
    if family == "whisper":
        return WhisperForConditionalGeneration, dict(vocab_size=128, d_model=256, encoder_layers=2, decoder_layers=2,
                                                     encoder_attention_heads=4, decoder_attention_heads=4,
                                                     encoder_ffn_dim=256, decoder_ffn_dim=256, num_mel_bins=16,
                                                     max_source_positions=80, max_target_positions=64,
                                                     dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                                                     decoder_start_token_id=1, pad_token_id=0, eos_token_id=2,
                                                     bos_token_id=1, suppress_tokens=None, begin_suppress_tokens=None)
    return BertForMaskedLM, dict(vocab_size=128, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
                                 num_attention_heads=4, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def _encoder_batch(family: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, 128, (B, S), generator=g).cuda()
    labels = torch.randint(3, 128, (B, 40), generator=g).cuda()
    if family == "whisper":  # two mel frames per encoder position (its stride-2 convolution)
        return dict(input_features=torch.randn(B, 16, 160, generator=g).cuda(), labels=labels)
    mask = torch.ones_like(ids)
    mask[1, -PAD:] = 0  # right padding: the padded keys masked for every query, their query rows kept
    if family == "bert":
        return dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
    return dict(input_ids=ids, attention_mask=mask, labels=labels)


@pytest.mark.parametrize("family", ["t5", "whisper", "bert"])
def test_a_bf16_training_step_of_an_encoder_family_is_as_close_to_float32_as_eager(family):
    """The same check for the encoder and encoder-decoder families: every attention forward on the kernel, each
    with its backward on the kernel; T5's self-attention reads its learnable table (through the position bias),
    whose gradient the backward kernel gives and is checked with the rest."""
    from transformers import AutoConfig
    tcx.clear_tables()
    cls, kw = _encoder_models(family)
    models = []
    for impl, dtype in (("eager", torch.float32), ("eager", torch.bfloat16), ("cubridge", torch.bfloat16)):
        torch.manual_seed(0)
        cfg = AutoConfig.for_model(family, **kw)
        models.append(cls._from_config(cfg, attn_implementation=impl, dtype=dtype).cuda())
    for m in models[1:]:
        m.load_state_dict(models[0].state_dict())
    inputs = _encoder_batch(family)
    before = _backward_served()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want, eager16, got = (_step(m, inputs) for m in models)
    served = _backward_served() - before
    fwd = _forward_served(models[2])
    assert fwd["kernel"] > 0 and fwd["spec"] == 0, fwd
    assert sum(served.values()) == fwd["kernel"], (served, fwd)
    assert served == {"kernel": fwd["kernel"]}, (served, _backward_reasons())
    if family == "t5":  # the table's gradient, through the bias the kernel's learnable sites differentiate
        assert any("relative_attention_bias" in n for n in got[1])
    _assert_as_close_as_eager16(family, got, eager16, want)


@pytest.mark.parametrize("how", ["checkpointing", "compiled"])
def test_a_bf16_training_step_under_checkpointing_or_torch_compile_is_on_the_kernels(how):
    """model.gradient_checkpointing_enable() (each layer's forward run again in the backward, through the op)
    and torch.compile(model) (the op and its autograd inside dynamo's graph), left-padded: every backward is
    the kernel's, and the step is as close to float32 eager as eager in bf16 is."""
    tcx.clear_tables()
    ref = build("llama", "eager", torch.float32, "cuda", **SIZE)
    base = build("llama", "eager", torch.bfloat16, "cuda", **SIZE)
    ours = build("llama", "cubridge", torch.bfloat16, "cuda", **SIZE)
    base.load_state_dict(ref.state_dict())
    ours.load_state_dict(ref.state_dict())
    inputs = _batch(True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want, eager16 = _step(ref, inputs), _step(base, inputs)
        with torch.no_grad():  # compiles the attention before any trace
            ours.train()(**{k: v for k, v in inputs.items() if k != "labels"})
        before = _backward_served()
        if how == "checkpointing":
            ours.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            got = _step(ours, inputs)
        else:
            torch._dynamo.reset()
            loss, grads = _step(torch.compile(ours), inputs)
            got = loss, {n.removeprefix("_orig_mod."): g for n, g in grads.items()}
    served = _backward_served() - before
    assert served and served == {"kernel": served["kernel"]}, (served, _backward_reasons())
    _assert_as_close_as_eager16(f"llama {how}", got, eager16, want)
