"""One training step of a tiny llama through the drop-in under torch.distributed, in real processes: DDP, then
FSDP2 (`fully_shard` per decoder layer and the model), each rank on its share of one batch, and on rank 0 the
same step on the whole batch with no wrapper, the reference. What each rank saw goes to `out/rank{r}.pt`:
the losses, the gradients (FSDP2's: this rank's shards), who served each attention call forward and
backward, and which kernel sources this rank compiled (a kernel is built by one rank; the others load it
through the disk cache's lock).

On a CUDA machine each rank takes its own GPU where there are as many as ranks (NCCL), else the ranks share
GPU 0 through gloo (NCCL refuses two ranks on one device). On the CPU the ranks talk through gloo, and a
compiled call's verified program is served through the custom op by the interpreter (interpreted_op.py), so
the op's autograd path is the one under DDP and FSDP2 there too."""
from __future__ import annotations

import collections
import hashlib
import os
import warnings

import torch

B, S = 4, 48  # B divides among the ranks: each rank's mean loss has as many tokens as another's


def _batch(device: torch.device) -> torch.Tensor:
    return torch.randint(1, 128, (B, S), generator=torch.Generator().manual_seed(7)).to(device)


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Each parameter's gradient as this rank holds it: FSDP2's own shard (a DTensor's local part, the rank's
    torch.chunk of dim 0), not gathered: gathering on gloo over CUDA (full_tensor) crashed the process."""
    out = {}
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
        out[name.replace("module.", "")] = g.detach().double().cpu()
    return out


def _step(model: torch.nn.Module, ids: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
    model.train()
    model.zero_grad()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), _grads(model)


def worker(rank: int, world: int, init: str, out: str, dtype_name: str, device_kind: str) -> None:
    import faulthandler
    faulthandler.enable(open(os.path.join(out, f"rank{rank}.stack"), "w"))  # a rank's crash leaves its stack
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    import torch_cubridge.integrations.transformers as tcx
    from torch_cubridge.ops import backward_runner, kernel
    from tiny_models import build

    cuda = device_kind == "cuda"
    gpus = torch.cuda.device_count() if cuda else 0
    device = torch.device("cuda", rank % gpus) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    backend = os.environ.get("CUBRIDGE_TEST_DIST_BACKEND") or ("nccl" if cuda and gpus >= world else "gloo")
    dist.init_process_group(backend, init_method=f"file://{init}", rank=rank, world_size=world)
    compiled: list[str] = []
    build_cubin = kernel.compile_cubin

    def counted(source: str, *args, **kwargs):
        compiled.append(hashlib.sha256(source.encode()).hexdigest()[:16])
        return build_cubin(source, *args, **kwargs)
    kernel.compile_cubin = counted
    made: list = []
    if not cuda:
        from _pytest.monkeypatch import MonkeyPatch
        from interpreted_op import serve_by_op
        made = serve_by_op(MonkeyPatch())
    tcx.register()
    dtype = getattr(torch, dtype_name)

    def model() -> torch.nn.Module:
        return build("llama", "cubridge", dtype, str(device), attention_dropout=0.0, hidden_size=128,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=32).train()

    ids = _batch(device)
    share = ids[rank * B // world:(rank + 1) * B // world]
    result: dict = {"backend": backend, "device": str(device)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result["single"] = _step(model(), ids)
        ddp = DistributedDataParallel(model(), device_ids=[device.index] if cuda else None)
        loss, grads = _step(ddp, share)
        dist.all_reduce(loss)
        result["ddp"] = (loss / world, grads)
        sharded = model()
        for layer in sharded.model.layers:
            fully_shard(layer)
        fully_shard(sharded)
        loss, grads = _step(sharded, share)
        dist.all_reduce(loss)
        result["fsdp2"] = (loss / world, grads)
    fwd = sum((c.served for _, c in tcx.table_items()), start=collections.Counter())
    result["forward"] = dict(fwd) if cuda else {"kernel": sum(r.forward_calls for r in made)}
    result["backward"] = dict(sum((r.served for r in backward_runner._RUNNERS.values()), start=collections.Counter()))
    result["compiled"] = compiled
    for mode in ("single", "ddp", "fsdp2"):
        result[mode] = (float(result[mode][0]), result[mode][1])
    torch.save(result, os.path.join(out, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()
