"""integrations/eager_lookup.py: the function a module's own attention lookup gives for "eager"."""
import sys
import warnings

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")
from transformers import AttentionInterface  # noqa: E402
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # noqa: E402

import torch_cubridge.integrations.transformers as tcx  # noqa: E402
from torch_cubridge.integrations import eager_lookup  # noqa: E402


def plain_attention(module, q, k, v, mask, scaling=1.0, **kwargs):
    s = q @ k.transpose(-1, -2) * scaling
    if mask is not None:
        s = s + mask
    return torch.softmax(s, dim=-1) @ v, None


def other_attention(module, q, k, v, mask, scaling=1.0, **kwargs):
    return plain_attention(module, q, k, v, mask, scaling * 0.5)


def eager_attention_forward(module, q, k, v, mask, **kwargs):  # the name a guess would take: never this module's
    raise AssertionError("the guessed function ran")


class _Config:
    def __init__(self, impl):
        self._attn_implementation = impl


class ByInterface(nn.Module):
    """get_interface with a fallback that is not named eager_attention_forward"""
    def __init__(self, impl):
        super().__init__()
        self.config, self.is_causal = _Config(impl), False

    def forward(self, q, k, v):
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, other_attention)
        if self.config._attn_implementation == "flash_attention_2":
            attention = ALL_ATTENTION_FUNCTIONS["sdpa"]  # a constant name: not the dispatch
        return attention(self, q, k, v, None, scaling=0.25)[0]


class Guarded(ByInterface):
    """the older form: the fallback assigned, then replaced by the interface's entry unless "eager"."""
    def forward(self, q, k, v):
        attention = other_attention
        if self.config._attn_implementation != "eager":
            attention = ALL_ATTENTION_FUNCTIONS[self.config._attn_implementation]
        return attention(self, q, k, v, None, scaling=0.25)[0]


class Local(ByInterface):
    """the fallback is a local of the forward: resolved in the calling frame"""
    def forward(self, q, k, v):
        fallback = other_attention if q.shape[-1] == 8 else plain_attention
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, fallback)
        return attention(self, q, k, v, None, scaling=0.25)[0]


def _call(attention, module, q, k, v):
    return attention(module, q, k, v, None, scaling=0.25)[0]


class ThroughHelper(ByInterface):
    """the lookup in forward, the call in a helper that looks nothing up: the class's forward tells"""
    def forward(self, q, k, v):
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, other_attention)
        return _call(attention, self, q, k, v)


class Ambiguous(ByInterface):
    """two lookups with different fallbacks: no one function"""
    def forward(self, q, k, v):
        if q.shape[0] > 1:
            attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, other_attention)
        else:
            attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, plain_attention)
        return attention(self, q, k, v, None, scaling=0.25)[0]


class Stored(ByInterface):
    """the lookup made elsewhere (at construction): the calling code has none, nor has the class's forward"""
    def __init__(self, impl):
        super().__init__(impl)
        self.attention = ALL_ATTENTION_FUNCTIONS.get_interface(impl, other_attention)

    def forward(self, q, k, v):
        return self.attention(self, q, k, v, None, scaling=0.25)[0]


@pytest.fixture(scope="module", autouse=True)
def _registered():
    tcx.register()


def _qkv():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(2, 2, 6, 8, generator=g, dtype=torch.float64) for _ in range(3)]


@pytest.mark.parametrize("cls", [ByInterface, Guarded, Local, ThroughHelper])
def test_the_module_is_served_by_its_lookup_repeated_with_eager(cls):
    q, k, v = _qkv()
    want = cls("eager")(q, k, v)
    ours = cls(tcx.NAME)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no CUDA here: the spec computes
        got = ours(q, k, v)
    assert torch.allclose(got, want, rtol=0, atol=1e-12)
    assert tcx._eager_for(ours) is other_attention
    assert sum(sum(c.served.values()) for c in tcx.tables(ours)) == 1  # the call went through the drop-in


def test_the_class_lookup_reads_the_forward_bound_on_the_class():
    assert eager_lookup.from_class(ByInterface).fn is other_attention
    assert eager_lookup.from_class(Guarded).fn is other_attention
    assert tcx.eager_function(Guarded) is other_attention
    assert eager_lookup.from_class(Local).fn is None  # a local of a call: unknown without the call


def test_an_interface_override_of_eager_is_what_eager_runs():
    interface = AttentionInterface()
    interface["eager"] = plain_attention  # registered in this interface only
    code = sys._getframe().f_code
    found = eager_lookup._eager_of(eager_lookup._Lookup(*_lookup_parts("interface.get_interface(x, other_attention)")),
                                   eager_lookup._Scope(code, lambda: {"interface": interface}, globals()),
                                   AttentionInterface)
    assert found is plain_attention


def _lookup_parts(text):
    import ast
    call = ast.parse(text, mode="eval").body
    return call.func.value, f"method:{call.func.attr}", (call.args[1],)


@pytest.mark.parametrize("cls", [Ambiguous, Stored])
def test_no_function_is_guessed_where_the_lookup_does_not_tell_one(cls):
    ours = cls(tcx.NAME)
    with pytest.raises(ValueError, match="cannot tell which attention function"):
        ours(*_qkv())


def test_a_model_first_called_under_torch_compile_is_served_by_its_class_lookup():
    """No frame to read while dynamo traces: the class lookups worked out when the model was built serve
    (fullgraph: the lookup itself is never traced)."""
    from tiny_models import inputs, pair
    ref, ours = pair("llama", layers=1)
    ids, mask = inputs()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = ref(ids, attention_mask=mask).logits
        got = torch.compile(ours, fullgraph=True, backend="eager")(ids, attention_mask=mask).logits
    assert float((got - want).norm() / want.norm()) < 1e-5
