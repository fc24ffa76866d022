"""Attention whose q, k and v a module computes with depthwise convolutions (and a class token), then
contracts with einsum (the convolutional-vision-transformer style). Two ways this was refused:
einsum's bmm reads each operand with a unit dim no layout names ([B, H, S, D, 1]), and, without the
class token, the prologue's shape-only run on meta tensors met the spec's own view of a convolution's
output, whose meta strides differ from the CPU's, and raised (an internal error)."""
import pytest
import torch

import torch_cubridge as tc
from helpers import rel_err
from torch_cubridge.integrations.own_attention import module_spec


class ConvProjectedAttention(torch.nn.Module):
    def __init__(self, dim: int = 32, heads: int = 2, kv_stride: int = 2, class_token: bool = True) -> None:
        super().__init__()
        self.heads, self.class_token = heads, class_token
        self.scale = (dim // heads) ** -0.5

        def conv(stride: int) -> torch.nn.Sequential:
            return torch.nn.Sequential(torch.nn.Conv2d(dim, dim, 3, stride, 1, groups=dim, bias=False),
                                       torch.nn.BatchNorm2d(dim))
        self.conv_q, self.conv_k, self.conv_v = conv(1), conv(kv_stride), conv(kv_stride)
        self.proj = torch.nn.ModuleList(torch.nn.Linear(dim, dim) for _ in range(3))

    def split_heads(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        return x.view(b, t, self.heads, c // self.heads).permute(0, 2, 1, 3)

    def forward(self, x: torch.Tensor, height: int, width: int) -> torch.Tensor:
        cls, grid = torch.split(x, [1, height * width], 1) if self.class_token else (None, x)
        b, _, c = grid.shape
        grid = grid.permute(0, 2, 1).view(b, c, height, width)
        q, k, v = (f(grid).view(b, c, -1).permute(0, 2, 1) for f in (self.conv_q, self.conv_k, self.conv_v))
        if cls is not None:
            q, k, v = (torch.cat((cls, t), dim=1) for t in (q, k, v))
        q, k, v = (self.split_heads(p(t)) for p, t in zip(self.proj, (q, k, v)))
        w = torch.softmax(torch.einsum("bhlk,bhtk->bhlt", q, k) * self.scale, dim=-1)
        o = torch.einsum("bhlt,bhtv->bhlv", w, v)
        return o.permute(0, 2, 1, 3).reshape(b, -1, c)


def _module(class_token: bool = True) -> ConvProjectedAttention:
    torch.manual_seed(0)
    m = ConvProjectedAttention(class_token=class_token).eval()
    for bn in (m.conv_q[1], m.conv_k[1], m.conv_v[1]):  # running statistics that are not the identity
        bn.running_mean.uniform_(-0.5, 0.5)
        bn.running_var.uniform_(0.5, 2.0)
    return m


def test_computed_operands_read_through_einsum_transfer_and_match_float64():
    m, spec = _module(), module_spec(ConvProjectedAttention)
    x = torch.randn(2, 1 + 8 * 8, 32)
    prog = tc.transfer(spec, m, x, 8, 8)
    assert prog.q.step and prog.k.step and prog.v.step
    assert len(prog.q.dims) == 4  # einsum's unit dim is not part of the layout
    x2 = torch.randn(2, 1 + 8 * 8, 32)
    with torch.no_grad():
        got = prog.run(m, x2, 8, 8)
        ref = spec(m.double(), x2.double(), 8, 8)
    m.float()
    assert rel_err(got, ref) < 1e-5


@pytest.mark.parametrize("class_token", [True, False])
def test_the_program_holds_at_another_grid(class_token):
    """The lengths follow the grid: the transfer fits its literals to them (its shape-only run of the
    prologue on meta tensors raised here), and the program verifies at each grid."""
    m, spec = _module(class_token), module_spec(ConvProjectedAttention)
    for hw in (8, 6):
        x = torch.randn(3, class_token + hw * hw, 32)
        text = tc.explain(spec, m, x, hw, hw)
        assert "verification: PASS" in text and "unsupported" not in text, text[-400:]
        with torch.no_grad():
            got = tc.transfer(spec, m, x, hw, hw).run(m, x, hw, hw)
            ref = spec(m.double(), x.double(), hw, hw)
        m.float()
        assert rel_err(got, ref) < 1e-5
