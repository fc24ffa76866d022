"""The host fast path's C module (csrc/host/hotpath.c) builds with this machine's C compiler and Python
headers, into the cache under a name that changes with its source, and refuses malformed records. Replays
themselves need a GPU (tests/ops/test_hotpath_gpu.py)."""
import shutil

import pytest
import torch

from torch_cubridge.build import host
from torch_cubridge.build.errors import BuildError, CompilerUnavailable
from torch_cubridge.ops import host_module


@pytest.fixture
def built(tmp_path, monkeypatch):
    monkeypatch.setenv("CUBRIDGE_CACHE_DIR", str(tmp_path / "cache"))
    try:
        return host_module.load_module()
    except CompilerUnavailable as e:  # no compiler or headers: the Python path serves, nothing to test here
        pytest.skip(str(e))


def test_module_builds_into_the_cache_and_misses_without_records(built, tmp_path):
    assert host_module.module_path().is_file() and str(host_module.module_path()).startswith(str(tmp_path))
    q = torch.randn(1, 2, 8, 16)
    assert built.serve([], (q, q, q)) is None
    with pytest.raises(TypeError):
        built.serve((), (q,))


def test_an_edited_source_is_another_module(built, tmp_path, monkeypatch):
    first = host_module.module_path()
    src = tmp_path / "csrc" / "host" / "hotpath.c"
    src.parent.mkdir(parents=True)
    shutil.copy(host.source_path(), src)
    src.write_text(src.read_text() + "\n/* edited */\n")
    monkeypatch.setattr(host, "source_path", lambda: src)
    assert host_module.module_path() != first


def test_an_edited_decoder_is_another_module(tmp_path, monkeypatch):
    """The module's name covers every source it is built from (hotpath.c and the decoder.h it includes)."""
    first = host_module.module_path()
    d = tmp_path / "csrc" / "host"
    shutil.copytree(host.source_path().parent, d)
    monkeypatch.setattr(host, "source_path", lambda: d / "hotpath.c")
    assert host_module.module_path().name == first.name
    (d / "decoder.h").write_text((d / "decoder.h").read_text() + "\n/* edited */\n")
    assert host_module.module_path() != first


def test_malformed_decoders_are_refused(built):
    """The Decoder checks its layout description (and where per-call Params words go: inside the 8-byte
    block, of an extra tensor it reads, a dim that tensor has) before it touches the driver (ValueError here; with good
    arguments it loads the driver: RuntimeError on a machine without one)."""
    good = dict(tensor_type=torch.Tensor, dtype=torch.bfloat16, ranks=(4, 4, 4), perms=((0, 1, 2, 3),) * 3,
                out_dims=((0,), (2,), (1, 3)), head_dim=64, value_dim=64, block_m=16, block_n=64, fn=0, threads=128,
                smem=0, device=0, scale=0.125, params=b"\0" * 16, pages=b"\0" * 8, ctas_per_sm=2, sm_count=132, min_blocks=1,
                get_stream=None, capturing=None, grad_enabled=None, requires=((3, 1),), paged=(),
                extras=((torch.int64, 1),), patches=((0, 0, 0, 0),), bounds=None)
    for field, value in (("perms", ((0, 1, 2, 4),) * 3), ("out_dims", ((0,), (2,), (3,))),
                         ("out_dims", ((0, 0), (1,), (2,), (3,))), ("ranks", (4, 4, 5)), ("block_n", 0), ("min_blocks", 0),
                         ("requires", ((6, 1),)), ("extras", ((torch.int64, 5),)), ("extras", ((torch.int64, 1),) * 7),
                         ("patches", ((16, 0, 0, 0),)), ("patches", ((4, 0, 0, 0),)), ("patches", ((0, 1, 0, 1),)),
                         ("patches", ((0, 0, 1, 0),)), ("patches", ((0, 3, 0, 0),))):
        with pytest.raises(ValueError):
            built.Decoder(*dict(good, **{field: value}).values())
    try:
        built.Decoder(*good.values())
    except RuntimeError as e:  # no CUDA driver on this machine
        assert "libcuda" in str(e)


