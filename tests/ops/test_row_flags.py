"""The backward gate's row flags (ops/row_flags.py): a finite fill over a whole row and a row with no key are
told apart from ordinary rows; a CPU LSE (no note) has them computed where they are read."""
from __future__ import annotations

import torch

from torch_cubridge.ops import row_flags


def test_rows_are_flagged_by_their_lse():
    lse = torch.zeros(2, 3, 5)
    assert row_flags.read(lse) == (False, False)
    lse[1, 2, 4] = -3.0e38  # finfo.min over every key: the fill
    assert row_flags.read(lse) == (True, False)
    lse[0, 0, 0] = float("-inf")  # no key kept
    assert row_flags.read(lse) == (True, True)
    lse[1, 2, 4] = row_flags.FILL_ROW_LSE + 1  # a large but ordinary row
    assert row_flags.read(lse) == (False, True)
    assert row_flags.fill_rows(lse).sum() == 0


def test_a_cpu_lse_leaves_no_note():
    before = len(row_flags._NOTES)
    row_flags.note(torch.zeros(2, 3, 5))
    assert len(row_flags._NOTES) == before
