"""The backward gate's row flags (ops/row_flags.py): a finite fill over a whole row and a row with no key are
told apart from ordinary rows; a CPU LSE (no note) has them computed where they are read."""
from __future__ import annotations

import pytest
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


@pytest.mark.gpu
def test_a_dead_forwards_note_is_never_read_for_another_lse_in_its_place():
    """A forward whose backward never runs leaves its note; its LSE dies and the allocator gives its memory to
    an LSE no forward noted (one made under graph capture, a backward check's own forward). Its flags are its
    own: the dead one's note would hand its backward another forward's fill rows."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    dead = torch.full((2, 3, 64), -3.0e38, device="cuda")  # fill rows
    row_flags.note(dead)
    where = dead.data_ptr()
    del dead
    fresh = torch.zeros(2, 3, 64, device="cuda")  # the caching allocator's same block
    if fresh.data_ptr() != where:
        pytest.skip("the allocator gave another block")
    assert row_flags.read(fresh) == (False, False)
    kept = torch.full((2, 3, 64), -3.0e38, device="cuda")
    row_flags.note(kept)
    assert row_flags.read(kept.view(2, 3, 64)) == (True, False)  # its own note, through another view
