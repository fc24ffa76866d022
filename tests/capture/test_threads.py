"""First calls in several threads at once (a server's worker threads warming up): every trace of a spec takes
one lock, as make_fx's module-call patcher is process state; without it two traces at once failed
("CURRENT_PATCHER is None") and those calls went to the spec."""
import math
import threading
import warnings

import torch

import torch_cubridge as tc
from helpers import rel_err


def _spec(cap: float):
    def spec(q, k, v):
        s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        return torch.softmax(cap * torch.tanh(s / cap), -1) @ v
    spec.__name__ = f"softcap_{int(cap)}"
    return spec


def test_first_calls_in_many_threads_all_capture_and_verify():
    n = 8
    start = threading.Barrier(n)
    seen: dict[int, list[str]] = {}
    wrong: list = []

    def first_call(i: int) -> None:
        spec = _spec(20.0 + i)  # eight distinct specs: eight captures at once
        f = tc.compile(spec)
        g = torch.Generator().manual_seed(i)
        q, k, v = (torch.randn(1, 2, 40, 16, generator=g) for _ in range(3))
        start.wait()
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            out = f(q, k, v)
        seen[i] = [str(x.message) for x in w if "CUDA is not available" not in str(x.message)]
        if rel_err(out.double(), spec(q.double(), k.double(), v.double())) > 1e-5:
            wrong.append(i)
        if f.entries()[-1].result is None:  # no verified program: the capture or the transfer failed
            seen[i].append(f"no program: {f.entries()[-1].reason}")

    threads = [threading.Thread(target=first_call, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not wrong
    assert len(seen) == n and not any(seen.values()), seen


def test_a_first_call_does_its_cpu_work_on_one_thread_and_gives_the_callers_count_back():
    seen: list[int] = []

    def spec(q, k, v):
        seen.append(torch.get_num_threads())
        return torch.softmax(q @ k.transpose(-1, -2) / 4.0, -1) @ v
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        f = tc.compile(spec)
        q, k, v = (torch.randn(1, 2, 24, 16) for _ in range(3))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = f(q, k, v)
        after = torch.get_num_threads()
        seen_in_stages = list(seen)
        seen.clear()
        spec(q, k, v)  # the caller's own call, outside any stage
        outside = list(seen)
    finally:
        torch.set_num_threads(before)
    assert rel_err(out, spec(q, k, v)) < 1e-5
    # capture, probes and float64 references on one thread; then the answer (on the CPU the spec serves) on two
    assert len(seen_in_stages) > 2 and set(seen_in_stages[:-1]) == {1} and seen_in_stages[-1] == 2
    assert after == 2 and outside == [2]
