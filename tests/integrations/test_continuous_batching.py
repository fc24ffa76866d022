"""transformers' continuous batching (generate_batch) through cubridge: registered as "paged|eager", the
attention takes the paged cache's keys and values and the packed mask, matches transformers' own
paged eager token for token, and a decode step of another length reuses the program (no capture per
step: a packed mask's stride is its key length, and pinning it pinned every size)."""
import pytest
import torch

import torch_cubridge.integrations.transformers as tcx
from tiny_models import build, small_paged_cache

transformers = pytest.importorskip("transformers")


@pytest.fixture
def paged_eager_restored():
    from transformers import AttentionInterface
    original = AttentionInterface._global_mapping["paged|eager"]
    yield
    AttentionInterface.register("paged|eager", original)


def test_generate_batch_matches_transformers_paged_eager(paged_eager_restored):
    from transformers import GenerationConfig
    ref = build("llama", "eager")
    torch.manual_seed(0)
    prompts = [torch.randint(1, 128, (n,)).tolist() for n in (7, 12, 5)]
    gc = GenerationConfig(max_new_tokens=5, do_sample=False, eos_token_id=None, pad_token_id=0)
    try:
        want = {k: v.generated_tokens for k, v in ref.generate_batch(inputs=prompts, generation_config=gc,
                                                                     **small_paged_cache()).items()}
    except (ValueError, MemoryError) as e:  # transformers 5.17 sizes the paged cache from device memory: none on
        # the CPU (ValueError by default; MemoryError when the cache's size is given, as small_paged_cache() does)
        pytest.skip(f"this transformers' continuous batching does not run on the CPU ({e})")
    tcx.register_continuous_batching()
    ours = build("llama", "eager")
    ours.load_state_dict(ref.state_dict())
    with pytest.warns(RuntimeWarning, match="CUDA is not available"):  # on the CPU the verified spec runs
        got = {k: v.generated_tokens for k, v in ours.generate_batch(inputs=prompts, generation_config=gc,
                                                                     **small_paged_cache()).items()}
    assert got == want
    tables = [c for m, c in tcx.table_items() if any(m is x for x in ours.modules())]
    assert len(tables) == 2 and all(sum(c.served.values()) == 5 for c in tables)  # prefill + 4 steps, every layer
    for c in tables:  # one program for the prefill, one for every decode step, each generic in the lengths
        assert all(e.result is not None for e in c.entries()) and len(c.entries()) == 2
