"""Which transformers families' attention calls the drop-in transfers and verifies (CPU is enough).

Each family is built tiny from its own config with attn_implementation="cubridge" and runs one prefill;
every attention call goes through @torch_cubridge.compile (capture, transfer, fp64 verification). A
family is "no-tiny" when the generic tiny config does not build or eager itself fails with it (not counted);
"ok" when its calls reached the drop-in and none was refused; "refused" prints the first reason;
"bypassed": no call reached the drop-in (before own_attention.py, the models with attention code of their
own; now their attention modules are routed through their compiled forward and counted); "error" is a failure of the model itself (a model with its own table of attention
classes raises for a name it does not know).

Usage: python benchmarks/survey_transformers.py [family ...]   (default: the list below)
       python benchmarks/survey_transformers.py --all            (every causal-LM family of this transformers;
                                                                  60 s a family at most)
"""
from __future__ import annotations

import signal
import sys
import warnings

import torch

FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "gpt_oss", "olmo2", "cohere",
            "gpt_neox", "stablelm", "starcoder2", "granite", "helium", "exaone4", "ernie4_5", "seed_oss", "arcee",
            "apertus", "phi3", "glm", "smollm3", "qwen3_moe", "mixtral", "minimax", "hunyuan_v1_dense", "lfm2",
            "bloom", "mpt", "gpt2", "opt", "llama4_text", "falcon", "git", "xglm", "openai-gpt", "gpt_neox_japanese",
            "cpmant"]


def survey(family: str) -> tuple[str, str]:
    import torch_cubridge.integrations.transformers as tcx
    from transformers import AutoConfig, AutoModelForCausalLM
    kw = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=256, pad_token_id=None,
              bos_token_id=None, eos_token_id=None)
    try:
        try:
            cfg = AutoConfig.for_model(family, **kw)
        except AttributeError:  # a config whose head_dim is derived (falcon)
            kw.pop("head_dim")
            cfg = AutoConfig.for_model(family, **kw)
    except Exception as e:  # noqa: BLE001
        return "no-tiny", f"this generic tiny config does not fit the family ({type(e).__name__}: {str(e)[:80]})"
    ids = torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(0))
    try:  # eager first: a family the tiny config breaks is not ours to count
        torch.manual_seed(0)
        with torch.no_grad():
            AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()(ids, use_cache=False)
    except Exception as e:  # noqa: BLE001
        return "no-tiny", f"eager fails with this tiny config too ({type(e).__name__}: {str(e)[:80]})"
    try:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation=tcx.NAME).eval()
        with torch.no_grad():
            model(ids, use_cache=False)  # a prefill: a cache object would keep own-attention modules on their code
    except Exception as e:  # noqa: BLE001  (eager ran, so this failure is the drop-in's or the model's table)
        return "error", f"{type(e).__name__}: {str(e)[:120]}"
    # a model whose attention code is its own has its attention modules routed at the first call
    # (integrations/own_attention.py): their compiled forwards count too
    from torch_cubridge.integrations import own_attention as oa
    tables = tcx.tables() + oa.tables()
    calls = sum(sum(c.served.values()) for c in tables)
    reasons = [e.reason for c in tables for e in c.entries() if e.result is None]
    tcx.clear_tables()
    oa._compiled.clear()
    if not calls:  # no attention call reached the drop-in: the model keeps its own attention code
        return "bypassed", "no attention call went through attn_implementation (the model's own attention code)"
    return ("refused", reasons[0][:200]) if reasons else ("ok", f"{calls} calls")


def main() -> None:
    import transformers
    import torch_cubridge.integrations.transformers as tcx
    warnings.simplefilter("ignore")
    tcx.register()
    print(f"transformers {transformers.__version__}")
    fams = sys.argv[1:] or FAMILIES
    if fams == ["--all"]:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
        fams = sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    counts: dict[str, int] = {}
    for fam in fams:
        signal.signal(signal.SIGALRM, _too_long)
        signal.alarm(60)
        try:
            status, why = survey(fam)
        except TimeoutError:
            status, why = "error", "took over 60 s"
        finally:
            signal.alarm(0)
        counts[status] = counts.get(status, 0) + 1
        print(f"{fam:18s} {status:8s} {why}", flush=True)
    print("total: " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())))


def _too_long(signum, frame):
    raise TimeoutError


if __name__ == "__main__":
    main()
