"""A recalled verdict says where it was reached: in this process, by an earlier one, or in a bundle."""
from torch_cubridge.cache import default_cache, verdicts
from torch_cubridge.cache.bundle import export_bundle, import_bundle


def test_a_verdict_names_where_it_was_reached(tmp_path, monkeypatch):
    monkeypatch.setenv("CUBRIDGE_CACHE_DIR", str(tmp_path / "built"))
    verdicts.remember_program("spec-hash", "{}", True, "symbolic")
    verdicts.remember_gpu_verdict("kernel:sha", "spec-hash", "H100", True, 1e-3)
    assert verdicts.program_origin("spec-hash") == "earlier in this process"
    assert verdicts.gpu_origin("kernel:sha", "spec-hash", "H100") == "earlier in this process"
    monkeypatch.setattr(verdicts, "_WRITTEN", set())  # as the next process on this machine finds them
    assert verdicts.program_origin("spec-hash") == "by an earlier process"
    assert verdicts.gpu_origin("kernel:sha", "spec-hash", "H100") == "by an earlier process"
    export_bundle(default_cache(), tmp_path / "bundle")
    monkeypatch.setenv("CUBRIDGE_CACHE_DIR", str(tmp_path / "served"))  # a server that imported the bundle
    import_bundle(default_cache(), tmp_path / "bundle")
    assert verdicts.recall_program("spec-hash") is not None
    assert verdicts.program_origin("spec-hash") == "in an imported bundle"
    assert verdicts.gpu_origin("kernel:sha", "spec-hash", "H100") == "in an imported bundle"
