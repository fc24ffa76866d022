"""Tiny transformers models for "eager vs cubridge" comparisons, each built from its own config.

Two models built from one config object share its attention implementation (it lives on the config),
so an "eager vs ours" test built that way compares ours with ours. build() refuses that.
"""
from __future__ import annotations

import torch

FAMILIES = {  # sliding windows shorter than the test sequences, so the window bites
    "llama": {},
    "mistral": {"sliding_window": 8},
    "qwen2": {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
    "qwen3": {},
    "gemma2": {"sliding_window": 8, "attn_logit_softcapping": 20.0},
    "gemma3_text": {"sliding_window": 8, "sliding_window_pattern": 2},
    "gpt_oss": {"sliding_window": 8, "num_local_experts": 2, "num_experts_per_tok": 1},
}
# more families, other attention code: parallel blocks (cohere, gpt_neox), partial rotary (phi3, gpt_neox),
# learned positions (gpt2, opt), biases on q/k/v (starcoder2). (bloom's ALiBi attention is its own code in
# transformers 5.x: attn_implementation does not reach it)
MORE_FAMILIES = {"cohere": {}, "gpt_neox": {}, "starcoder2": {}, "gpt2": {}, "opt": {},
                 "phi3": {"pad_token_id": None, "bos_token_id": None, "eos_token_id": None},
                 # multi-head latent attention: q/k head dim 48 (32 + 16 rotary), value head dim 32
                 "deepseek_v3": dict(q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16,
                                     v_head_dim=32, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
                                     topk_group=1, moe_intermediate_size=32, first_k_dense_replace=1,
                                     num_key_value_heads=4, pad_token_id=None, bos_token_id=None,
                                     eos_token_id=None)}


def config(family: str, layers: int = 2, **overrides):
    """A new config of a tiny model of this family (never shared with another model)."""
    from transformers import AutoConfig
    kw = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
    kw.update({**FAMILIES, **MORE_FAMILIES}[family])
    kw.update(overrides)
    return AutoConfig.for_model(family, **kw)


def build(family: str, impl: str, dtype: torch.dtype = torch.float32, device: str = "cpu", layers: int = 2,
          seed: int = 0, **overrides) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    cfg = config(family, layers, **overrides)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=impl, dtype=dtype).to(device).eval()
    assert model.config._attn_implementation == impl
    return model


def pair(family: str, dtype: torch.dtype = torch.float32, device: str = "cpu", layers: int = 2, **overrides):
    """(eager model, cubridge model) with the same weights and separate configs."""
    ref = build(family, "eager", dtype, device, layers, **overrides)
    ours = build(family, "cubridge", dtype, device, layers, **overrides)
    ours.load_state_dict(ref.state_dict())
    assert ref.config is not ours.config and ref.config._attn_implementation == "eager"
    return ref, ours


def step_logits(model, ids, mask, steps: int = 4) -> list[torch.Tensor]:
    """Prefill and every decode step of greedy generation: one logits tensor per step."""
    out = model.generate(ids, attention_mask=mask, max_new_tokens=steps, do_sample=False, output_logits=True,
                         return_dict_in_generate=True, pad_token_id=0)
    return [x.float() for x in out.logits]


def forced_step_logits(model, ids, mask, tokens: torch.Tensor) -> list[torch.Tensor]:
    """Prefill, then one decode step per forced token (teacher forcing): both models see the same
    tokens, so a near-tied greedy choice cannot make them decode different sequences."""
    from transformers import DynamicCache
    cache = DynamicCache()
    out = model(ids, attention_mask=mask, past_key_values=cache, use_cache=True)
    logits = [out.logits[:, -1].float()]
    for t in range(tokens.shape[1] - 1):
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        out = model(tokens[:, t:t + 1], attention_mask=mask, past_key_values=out.past_key_values, use_cache=True)
        logits.append(out.logits[:, -1].float())
    return logits


def greedy_tokens(model, ids, mask, steps: int) -> torch.Tensor:
    out = model.generate(ids, attention_mask=mask, max_new_tokens=steps, do_sample=False, pad_token_id=0)
    return out[:, ids.shape[1]:]


def inputs(B: int = 2, S: int = 21, pad: int = 5, device: str = "cpu"):
    ids = torch.randint(1, 128, (B, S), generator=torch.Generator().manual_seed(1)).to(device)
    mask = torch.ones_like(ids)
    mask[0, :pad] = 0  # a left-padded batch
    return ids, mask


def small_paged_cache() -> dict:
    """generate_batch's keyword for a small paged cache: by default it takes 90% of free memory (the host's on
    the CPU: a 15 GB cache and attention mask, every call's spec run over all of it). Empty for a transformers
    without the config; transformers 5.17 checks a given size against device memory (MemoryError on the CPU)."""
    try:
        from transformers.generation.configuration_utils import ContinuousBatchingConfig
    except ImportError:
        return {}
    return {"continuous_batching_config": ContinuousBatchingConfig(num_blocks=64, max_batch_tokens=512)}
