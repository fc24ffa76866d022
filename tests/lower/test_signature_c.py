"""The call signature built in C (csrc/host/signature.h) is capture/signature.py's, key for key: equal and
of equal hash, so a table filled by one is found by the other. Built with this machine's C compiler."""
import functools

import pytest
import torch

from torch_cubridge.build.errors import CompilerUnavailable
from torch_cubridge.capture import signature
from torch_cubridge.ops import host_module


@pytest.fixture
def c_signature(tmp_path, monkeypatch):
    monkeypatch.setenv("CUBRIDGE_CACHE_DIR", str(tmp_path / "cache"))
    try:
        mod = host_module.load_module()
    except CompilerUnavailable as e:  # no compiler or headers: the Python signature serves, nothing to test
        pytest.skip(str(e))
    monkeypatch.setattr(signature, "_c_signature", None)
    assert signature.adopt_c(mod)
    return mod.signature


class _Plain:
    pass


class _OwnEq:
    def __eq__(self, other):
        return True

    __hash__ = None


class _Size(int):
    """A size that is not an exact int: (1).__eq__ decides, as in Python."""


def _cases():
    m = torch.nn.Linear(2, 2)
    q = torch.randn(2, 4, 1, 8)
    fn = functools.partial(max, 1)
    plain, own = _Plain(), _OwnEq()
    return [
        ((q, q.transpose(1, 2), torch.randn(1, 1, 5, 1, dtype=torch.float64), torch.tensor(3.0)), {}),
        ((m, q, q, q, None), {"dropout": 0.0, "scaling": 0.125, "position_ids": torch.zeros(1, 1, dtype=torch.long),
                              "use_cache": True}),
        ((q,), {"z": 1, "a": "text", "m": torch.bfloat16, "b": None, "k": False}),
        (([q, (q[:1], 3)], (1, 2.5, [None, "x"]), []), {"nested": ([q], (m,))}),
        ((fn, plain, own, _Plain), {"f": len, "e": torch.empty(0, 1, 3)}),
        ((), {}),
        ((torch.empty(0), torch.randn(3).as_strided((1, 3), (0, 1))), {}),
    ]


def test_the_c_key_is_the_python_key(c_signature):
    for args, kwargs in _cases():
        want = signature.python_signature(args, kwargs)
        got = c_signature(args, kwargs)
        assert got == want and hash(got) == hash(want), (args, kwargs)
        assert {want: 1}.get(got) == 1
        assert signature.call_signature(args, kwargs) == want  # the module's is the one served


def test_keyword_order_and_kinds_found_in_c(c_signature):
    q = torch.randn(1, 2, 3, 4)
    assert c_signature((q,), {"b": 1, "a": 2}) == c_signature((q,), {"a": 2, "b": 1})

    class Fresh:  # a type the kinds table has not seen: _kind files it, as Python's first call would
        pass
    x = Fresh()
    assert Fresh not in signature._KIND
    assert c_signature((x,), {}) == signature.python_signature((x,), {})
    assert Fresh in signature._KIND


def test_a_size_that_is_not_an_exact_int_is_read_as_python_reads_it(c_signature, monkeypatch):
    class T(torch.Tensor):
        @property
        def shape(self):
            return (_Size(1), _Size(2))
    t = torch.randn(1, 2).as_subclass(T)
    monkeypatch.setitem(signature._KIND, T, signature._TENSOR)
    assert c_signature((t,), {}) == signature.python_signature((t,), {}) == ((t.dtype, -1, (True, False)),)


def test_bad_arguments_raise(c_signature):
    with pytest.raises(TypeError):
        c_signature([1], {})
    with pytest.raises(TypeError):
        c_signature((1,), [])
