"""`cubridge explain` on the example with softcap, sliding window and GQA."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("module", ["torch_cubridge.cli", "torch_cubridge"])  # python -m either
def test_explain_shows_program_and_verification(module):
    r = subprocess.run([sys.executable, "-m", module, "explain",
                        str(ROOT / "torch_cubridge/examples/specs.py") + ":softcap_sliding_gqa"],
                       capture_output=True, text=True, cwd=ROOT, check=True)
    out = r.stdout
    assert "== captured graph ==" in out and "cuir.program" in out
    assert "tanh" in out                      # softcap
    assert "(q - kv) < $p" in out              # sliding window, a runtime scalar
    assert "h // (H // Hkv)" in out            # GQA head map
    assert "verification: PASS" in out
    program = out.split("== CuIR program ==")[1].split("== verification")[0]
    assert max(map(len, program.splitlines())) <= 100, program  # its long guards list folded
    assert "guards : (q.shape[3] == 64)" in program and "(softcap == 50.0)" in program  # the pins first
