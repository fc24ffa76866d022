"""A training step through the drop-in under torch.distributed, in real processes (distributed_step.py): DDP
and FSDP2 over 2 ranks give the loss and the gradients of the same step on the whole batch in one process, and
every attention call went through the compiled path. On a GPU every call, forward and backward, is the
kernels', and each kernel is compiled by one rank only."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

import distributed_step

WORLD = 2


def _run(tmp_path: Path, dtype: str, device: str) -> list[dict]:
    os.environ["CUBRIDGE_CACHE_DIR"] = str(tmp_path / "cache")  # the ranks' shared cache, new: kernels are built
    mp.start_processes(distributed_step.worker, args=(WORLD, str(tmp_path / "init"), str(tmp_path), dtype, device),
                       nprocs=WORLD, start_method="spawn")
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _shard(full: torch.Tensor, rank: int) -> torch.Tensor:
    """FSDP2's shard of a parameter on `rank`: its torch.chunk of dim 0 (none past the last chunk)."""
    chunks = torch.chunk(full, WORLD, dim=0)
    return chunks[rank] if rank < len(chunks) else full[:0]


def _assert_same_step(ranks: list[dict], tol: float) -> None:
    for rank, r in enumerate(ranks):
        want_loss, full = r["single"]
        for mode in ("ddp", "fsdp2"):
            loss, grads = r[mode]
            assert abs(loss - want_loss) <= tol * abs(want_loss), (mode, loss, want_loss)
            want = full if mode == "ddp" else {n: _shard(w, rank) for n, w in full.items()}
            assert grads.keys() == want.keys(), mode
            flat = [torch.cat([g[n].flatten() for n in sorted(want)]) for g in (grads, want)]
            assert _rel(*flat) <= tol, (mode, rank, _rel(*flat))
            top = max(float(w.norm()) for w in want.values())
            for n, w in want.items():
                err = float((grads[n] - w).norm()) / max(float(w.norm()), 1e-2 * top)
                assert err <= 10 * tol, f"{mode}, rank {rank}: {n} off by {err:.2e}"


def test_ddp_and_fsdp2_steps_match_one_process_on_the_cpu(tmp_path: Path) -> None:
    ranks = _run(tmp_path, "float32", "cpu")
    assert {r["backend"] for r in ranks} == {"gloo"}
    _assert_same_step(ranks, 1e-5)
    for r in ranks:
        assert r["forward"]["kernel"] > 0  # through the custom op and its autograd


@pytest.mark.gpu
def test_ddp_and_fsdp2_steps_run_on_the_kernels_and_build_each_once(tmp_path: Path) -> None:
    ranks = _run(tmp_path, "bfloat16", "cuda")
    _assert_same_step(ranks, 2e-2)
    # two GPUs: NCCL, a rank a device; one GPU: gloo, both ranks on it (NCCL refuses two ranks on one device)
    two = torch.cuda.device_count() >= WORLD
    if not os.environ.get("CUBRIDGE_TEST_DIST_BACKEND"):
        assert {r["backend"] for r in ranks} == ({"nccl"} if two else {"gloo"}), [r["backend"] for r in ranks]
    assert len({r["device"] for r in ranks}) == (WORLD if two else 1), [r["device"] for r in ranks]
    for r in ranks:
        assert r["forward"].get("spec", 0) == 0 and r["forward"]["kernel"] > 0, r["forward"]
        assert r["backward"] == {"kernel": r["backward"].get("kernel", 0)} and r["backward"]["kernel"] > 0, \
            r["backward"]
    built = [s for r in ranks for s in r["compiled"]]
    assert built and len(built) == len(set(built)), [r["compiled"] for r in ranks]
