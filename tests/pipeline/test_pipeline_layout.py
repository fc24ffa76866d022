"""pipeline.py holds the stage order only; the stages' own work lives in the package of its stage."""
import ast
from pathlib import Path

import torch_cubridge.pipeline as pipeline

PKG = Path(__file__).resolve().parents[2] / "torch_cubridge"


def _defined(path: Path) -> set[str]:
    return {n.name for n in ast.parse(path.read_text()).body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}


def test_the_pipeline_is_short_and_defines_no_stage_work():
    text = (PKG / "pipeline.py").read_text()
    assert len(text.splitlines()) <= 250
    assert "ThreadPoolExecutor" not in text and "Lock(" not in text  # the early build's pool: build/early.py
    work = {"guards_for", "with_requirements", "build_early", "choose_kernel", "KernelChoice", "program_tile",
            "decode_refusal", "in_place_refusal", "_unmoved", "_divisor_pins"}
    assert not _defined(PKG / "pipeline.py") & work
    assert {"held", "guards_for", "with_requirements"} <= _defined(PKG / "capture" / "program_guards.py")
    assert {"build_early", "warm_compiler", "building", "load"} <= _defined(PKG / "build" / "early.py")
    assert {"KernelChoice", "choose", "choose_kernel"} <= _defined(PKG / "lower" / "choice.py")


def test_the_names_callers_import_from_the_pipeline_are_still_there():
    """compile.py, api.py, cli.py and the integrations reach the stages through these names."""
    for name in ("Transferred", "kernel_stage", "on_cuda", "stage", "transfer_stage", "warm_key", "warm_transfer",
                 "build_ahead", "BuildRecord"):
        assert hasattr(pipeline, name), name
