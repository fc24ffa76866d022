"""The compiled kernel as a callable with the spec's signature.

Per call: bind arguments, view q/k/v in canonical order (no copies for any
permutation whose last dim is contiguous), allocate the output in the spec's
layout, pack arguments, launch on the current stream. No host sync.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import torch

from ..errors import UnsupportedSpec
from ..ir.bind import bind_args, lookup, scalar_values, sizes_of, to_canonical
from ..ir.interval import interval
from ..ir.program import Program
from ..lower import Lowered, lower
from .kernel import load_kernel
from .launch import CubinKernel
from .pack import pack_fwd, pack_params, params_format

_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """cp.async moves 16 bytes: base and row strides must be 16-byte aligned."""
    if t.stride(-1) != 1 or t.data_ptr() % 16 or any(s % 8 for s in t.stride()[:-1]):
        return t.contiguous()
    return t


class KernelRunner:
    def __init__(self, p: Program, low: Lowered, kernel: CubinKernel, head_dim: int, info: dict) -> None:
        self.p = p
        self.low = low
        self.kernel = kernel
        self.head_dim = head_dim
        self.info = info
        self.fmt = params_format(low.params)
        self._consts: dict[tuple, torch.Tensor] = {}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.run_bound(bind_args(self.p.signature, args, kwargs))

    def _extras(self, bound: dict[str, Any], dev: torch.device) -> dict[str, torch.Tensor]:
        out = {}
        for x in self.p.extras:
            if x.arg is not None:
                t = lookup(bound, x.arg)
                if t.device != dev:
                    raise ValueError(f"{x.arg} is on {t.device}, the query on {dev}")
                want = getattr(torch, x.dtype)
                if t.dtype != want:
                    raise TypeError(f"{x.arg} has dtype {t.dtype}; the kernel was built for {want}")
                out[x.name] = t
            else:
                key = (x.name, dev)
                if key not in self._consts:
                    self._consts[key] = torch.tensor(x.value, dtype=getattr(torch, x.dtype), device=dev)
                out[x.name] = self._consts[key]
        return out

    def run_bound(self, bound: dict[str, Any], poison: bool = False) -> Any:
        p = self.p
        q = _aligned(to_canonical(lookup(bound, p.q.arg), p.q))
        k = _aligned(to_canonical(lookup(bound, p.k.arg), p.k))
        v = _aligned(to_canonical(lookup(bound, p.v.arg), p.v))
        if not (q.dtype == k.dtype == v.dtype) or _DTYPES.get(q.dtype) != self.low.dtype:
            raise TypeError(f"query/key/value must all be {self.low.dtype}")
        if q.shape[-1] != self.head_dim or v.shape[-1] != self.head_dim or k.shape[-1] != self.head_dim:
            raise ValueError(f"head dim must be {self.head_dim}")
        if not (q.device == k.device == v.device) or q.device.type != "cuda":
            raise ValueError("query, key and value must be CUDA tensors on one device")
        if k.shape[2] != v.shape[2] or k.shape[1] != v.shape[1] or q.shape[1] % k.shape[1]:
            raise ValueError(f"incompatible key/value shapes {tuple(k.shape)} / {tuple(v.shape)} for query {tuple(q.shape)}")
        sizes = sizes_of(p, q, k)
        scal = scalar_values(p, bound, sizes)
        extras = self._extras(bound, q.device)
        out, oc = self._alloc(q)
        if poison:
            out.fill_(float("nan"))
        scale = 1.0
        if self.low.scale is not None:
            env = {kk: (float(vv), float(vv)) for kk, vv in {**sizes, **scal}.items()}
            scale = interval(self.low.scale, env)[0]
            if not scale > 0:  # the kernel folds the scale into exp2 after the row max: needs scale > 0
                raise ValueError(f"score scale {scale} must be positive for this kernel")
        tile = self.low.tile
        grid = (math.ceil(sizes["Sq"] / tile.block_m), sizes["H"], sizes["B"])
        if sizes["Sq"] and sizes["Skv"]:
            blocks = [pack_fwd(q, k, v, oc, None, scale), pack_params(self.fmt, self.low.params, extras, scal)]
            self.kernel.launch(grid, blocks, torch.cuda.current_stream(q.device).cuda_stream)
        else:
            oc.zero_()
        res = out if p.out.dtype == "q" else out.to(getattr(torch, p.out.dtype))
        if p.out.tuple_len:
            full: list[Any] = [None] * p.out.tuple_len
            full[p.out.index] = res
            return tuple(full)
        return res

    def _alloc(self, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Output in the spec's layout, and its canonical [B, H, Sq, D] view."""
        B, H, S, D = q.shape
        ext = {"b": B, "h": H, "s": S, "d": D}
        parts = [x.split("*") for x in self.p.out.dims]
        out = torch.empty([math.prod(ext[c] for c in g) for g in parts], dtype=q.dtype, device=q.device)
        flat = [c for g in parts for c in g]
        view = out.view([ext[c] for c in flat])
        if "b" not in flat:
            view, flat = view.unsqueeze(0), ["b"] + flat
        return out, view.permute([flat.index(c) for c in "bhsd"])


def build_runner(fn: Callable, res: Any, bound: dict[str, Any]) -> tuple[KernelRunner | None, str]:
    """Lower, build or load, verify on the GPU; a kernel that fails is never returned."""
    from ..verify.gpu import verify_kernel
    p: Program = res.program
    q = lookup(bound, p.q.arg)
    if q.dtype not in _DTYPES:
        raise UnsupportedSpec(f"the kernel computes in bfloat16 or float16; the inputs are {q.dtype}", op="kernel")
    head_dim = q.shape[p.q.dims.index("d")]
    major, minor = torch.cuda.get_device_capability(q.device)
    if major < 8:
        raise UnsupportedSpec(f"the kernel needs sm_80 or newer; this GPU is sm_{major}{minor}", op="kernel")
    arch = "sm_90" if major == 9 else f"sm_{major}{minor}" if major == 8 else "sm_80"
    last = None
    for fast in (True, False):
        low = lower(p, arch, _DTYPES[q.dtype], head_dim, fast_tanh=fast)
        kern, info = load_kernel(low, arch)
        runner = KernelRunner(p, low, kern, head_dim, info)
        rep = verify_kernel(runner.run_bound, fn, p, res.captured.example, q.dtype, q.device)
        info["verification"] = rep
        if rep.ok:
            how = "built" if info["built"] else "loaded from the disk cache"
            worst = max((t.rel_err for t in rep.trials), default=0.0)
            return runner, (f"fused kernel {info['key']} ({how} in {info['seconds']:.2f} s, source "
                            f"{info['source_path']}); GPU verification passed, worst rel L2 {worst:.1e}")
        last = rep
        if not low.fast_tanh:
            break
    return None, "the compiled kernel failed GPU verification and is not used:\n" + (last.summary() if last else "")