def test_malformed_records_are_refused(built):
    bad = dict(expect=(1,), is_tensor=(False,), src=(0,), patches=(), blocks=(b"\0" * 8,), fn=0, grid=(1, 1, 1),
               threads=32, smem=0, stream=0, device=0, tensor_type=torch.Tensor, out_shape=(1,), out_stride=(1,), like=0,
               get_stream=None, capturing=None, keep=None)
    with pytest.raises((ValueError, RuntimeError)):  # a pointer source that is not a tensor (or no driver)
        built.Record(*bad.values())
    with pytest.raises(TypeError):
        built.Record(1, 2, 3)


def test_read_only_mode_never_compiles(tmp_path, monkeypatch):
    monkeypatch.setenv("CUBRIDGE_CACHE_DIR", str(tmp_path / "empty"))
    monkeypatch.setenv("CUBRIDGE_READONLY", "1")
    with pytest.raises(BuildError):
        host_module.load_module()
    assert not (tmp_path / "empty").exists()


def test_launch_refuses_malformed_calls(built):
    """The runner's launch through the module: the argument shape is checked before the driver is touched."""
    with pytest.raises(TypeError):
        built.launch(0, 1, 1, 1, 32, 0, 0, [b"\0" * 8], None)  # blocks must be a tuple
    with pytest.raises(TypeError):
        built.launch(0, 1, 1)
    with pytest.raises(TypeError):
        built.launch(0, 1, 1, 1, 32, 0, 0, (b"\0" * 8,), [8])  # sizes a tuple or None


SCALE = 0.5


def _make_spec():
    cap = 30.0

    def spec(q, k, v):
        s = (q @ k.transpose(-1, -2)) * SCALE
        return torch.softmax(torch.tanh(s / cap) * cap, -1) @ v
    return spec


def test_the_c_watch_check_agrees_with_the_python_one(built, monkeypatch):
    """serve's own check of the globals and closure cells a spec read (`holds`): a rebound global, a deleted
    one and a rebound cell each fail it, as GlobalsWatch.unchanged fails, and the same values put back pass."""
    from torch_cubridge.capture.codekey import GlobalsWatch
    spec = _make_spec()
    w = GlobalsWatch(spec)
    held = w.held()
    assert built.holds(held) and w.unchanged() and built.holds(None)
    monkeypatch.setitem(globals(), "SCALE", 0.25)
    assert not built.holds(held) and not w.unchanged()
    monkeypatch.setitem(globals(), "SCALE", float("0.5"))  # another object of the same value: a rebinding too
    assert not built.holds(held) and not w.unchanged()
    monkeypatch.undo()
    assert built.holds(held) and w.unchanged()
    monkeypatch.delitem(globals(), "SCALE")
    assert not built.holds(held) and not w.unchanged()
    monkeypatch.undo()
    cell = spec.__closure__[0]
    was = cell.cell_contents
    cell.cell_contents = 20.0
    assert not built.holds(held) and not w.unchanged()
    cell.cell_contents = was
    assert built.holds(held) and w.unchanged()
    q = torch.randn(1, 2, 8, 16)
    assert built.serve([], (q, q, q), held) is None


def _load_racing(cache: str, count: str, barrier, out) -> None:
    """One racing process: load the module from an empty cache, each compile counted in `count`."""
    import os
    os.environ["CUBRIDGE_CACHE_DIR"] = cache
    from torch_cubridge.build import host as host_
    from torch_cubridge.ops import host_module as hm
    build = host_.build_module

    def counted(*a, **k):
        with open(count, "a") as f:
            f.write("build\n")
        return build(*a, **k)
    host_.build_module = counted
    barrier.wait()
    try:
        out.put(hm.module_path().name if hm.load_module() is not None else None)
    except CompilerUnavailable as e:
        out.put(f"unavailable: {e}")


def test_processes_starting_together_compile_the_module_once(tmp_path):
    """On a cold cache the processes of a job wait for one compiler run and load its module."""
    from racing import race
    count = tmp_path / "count"
    got = race(_load_racing, (str(tmp_path / "cache"), str(count)), 3, timeout=300)
    if any(str(g).startswith("unavailable") for g in got):
        pytest.skip(got[0])
    assert len(set(got)) == 1 and None not in got
    assert count.read_text().count("build") == 1
