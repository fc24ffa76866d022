"""`cubridge build`: a spec verified and its kernels built into the cache ahead of time, with no GPU;
a later process finds them under the keys it computes itself."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
needs_compiler = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs a CUDA compiler")


def _cli(tmp_path, *args):
    env = dict(os.environ, CUBRIDGE_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "torch_cubridge", *args], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=600)


@needs_compiler
@pytest.mark.parametrize("queries", [0, 1])
def test_build_puts_the_serving_kernels_in_the_cache(tmp_path, monkeypatch, queries):
    r = _cli(tmp_path, "build", "tests/support/zoo.py:causal_bottom_right", "--arch", "sm_90a", "--shape", "1,4,96,64",
             "--kv-heads", "4", *(["--queries", str(queries)] if queries else []))
    assert r.returncode == 0, r.stderr
    assert "cubridge: building" in r.stderr  # progress on stderr
    key = r.stdout.split()[0]
    assert ("cubridge_decode" if queries else "cubridge_fwd") in r.stdout
    # a serving process computes the same key for the same spec, arch and dtype, and finds the cubin
    monkeypatch.setenv("CUBRIDGE_CACHE_DIR", str(tmp_path / "cache"))
    import torch_cubridge as tc
    from torch_cubridge import cache as cache_mod
    from torch_cubridge.lower import lower
    from torch_cubridge.ops.kernel import kernel_key
    from zoo import causal_bottom_right
    q = torch.randn(1, 4, queries or 96, 64, dtype=torch.bfloat16)
    k, v = (torch.randn(1, 4, 96, 64, dtype=torch.bfloat16) for _ in range(2))
    p = tc.transfer(causal_bottom_right, q, k, v)
    low = lower(p, "sm_90a", "bfloat16", 64, decode=bool(queries))
    assert kernel_key(low, "sm_90a") == key
    assert cache_mod.default_cache().get(key) is not None
    listed = _cli(tmp_path, "cache", "list")
    assert key in listed.stdout
    # a server's call at another length finds the verified program with no capture (the call's warm key)
    import warnings
    f = tc.compile(causal_bottom_right)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no CUDA here: the spec serves, after the program is found
        f(*(torch.randn(1, 4, n, 64, dtype=torch.bfloat16) for n in (queries or 160, 160, 160)))
    assert "no capture" in f.entries()[-1].result.report.reason, f.entries()[-1].result.report.reason


def test_build_refuses_a_spec_it_cannot_compile(tmp_path):
    r = _cli(tmp_path, "build", "tests/pipeline/test_errors.py:erf_scores", "--arch", "sm_90a", "--shape", "1,2,64,64")
    assert r.returncode == 2 and "refused" in r.stderr and "torch.erf" in r.stderr


@needs_compiler
def test_build_every_attention_variant_of_a_model_from_its_config(tmp_path):
    """`cubridge build --model`: the model's own attention calls (its eager function, mask, scaling),
    prefill and a decode step, verified and built from config.json alone (no weights, no GPU)."""
    from transformers import LlamaConfig
    LlamaConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, intermediate_size=256,
                num_hidden_layers=3, vocab_size=1000).save_pretrained(tmp_path / "llama")  # head dim 64
    r = _cli(tmp_path, "build", "--model", str(tmp_path / "llama"), "--arch", "sm_90a", "--shape", "1,80",
             "--queries", "1")
    assert r.returncode == 0, r.stderr
    assert "FutureWarning" not in r.stderr and "deprecated" not in r.stderr, r.stderr  # our calls, current names
    lines = r.stdout.splitlines()
    assert any("cubridge_fwd" in ln and "queries 80" in ln for ln in lines), r.stdout
    assert any("cubridge_decode" in ln and "queries 1" in ln for ln in lines), r.stdout
    keys = {ln.split()[0] for ln in lines}
    listed = _cli(tmp_path, "cache", "list").stdout
    assert keys and all(k in listed for k in keys)


def test_small_config_keeps_attention_and_one_layer_per_kind():
    from transformers import Gemma2Config
    from torch_cubridge.integrations.transformers import small_config
    cfg = Gemma2Config(hidden_size=2304, num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                       intermediate_size=9216, num_hidden_layers=26, vocab_size=256000, pad_token_id=0)
    small = small_config(cfg)
    assert sorted(small.layer_types) == sorted(set(cfg.layer_types)) and small.num_hidden_layers == 2
    for name in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "sliding_window",
                 "query_pre_attn_scalar", "attn_logit_softcapping"):
        assert getattr(small, name) == getattr(cfg, name)
    assert small.intermediate_size == 64 and small.vocab_size == 256 and cfg.num_hidden_layers == 26


def test_bench_writes_times_and_a_chart(tmp_path):
    """`cubridge bench`: the spec, the compiled spec, SDPA (and FlexAttention where it runs) timed on the
    same inputs; bench.json and an SVG chart. On a machine without a GPU the spec serves."""
    import json
    r = _cli(tmp_path, "bench", "tests/support/zoo.py:causal_sdpa", "--shape", "1,2,64,32", "--dtype", "float32",
             "--out", str(tmp_path / "b"))
    assert r.returncode == 0, r.stderr
    res = json.loads((tmp_path / "b" / "bench.json").read_text())
    names = list(res["ms"])
    assert names[0] == "spec (eager)" and names[1].startswith("torch_cubridge") and "SDPA, plain" in names
    assert all(ms > 0 for ms in res["ms"].values())
    svg = (tmp_path / "b" / "bench.svg").read_text()
    assert svg.startswith("<svg") and svg.count("<rect") == len(names)


@needs_compiler
def test_build_the_flash_api_kernels_of_a_model_from_its_config(tmp_path, monkeypatch):
    """`cubridge build --model --flash-api`: the dense, packed and block-table decode kernels and the append,
    built from config.json alone under the keys a serving process computes for continuous batching's calls
    at other shapes (more sequences, another page size and table width)."""
    from transformers import LlamaConfig
    LlamaConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, intermediate_size=256,
                num_hidden_layers=2, vocab_size=1000).save_pretrained(tmp_path / "llama")
    r = _cli(tmp_path, "build", "--model", str(tmp_path / "llama"), "--flash-api", "--arch", "sm_90a",
             "--shape", "1,80")
    assert r.returncode == 0, r.stderr
    assert "FutureWarning" not in r.stderr and "deprecated" not in r.stderr, r.stderr  # our calls, current names
    for what in ("dense_attention", "varlen_attention", "paged_decode_attention", "cubridge_paged_append"):
        assert what in r.stdout, r.stdout
    keys = {ln.split()[0] for ln in r.stdout.splitlines()}
    monkeypatch.setenv("CUBRIDGE_CACHE_DIR", str(tmp_path / "cache"))
    import torch_cubridge as tc
    from torch_cubridge.capture.trace import bind_example
    from torch_cubridge.integrations.flash_api import paged_decode_attention
    from torch_cubridge.lower import lower
    from torch_cubridge.ops.kernel import kernel_key
    from torch_cubridge.lower.choice import choose_kernel
    bf = torch.bfloat16
    for B in (1, 5):  # a decode batch of 5 sequences, pages of 256, tables 3 pages wide
        args = (torch.randn(B, 1, 4, 64, dtype=bf), torch.randn(20, 256, 2, 64, dtype=bf),
                torch.randn(20, 256, 2, 64, dtype=bf), torch.randint(0, 20, (B, 3)).int(),
                torch.randint(1, 768, (B,)).int(), 64 ** -0.5, -1, 0.0, None, 1)
        p = tc.transfer(paged_decode_attention, *args)
        low = lower(p, fast_tanh=True, choice=choose_kernel(p, bind_example(paged_decode_attention, args, {}), "sm_90a"))
        assert kernel_key(low, "sm_90a") in keys, B
    # the decode programs themselves are found with no capture at continuous batching's default page size,
    # for a pool and a table of other sizes (neither is a guard), and at batch sizes the build never made
    # (the default builds 1 and 2 sequences; the program of 2 moves with the batch: Program.batch)
    import warnings
    from torch_cubridge.integrations.flash_api import _page_size
    f = tc.compile(paged_decode_attention)
    P = _page_size()
    for B in (1, 3, 9):
        args = (torch.randn(B, 1, 4, 64, dtype=bf), torch.randn(37, P, 2, 64, dtype=bf),
                torch.randn(37, P, 2, 64, dtype=bf), torch.randint(0, 37, (B, 7)).int(),
                torch.randint(1, 6 * P, (B,)).int(), 64 ** -0.5, -1, 0.0, None, 1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # no CUDA here: the spec serves, after the program is found
            f(*args)
        assert "no capture" in f.entries()[-1].result.report.reason, (B, f.entries()[-1].result.report.reason)


def test_a_refusal_while_building_names_where_it_was_made():
    """BuildRecord lists a call no kernel takes under the place the caller names (a layer, a function)."""
    from test_errors import erf_scores
    from torch_cubridge.pipeline import BuildRecord
    rec = BuildRecord("sm_90a", lambda s: None)
    rec.call(erf_scores, tuple(torch.randn(1, 2, 64, 64) for _ in range(3)), {}, "layer 3", layer=3)
    assert rec.built == [] and len(rec.refused) == 1 and rec.refused[0].startswith("layer 3: "), rec.refused
