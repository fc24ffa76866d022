"""What a compiled spec's caller sees on the CPU: warnings that name the caller's own line, and a call
the spec itself cannot take raising the spec's error alone."""
import math
import warnings

import pytest
import torch

import torch_cubridge as tc


def attention(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1) @ v


def erf_scores(q, k, v):
    return torch.softmax(torch.erf(q @ k.transpose(-2, -1)), dim=-1) @ v


@pytest.mark.parametrize("spec", [attention, erf_scores])  # no kernel on the CPU; a refused spec
def test_a_warning_names_the_callers_line(spec):
    f = tc.compile(spec)
    q = torch.randn(1, 2, 8, 16)
    with pytest.warns(RuntimeWarning, match="torch_cubridge") as caught:
        f(q, q, q); line = __import__("inspect").currentframe().f_lineno  # noqa: E702 (the call's own line)
    assert {(w.filename, w.lineno) for w in caught} == {(__file__, line)}


@pytest.mark.parametrize("k_shape, k_dtype", [((1, 2, 8, 32), torch.float32), ((1, 2, 8, 16), torch.float64)])
def test_a_call_the_spec_cannot_take_raises_its_error_with_no_warning_first(k_shape, k_dtype):
    f = tc.compile(attention)
    q = torch.randn(1, 2, 8, 16)
    k = torch.randn(*k_shape, dtype=k_dtype)
    with warnings.catch_warnings(record=True) as caught, pytest.raises(RuntimeError):
        warnings.simplefilter("always")
        f(q, k, k)
    assert not [w for w in caught if "torch_cubridge" in str(w.message)], [str(w.message) for w in caught]
