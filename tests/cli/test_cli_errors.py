"""The cubridge command, given a user's mistake: one line on stderr naming the problem and the fix, a
non-zero exit, never a traceback. Each case runs the real command in a subprocess at tiny shapes."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
needs_compiler = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs a CUDA compiler")

SPECS = '''
import math
import torch

x = 3


def fn(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1) @ v


def erf_scores(q, k, v):
    return torch.softmax(torch.erf(q @ k.transpose(-2, -1)), dim=-1) @ v


def raises(q, k, v):
    raise RuntimeError("boom from the spec")


def mismatched(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1), dim=-1) @ v


def mismatched_example():  # q's head dim 16, k's 32
    return torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 32), torch.randn(1, 2, 8, 32)
'''


@pytest.fixture(scope="module")
def specs(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("specs") / "specs.py"
    path.write_text(SPECS)
    return path


def cli(tmp_path: Path, *args: str, **extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "CUBRIDGE_DEBUG"}
    env.update(CUBRIDGE_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=str(ROOT), **extra)
    return subprocess.run([sys.executable, "-m", "torch_cubridge", *args], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=300)


def one_line_error(r: subprocess.CompletedProcess, *expect: str) -> str:
    """The failure's line: exit 2, no traceback, and the last stderr line (earlier ones are progress) says it."""
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("cubridge: "), r.stderr
    for e in expect:
        assert e in last, r.stderr
    return last


# (arguments after the spec file, the words the error line must hold)
MISTAKES = {
    "no file": (["explain", "{dir}/nonexistent.py:fn"], ["nonexistent.py: no such file"]),
    "not a function": (["explain", "{spec}:x"], ["specs.py:x is int 3, not a function"]),
    "no such function": (["explain", "{spec}:nofn"], ["has no function 'nofn'", "fn"]),
    "shape too short": (["explain", "{spec}:fn", "--shape", "2,4,128"],
                        ["--shape 2,4,128", "expected 4 sizes B,H,S,D"]),
    "shape not numbers": (["explain", "{spec}:fn", "--shape", "a,b,c,d"], ["'a' is not a whole number"]),
    "shape of zero": (["explain", "{spec}:fn", "--shape", "0,4,128,64"], ["B=0", "at least 1"]),
    "json of a refused spec": (["explain", "{spec}:erf_scores", "--json", "--shape", "1,2,16,16"],
                               ["refused: torch.erf", "no program to print"]),
    "spec raises": (["explain", "{spec}:raises", "--shape", "1,2,16,16"],
                    ["the spec raised RuntimeError: boom from the spec (specs.py:", "in raises)"]),
    "mismatched example": (["explain", "{spec}:mismatched"],
                           ["the spec raised RuntimeError", "mismatched_example()"]),
    "bad arch form": (["build", "{spec}:fn", "--arch", "sm90", "--shape", "1,2,16,16"],
                      ["--arch sm90", "sm_90a"]),
    "model dir missing": (["build", "--model", "nonexistent_dir", "--arch", "sm_90a", "--shape", "1,16"],
                          ["--model nonexistent_dir: no such directory"]),
    "model dir without config": (["build", "--model", "{dir}", "--arch", "sm_90a", "--shape", "1,16"],
                                 ["has no config.json"]),
    "model shape": (["build", "--model", "{dir}", "--arch", "sm_90a", "--shape", "1,16,3"],
                    ["expected 2 sizes B,S"]),
    "build without target": (["build", "--arch", "sm_90a", "--shape", "1,2,16,16"], ["--model"]),
}


@pytest.mark.parametrize("case", MISTAKES)
def test_a_mistake_is_one_line_and_a_failed_exit(tmp_path, specs, case):
    args, expect = MISTAKES[case]
    r = cli(tmp_path, *(a.format(spec=specs, dir=specs.parent) for a in args))
    one_line_error(r, *expect)
    if case == "model dir missing":  # decided before any download was tried
        assert "huggingface" not in r.stderr.lower(), r.stderr


@needs_compiler
def test_an_arch_the_compiler_does_not_know_is_the_compilers_one_line(tmp_path, specs):
    r = cli(tmp_path, "build", f"{specs}:fn", "--arch", "sm_999", "--shape", "1,1,16,16")
    line = one_line_error(r, "the kernel build failed", "Unsupported gpu architecture 'sm_999'")
    assert "--arch" in line


def test_debug_shows_the_traceback(tmp_path, specs):
    r = cli(tmp_path, "explain", f"{specs.parent}/nonexistent.py:fn", CUBRIDGE_DEBUG="1")
    assert r.returncode != 0 and "Traceback" in r.stderr and "no such file" in r.stderr


@pytest.mark.parametrize("args", [[], ["cache"]])
def test_no_subcommand_prints_the_commands(tmp_path, args):
    r = cli(tmp_path, *args)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "arguments are required" not in r.stderr
    words = ["explain", "build", "bench", "cache"] if not args else ["list", "verify", "clear", "export", "import"]
    assert all(w in r.stderr for w in words), r.stderr


def test_a_refused_spec_still_explains_with_exit_0(tmp_path, specs):
    r = cli(tmp_path, "explain", f"{specs}:erf_scores", "--shape", "1,2,16,16")
    assert r.returncode == 0 and "unsupported: torch.erf" in r.stdout and "Traceback" not in r.stderr


VERDICT = '''
import sys, warnings, torch, torch_cubridge as tc
sys.path.insert(0, {dir!r})
from specs import fn
q = torch.randn(1, 2, 16, 16)
if sys.argv[1] == "call":  # the first call verifies and records the program
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no CUDA here: the spec serves
        tc.compile(fn)(q, q, q)
print([ln for ln in tc.explain(fn, q, q, q).splitlines() if ln.startswith("== verification")][0])
'''


def test_explain_says_truthfully_where_the_verdict_came_from(tmp_path, specs):
    script = tmp_path / "verdict.py"
    script.write_text(VERDICT.format(dir=str(specs.parent)))
    env = dict(os.environ, CUBRIDGE_CACHE_DIR=str(tmp_path / "fresh"), PYTHONPATH=str(ROOT))

    def run(mode: str) -> str:
        r = subprocess.run([sys.executable, str(script), mode], capture_output=True, text=True, env=env, timeout=300)
        assert r.returncode == 0, r.stderr
        return r.stdout.strip()

    same = run("call")  # a brand-new cache: the verdict is this process's own
    assert "PASS" in same and "earlier process" not in same and "this process" in same, same
    later = run("explain")  # the next process reads the record the first one wrote
    assert "PASS" in later and "an earlier process" in later, later


def test_the_command_passes_past_key_values_under_the_name_the_model_takes():
    """Our own decode-step call gives transformers no FutureWarning (`past_key_values` renamed `cache`)."""
    import warnings
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from torch_cubridge.integrations.transformers import kv_cache
    cfg = LlamaConfig(hidden_size=32, num_attention_heads=2, num_key_value_heads=1, intermediate_size=32,
                      num_hidden_layers=1, vocab_size=50)
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 50, (1, 4))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        out = model(ids, use_cache=True)
        model(ids[:, -1:], **kv_cache(model, out), use_cache=True)
