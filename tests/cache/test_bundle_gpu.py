"""On a CUDA device: a deployment bundle of the flash API's kernels, built from a model's config.json by a
process that sees no GPU (`cubridge build --model --flash-api`, nvcc), exported, imported into an empty cache
and served in a fresh process with CUBRIDGE_READONLY=1: transformers' continuous batching and a dense
`generate` run on its kernels with no compiler call (read-only refuses one: the spec would serve) and match a
plain eager model token for token up to its first near-tie. CUBRIDGE_TEST_BUNDLE names a bundle built on
another machine (from `python tests/cache/test_bundle_gpu.py config DIR`) to serve as well."""
import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from test_continuous_batching_gpu import KW, _clear_steps, generation_config, prompts
from paths import child_pythonpath
from tiny_models import build, config

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]


def _run(args: list, cache: Path, **env: str) -> subprocess.CompletedProcess:
    path = child_pythonpath()
    e = {k: v for k, v in os.environ.items() if k != "CUBRIDGE_READONLY"}
    r = subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT, timeout=900,
                       env={**e, "CUBRIDGE_CACHE_DIR": str(cache), "PYTHONPATH": path, **env})
    assert r.returncode == 0, f"{args}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


def _serve_child(weights: str) -> None:
    """The serving process: our flash name, the weights given, continuous batching then a dense generate."""
    import collections
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    import torch_cubridge.integrations.flash_api as tfa
    name = tfa.register()
    model = build("llama", name, torch.bfloat16, "cuda", **KW)
    model.load_state_dict(torch.load(weights))
    gc = generation_config()
    before = {n: collections.Counter(c.served) for n, c in tfa.compiled().items()}
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = model.generate_batch(inputs=prompts(), generation_config=gc,
                                   continuous_batching_config=ContinuousBatchingConfig(num_blocks=64,
                                                                                       max_batch_tokens=512))
        batched = {json.dumps(v.prompt_ids): list(v.generated_tokens) for v in out.values()}
        ids = torch.tensor([prompts()[3]], device="cuda")
        dense = model.generate(ids, generation_config=gc)[0, ids.shape[1]:].tolist()
    served = {n: dict(collections.Counter(c.served) - before[n]) for n, c in tfa.compiled().items()}
    reasons = [r for c in tfa.compiled().values() for e in c.entries() for r in [e.reason, *e.reasons.values(), *e.spec_calls] if r]
    print(json.dumps({"batched": batched, "dense": dense, "served": served, "reasons": reasons}))


def _build_bundle(tmp: Path) -> Path:
    """A bundle built as on a machine with no GPU: the CUDA devices hidden, nvcc compiling."""
    config("llama", **KW).save_pretrained(tmp / "llama")
    _run(["-m", "torch_cubridge", "build", "--model", str(tmp / "llama"), "--flash-api", "--arch", "sm_90a",
          "--shape", "1,80"], tmp / "build-cache", CUDA_VISIBLE_DEVICES="", CUBRIDGE_COMPILER="nvcc")
    _run(["-m", "torch_cubridge", "cache", "export", str(tmp / "bundle")], tmp / "build-cache")
    return tmp / "bundle"


def _serve(bundle: Path, tmp: Path, ref) -> dict:
    _run(["-m", "torch_cubridge", "cache", "import", str(bundle)], tmp / "serve-cache")
    torch.save(ref.state_dict(), tmp / "weights.pt")
    r = _run([__file__, "serve", str(tmp / "weights.pt")], tmp / "serve-cache", CUBRIDGE_READONLY="1")
    return json.loads(r.stdout.strip().splitlines()[-1])


def _assert_served_and_matching(got: dict, ref) -> None:
    served, reasons = got["served"], "\n".join(got["reasons"])
    assert all(c.get("spec", 0) == 0 for c in served.values()), (served, reasons)
    for name in ("dense", "varlen", "paged_decode"):
        assert served[name].get("kernel", 0) > 0, (name, served, reasons)
    compared = 0
    for prompt in prompts():
        toks = got["batched"][json.dumps(prompt)]
        want = ref.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=12, do_sample=False,
                            pad_token_id=0)[0, len(prompt):].tolist()
        n = _clear_steps(ref, prompt, want)
        assert toks[:n] == want[:n], (len(prompt), n, toks, want)
        compared += n
        if prompt == prompts()[3]:
            assert got["dense"][:n] == want[:n], (n, got["dense"], want)
    assert compared >= 8, f"only {compared} tokens were chosen by a clear margin"


def _bundles() -> list:
    other = os.environ.get("CUBRIDGE_TEST_BUNDLE")
    return ["built-here", pytest.param(other, id="other-machine") if other else
            pytest.param(None, id="other-machine", marks=pytest.mark.skip(reason="CUBRIDGE_TEST_BUNDLE not set"))]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="the bundle is built by nvcc")
@pytest.mark.parametrize("bundle", _bundles())
def test_a_flash_api_bundle_serves_read_only_in_a_fresh_process(tmp_path, bundle):
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the bundle is built for sm_90a")
    with torch.no_grad():
        ref = build("llama", "eager", torch.bfloat16, "cuda", **KW)
        path = _build_bundle(tmp_path) if bundle == "built-here" else Path(bundle)
        got = _serve(path, tmp_path, ref)
        _assert_served_and_matching(got, ref)


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        _serve_child(sys.argv[2])
    elif sys.argv[1] == "config":  # the model this test serves, for a bundle built elsewhere
        config("llama", **KW).save_pretrained(sys.argv[2])
