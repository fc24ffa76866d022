"""Every transformers family that builds tiny, under attn_implementation="cubridge": is each answer right,
and who computed each attention call (the kernel or the spec), and why.

Per family, in a process of its own (forked, `--jobs` at a time; a CUDA error or a hang stays there, and a
timeout kills it): a tiny random model from the family's config (generic small sizes where the config takes
them, then integrations/transformers.py small_config), eager in float32 and ours from the same weights, on a
left-padded batch for text models. Ours runs in bf16 on the GPU, or with --cpu in float32 on the CPU, where
the CPU interpreter stands in for the kernel: a call counts as "kernel" where its spec was captured,
transferred and verified into a program and a kernel choice for sm_90a exists and lowers (the decision the GPU
makes before it builds), else "spec" with the reason. The families are transformers' own list of configs
(CONFIG_MAPPING), or the ones named.

A whole sweep runs past one device call: `--shard K/N` takes every N-th family from the K-th, `--budget S`
starts no family after S seconds (the rest are rows "not-run"), and `--merge A.json B.json ...` joins the
shards' files into one result.

Usage: python benchmarks/survey_families.py [--cpu] [--out DIR] [--jobs N] [--gpus N] [--timeout S] [--shard K/N]
       [--budget S] [--skip RESULT.json ...] [family ...]
       python benchmarks/survey_families.py --merge A.json B.json ... --out DIR
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # the checkout's torch_cubridge, run from anywhere
# sizes a config takes where it has them (a config without the name keeps its own): small enough for a
# CPU dry run, attention still multi-head with GQA where the family has it
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
            # an encoder-decoder's stacks by their own names: mbart's num_hidden_layers is its encoder's, and its
            # causal LM built 12 decoder layers over a cache of 2
            encoder_layers=2, decoder_layers=2, num_decoder_layers=2,
            # and their heads: blenderbot's default 32 over a width of 64 made a head dim of 2, where the call
            # judge's bound (a fraction of the row's largest of two values) is below bf16's rounding
            encoder_attention_heads=4, decoder_attention_heads=4)
# the same in a sub-config, under the names vision towers use
TOWER = dict(depth=2, num_layers=2, num_heads=4, embed_dim=64, hidden_dim=64, d_model=64)
# a config still this large is not tiny: thirty of them at once in float32 would fill the host's memory, and
# its random init alone takes most of a minute
MAX_PARAMS = 200e6
TOLERANCE = {"cpu": 1e-3, "cuda": 3e-2}  # relative error of the outputs against eager in float32
# A random tiny model can amplify rounding: eager itself in bf16 is off by up to 0.24 (phi4's vision tower).
# The whole model is wrong where ours is off by more than eager in the same dtype, by this factor; each
# attention call is judged on its own, row by row (call_check: CALL_TOLERANCE of the row's largest value, or
# EAGER_FACTOR times eager's own error in that row, whichever is larger; a right bf16 kernel measures ~5e-3).
EAGER_FACTOR = 1.5
CALL_TOLERANCE = {"cpu": 1e-4, "cuda": 2e-2}


# ---- the child: one family -------------------------------------------------------------------------


def model_class(family: str, cfg) -> type:
    """The model a config builds: the causal LM where the family has one, else its base model, else the
    class of the config's own modeling file that names this config class (sub-configs: a vision tower)."""
    import importlib
    import transformers
    from transformers.models.auto import modeling_auto as ma
    for names in (ma.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, ma.MODEL_MAPPING_NAMES):
        if family in names:
            name = names[family]
            return getattr(transformers, name if isinstance(name, str) else name[0])
    mod = importlib.import_module(type(cfg).__module__.replace(".configuration_", ".modeling_"))
    found = [c for c in vars(mod).values() if isinstance(c, type) and issubclass(c, transformers.PreTrainedModel)
             and getattr(c, "config_class", None) is type(cfg) and not c.__name__.endswith("PreTrainedModel")]
    if not found:
        raise LookupError(f"no model class of {type(cfg).__name__} in {mod.__name__}")
    return min(found, key=lambda c: (not c.__name__.endswith("Model"), len(c.__name__)))


def shrunk(cfg, sizes: dict):
    """The config rebuilt with `sizes` in every sub-config (text, vision, audio towers: a multimodal family's
    towers otherwise keep their default sizes, and their random init alone ran past a minute), each
    sub-config's own sub-configs too. Rebuilt from its dict, so values the parent derives from them agree."""
    subs = getattr(cfg, "sub_configs", None) or {}
    d = cfg.to_dict()
    for name in subs:
        sub = getattr(cfg, name, None)
        if sub is None or not hasattr(sub, "to_dict"):
            continue
        inner = shrunk(sub, sizes).to_dict()
        layers = inner.get("num_hidden_layers")
        inner.update({k: v for k, v in sizes.items() if k in inner and inner[k] is not None})
        if isinstance(inner.get("layer_types"), list):  # one layer of each type, as small_config keeps
            inner["layer_types"] = list(dict.fromkeys(inner["layer_types"]))
            inner["num_hidden_layers"] = len(inner["layer_types"])
        for k, v in inner.items():  # any other list of one value a layer keeps the first layers' values
            if k != "layer_types" and isinstance(v, list) and layers and len(v) == layers:
                inner[k] = v[:inner["num_hidden_layers"]]
        vocab = inner.get("vocab_size")
        for k, v in inner.items():  # a tower's token ids past its tiny vocabulary (mllama's pad id 128004): its last
            if k.endswith("_token_id") and isinstance(v, int) and isinstance(vocab, int) and v >= vocab:
                inner[k] = vocab - 1
        d[name] = inner
    return type(cfg).from_dict(d) if subs else cfg


def configs(family: str):
    """The family's config with TINY's sizes, its towers shrunk to them too; then, for a family with towers,
    with a head dim of 64, then 128 (rotary sections that some towers' text models hard-code, multimodal
    rope, need one); then with the family's own sizes (where TINY does not fit) and its towers shrunk. Each through
    small_config. Never a tower at its default size: their random init alone ran past a minute a family."""
    from torch_cubridge.integrations.transformers import small_config
    for kw in (TINY, {**TINY, "hidden_size": 256, "head_dim": 64}, {**TINY, "hidden_size": 512, "head_dim": 128},
               {}):
        try:
            cfg = _config_taking(family, kw)
            if kw is not TINY and kw and not getattr(cfg, "sub_configs", None):
                continue  # no towers: a larger head dim is the first attempt over again
            yield small_config(shrunk(cfg, {**(kw or TINY), **TOWER}))
        except Exception:  # noqa: BLE001  (a config that refuses these sizes)
            continue


def _config_taking(family: str, kw: dict):
    """AutoConfig.for_model(family, **kw), without each size the config refuses by name (falcon's head_dim is
    a read-only property: with it the whole attempt failed, and the family fell to its 415M default sizes)."""
    from transformers import AutoConfig
    kw = dict(kw)
    while True:
        try:
            return AutoConfig.for_model(family, **kw)
        except Exception as e:  # noqa: BLE001
            named = [k for k in kw if k in str(e)]
            if not named:
                raise
            del kw[named[0]]


def inputs(model, cfg, device: str) -> tuple[dict, "torch.Tensor | None"]:
    """The model's main input for a batch of two, and the [B, S] mask of real tokens where it is text."""
    import inspect
    import torch
    g = torch.Generator().manual_seed(1)
    params = inspect.signature(model.forward).parameters
    name = model.main_input_name
    keep = None
    if name == "input_ids":
        vocab = getattr(cfg, "vocab_size", None) or 128
        ids = torch.randint(1, min(vocab, 128), (2, 16), generator=g)
        keep = torch.ones_like(ids)
        keep[0, :5] = 0  # left-padded
        kw = {"input_ids": ids}
        if "attention_mask" in params:
            kw["attention_mask"] = keep
        else:
            keep = None
        if "decoder_input_ids" in params:
            kw["decoder_input_ids"] = ids[:, -6:]
            keep = None
    elif name == "pixel_values":
        size = getattr(cfg, "image_size", 224)
        size = size if isinstance(size, (list, tuple)) else (size, size)
        kw = {name: torch.randn(2, getattr(cfg, "num_channels", 3), *size[-2:], generator=g)}
    elif name == "input_values":
        kw = {name: torch.randn(2, 4000, generator=g)}
    elif name == "input_features":
        bins = getattr(cfg, "num_mel_bins", None) or getattr(cfg, "feature_size", None) or 80
        frames = 2 * getattr(cfg, "max_source_positions", 32)  # whisper-style encoders take exactly this many
        kw = {name: torch.randn(2, bins, frames, generator=g)}
    else:
        raise LookupError(f"no tiny input for main input {name!r}")
    return {k: v.to(device) for k, v in kw.items()}, (keep.to(device) if keep is not None else None)


def first_output(out) -> "torch.Tensor":
    import torch
    for name in ("logits", "last_hidden_state"):
        t = getattr(out, name, None)
        if isinstance(t, torch.Tensor):
            return t
    items = out.values() if hasattr(out, "values") else out if isinstance(out, (tuple, list)) else [out]
    return next(t for t in items if isinstance(t, torch.Tensor))


def cpu_kernel_stage(fn, res, bound):
    """The GPU's kernel decision on the CPU: the sm_90a kernel choice (in bf16, at the call's head dims)
    and its lowering; where both hold, the CPU interpreter serves the call in the kernel's place."""
    from torch_cubridge.errors import UnsupportedSpec
    from torch_cubridge.ir.prologue import operand_shapes
    from torch_cubridge.lower import lower
    from torch_cubridge.lower.choice import choose
    from torch_cubridge.lower.tiles import decode_call
    p = res.program
    try:
        ops = operand_shapes(p, bound)
        q = ops["q"].shape
        c = choose(p, "sm_90a", "bfloat16", q[p.q.dims.index("d")], ops["v"].shape[p.v.dims.index("d")],
                   decode_call(q[p.q.dims.index("s")]))
        if c.refusal:
            return None, f"no kernel for this program: {c.refusal}"
        lower(p, choice=c)
    except UnsupportedSpec as e:
        return None, f"no kernel for this program: {e}"
    except Exception as e:  # noqa: BLE001
        return None, f"kernel lowering failed ({type(e).__name__}: {e})"
    return p.run, "interpreted in the kernel's place"


class call_check:
    """While active, each compiled attention call's output is compared, row by row, with its spec run in
    float32 on the same inputs (upcast), and so is the spec run as the model runs it (eager, in the model's
    dtype). A row is wrong where ours is off by more than EAGER_FACTOR times eager's error in that row and
    by more than CALL_TOLERANCE of the row's largest value: a bf16 row whose output cancels (a near-uniform
    average of values, |o| << |v|) is off by that much in eager too, while a key masked wrongly is not.
    `calls` gets each call's worst row as ours' error over that bound (wrong above 1), and `worst` that row's
    figures (which row, ours' and eager's errors, its largest value), to tell a wrong mask from rounding. Calls made inside a
    pipeline stage (a module's forward captured as a whole, whose trace reaches the interface) are left to
    the pipeline: the check would put its own ops into that trace. A spec that cannot run upcast records
    nothing."""

    def __init__(self, calls: list[float]) -> None:
        self.calls = calls
        self.worst: dict = {}

    def __enter__(self) -> "call_check":
        import torch
        from torch._guards import detect_fake_mode
        from torch_cubridge.capture.nesting import stage
        from torch_cubridge.compile import CompiledAttention
        self.cls, self.orig = CompiledAttention, CompiledAttention.__call__
        orig, calls, worst = self.orig, self.calls, self.worst

        def up(t):
            return t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t

        def first(x):
            return x[0] if isinstance(x, (tuple, list)) else x

        def checked(fn_self, *args, **kwargs):
            out = orig(fn_self, *args, **kwargs)
            if stage.depth or detect_fake_mode(list(args) + list(kwargs.values())):
                return out  # inside a stage, or a shape-only trace (fake tensors have no values to judge)
            try:
                ref = first(fn_self.fn(*map(up, args), **{k: up(v) for k, v in kwargs.items()}))
                low = first(fn_self.fn(*args, **kwargs))
            except Exception:  # noqa: BLE001  (the spec does not run upcast: no verdict from this check)
                return out
            o = first(out)
            if all(isinstance(t, torch.Tensor) for t in (o, ref, low)) and o.shape == ref.shape == low.shape:
                o, r, e = o.float(), ref.float(), low.float()
                if not r.numel():
                    return out
                ours = (o - r).abs().amax(-1)
                bound = torch.maximum(EAGER_FACTOR * (e - r).abs().amax(-1),
                                      CALL_TOLERANCE[o.device.type] * r.abs().amax(-1)).clamp_min(1e-30)
                ratio = ours / bound
                calls.append(float(ratio.max()))
                if calls[-1] >= worst.get("over_bound", -1.0):
                    i = int(ratio.argmax())
                    at = [int(x) for x in torch.unravel_index(torch.tensor(i), ratio.shape)]
                    worst.update(over_bound=calls[-1], call=len(calls) - 1, call_shape=list(o.shape), row=at,
                                 ours=float(ours.flatten()[i]), eager=float((e - r).abs().amax(-1).flatten()[i]),
                                 row_max=float(r.abs().amax(-1).flatten()[i]))
            return out

        CompiledAttention.__call__ = checked
        return self

    def __exit__(self, *exc) -> None:
        self.cls.__call__ = self.orig


def tables_of(model) -> list:
    """The compiled tables of every attention module of this model (read while the model lives: an entry
    dies with its module)."""
    import torch_cubridge.integrations.transformers as tcx
    from torch_cubridge.integrations import own_attention as oa
    out = []
    for m in model.modules():
        out += tcx.tables(m)
        out += [c for t in (oa._compiled, oa._compiled_cached) if (c := t.get(m)) is not None]
    return out


def reasons_of(tables: list) -> collections.Counter:
    why: collections.Counter = collections.Counter()
    for t in tables:
        for e in t.entries():
            if e.result is None:
                why[e.reason] += 1
            why.update(r for d, r in e.reasons.items() if e.runners.get(d) is None)
            why.update(e.spec_calls)
    return why


def survey_one(family: str, cpu: bool) -> dict:
    import importlib
    import warnings
    import torch
    import torch_cubridge.integrations.transformers as tcx
    import transformers
    warnings.simplefilter("ignore")
    transformers.logging.set_verbosity_error()
    tcx.register()
    device = "cpu" if cpu else "cuda"
    if cpu:
        importlib.import_module("torch_cubridge.compile").kernel_stage = cpu_kernel_stage
    failed = "no config builds"
    t0 = time.monotonic()
    for cfg in configs(family):
        try:
            cls = model_class(family, cfg)
            with torch.device("meta"):  # its size first, without allocating it
                size = sum(p.numel() for p in cls._from_config(cfg, attn_implementation="eager").parameters())
            if size > MAX_PARAMS:
                raise MemoryError(f"{size / 1e6:.0f}M parameters at its smallest")
            torch.manual_seed(0)
            # the float32 reference on the CPU: a config that does not build or run is found without a CUDA
            # context (a second or more a process, and serialised in the driver when fourteen start at once)
            ref = cls._from_config(cfg, attn_implementation="eager", dtype=torch.float32).eval()
            kw, keep = inputs(ref, cfg, "cpu")
            with torch.no_grad():
                want = first_output(ref(**kw)).float()
        except Exception as e:  # noqa: BLE001  (this config does not build or run eager: try the next)
            failed = f"{type(e).__name__}: {str(e)[:160]}"
            continue
        break
    else:
        return {"status": "no-tiny", "why": failed}
    import copy
    dtype = torch.float32 if cpu else torch.bfloat16

    def run(impl: str):
        # made on the device: its random init is overwritten by the reference's weights, and a bf16 init on
        # one CPU thread took past 110 s for a multimodal family's default-sized towers (gemma3)
        with torch.device(device):
            m = cls._from_config(copy.deepcopy(cfg), attn_implementation=impl, dtype=dtype).eval()
        m.load_state_dict(ref.state_dict())
        # buffers a module makes with a legacy constructor (LeViT's torch.LongTensor index table) ignore the
        # default device and are in no state dict: moved as a user's model.to(device) moves them
        m.to(device)
        with torch.no_grad():
            got = first_output(m(**{k: (v.to(dtype) if v.is_floating_point() else v).to(device)
                                    for k, v in kw.items()})).float().cpu()
        g, w = (got[keep.bool()], want[keep.bool()]) if keep is not None and got.shape[:2] == keep.shape else (got, want)
        return m, float((g - w).norm() / w.norm().clamp_min(1e-30)) if g.shape == w.shape else float("inf")

    calls: list[float] = []
    t1 = time.monotonic()
    try:
        _, eager_err = run("eager")
    except Exception as e:  # noqa: BLE001  (eager itself does not run in this dtype or on this device)
        return {"status": "no-dtype", "model": cls.__name__, "why": f"eager: {type(e).__name__}: {str(e)[:200]}"}
    t2 = time.monotonic()
    try:
        with call_check(calls) as check:
            ours, err = run(tcx.NAME)
    except Exception as e:  # noqa: BLE001  (eager ran: this is the drop-in's failure)
        return {"status": "error", "model": cls.__name__, "why": f"{type(e).__name__}: {str(e)[:200]}"}
    tables = tables_of(ours)
    served = sum((t.served for t in tables), collections.Counter())
    why = reasons_of(tables)
    from torch_cubridge.integrations.own_attention import own_forward_calls
    why.update({f"own forward of {c}: {r}": n for c, rs in own_forward_calls.items() for r, n in rs.items()})
    worst_call = max(calls, default=0.0)
    if (err != err or err > max(TOLERANCE[device], EAGER_FACTOR * eager_err)
            or worst_call != worst_call or worst_call > 1.0):
        status = "wrong"
    elif not served:
        status = "no-call"
    else:
        status = "kernel" if not served["spec"] else "spec" if not served["kernel"] else "partial"
    return {"status": status, "model": cls.__name__, "rel_err": err, "eager_rel_err": eager_err,
            "worst_call_over_bound": worst_call, "worst_row": check.worst, "calls_checked": len(calls), "kernel": served["kernel"],
            "spec": served["spec"], "why": [f"{n}x {r}" for r, n in why.most_common(3)],
            # where a family's seconds go: the float32 reference, eager in the run's dtype, ours (first calls)
            "phases_s": [round(t1 - t0, 1), round(t2 - t1, 1), round(time.monotonic() - t2, 1)]}


# ---- the parent: one process a family ------------------------------------------------------------------


def _child(family: str, cpu: bool, conn, stacks: str | None, gpu: int | None = None) -> None:
    if gpu is not None:  # this child's GPU; "cuda" below is the current device (CUDA starts here, after fork)
        import torch
        torch.cuda.set_device(gpu)
    if stacks:  # the parent signals a child past its time: where it was goes to <stacks>/<family>.txt
        import faulthandler
        import signal
        Path(stacks).mkdir(parents=True, exist_ok=True)
        faulthandler.register(signal.SIGUSR1, file=open(Path(stacks) / f"{family}.txt", "w"), all_threads=True)
    try:
        res = survey_one(family, cpu)
    except BaseException as e:  # noqa: BLE001  (whatever it was, the parent gets a row)
        res = {"status": "crash", "why": f"{type(e).__name__}: {str(e)[:200]}"}
    conn.send(res)
    conn.close()


def run_all(fams: list[str], cpu: bool, jobs: int, timeout: float, report, budget: float = float("inf"),
            stacks: str | None = None, gpus: int = 1) -> list[dict]:
    """Each family in a process of its own, `jobs` at a time, forked from this one after torch, transformers
    and torch_cubridge are imported (seconds a family saved) and before CUDA is touched (a forked CUDA
    context is unusable: each child makes its own). A child past `timeout` is killed. With `gpus` > 1 the
    children take the GPUs in turn (the parent cannot count them without touching CUDA: it is told)."""
    import multiprocessing as mp
    import torch  # noqa: F401  (imported once, inherited by every child)
    import transformers  # noqa: F401
    import torch_cubridge.integrations.transformers  # noqa: F401
    ctx = mp.get_context("fork")
    todo, running, rows = list(fams), {}, {}
    started = 0
    began = time.monotonic()
    while todo or running:
        if todo and time.monotonic() - began > budget:
            rows.update({f: {"family": f, "status": "not-run", "why": f"past the {budget:.0f} s budget"}
                         for f in todo})
            todo = []
        while todo and len(running) < jobs:
            fam = todo.pop(0)
            recv, send = ctx.Pipe(duplex=False)
            gpu = None if cpu or gpus < 2 else started % gpus
            started += 1
            proc = ctx.Process(target=_child, args=(fam, cpu, send, stacks, gpu), daemon=True)
            proc.start()
            send.close()
            running[fam] = (proc, recv, time.monotonic())
        time.sleep(0.05)
        for fam, (proc, recv, start) in list(running.items()):
            took = time.monotonic() - start
            if recv.poll():
                try:
                    res = recv.recv()
                except EOFError:
                    res = None
            elif not proc.is_alive():
                res = None
            elif took > timeout:
                if stacks:
                    import signal
                    os.kill(proc.pid, signal.SIGUSR1)
                    time.sleep(0.5)
                proc.kill()
                res = {"status": "timeout", "why": f"over {timeout:.0f} s"}
            else:
                continue
            if res is None:
                proc.join(1)
                res = {"status": "crash", "why": f"the process ended with {proc.exitcode} and no result"}
            proc.join(5)
            del running[fam]
            rows[fam] = {"family": fam, **res, "seconds": round(took, 1)}
            report(rows[fam])
    return [rows[f] for f in fams]


def families(named: list[str], shard: str | None = None) -> list[str]:
    if named:
        return named
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    fams = sorted(CONFIG_MAPPING_NAMES)
    if shard:
        k, n = (int(x) for x in shard.split("/"))
        fams = fams[k::n]
    return fams


def merge(paths: list[str], out: str) -> None:
    """One result from the shards' files: a row a family (a settled row over a timeout or not-run), the
    counts recomputed, the seconds summed, each row with the commit of the file it came from."""
    import json
    parts = [json.loads(Path(p).read_text()) for p in paths]
    by_family: dict[str, dict] = {}
    for p in parts:  # a later file's settled row replaces an earlier one (a timed-out family run again)
        for r in p["rows"]:
            if r["family"] not in by_family or r["status"] not in ("timeout", "not-run"):
                by_family[r["family"]] = {"commit": p["commit"], **r}  # a merged file's rows keep their own
    rows = sorted(by_family.values(), key=lambda r: r["family"])
    head = {k: v for k, v in parts[-1].items() if k not in ("rows", "counts", "seconds", "shard")}
    head["commits"] = sorted({r["commit"] for r in rows})  # each row names its own
    head.update(seconds=round(sum(p["seconds"] for p in parts), 1),
                counts=dict(collections.Counter(r["status"] for r in rows)), rows=rows)
    path = Path(out) / "survey_families.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(head, indent=1))
    print(path, head["counts"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("families", nargs="*")
    ap.add_argument("--cpu", action="store_true", help="float32 on the CPU, the interpreter in the kernel's place")
    ap.add_argument("--out", default=None, help="folder for survey_families.json")
    ap.add_argument("--jobs", type=int, default=min(16, os.cpu_count() or 1))
    ap.add_argument("--gpus", type=int, default=1, help="GPUs the children take in turn (a machine of two: 2)")
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds a family at most")
    ap.add_argument("--shard", default=None, help="K/N: every N-th family of the sorted list from the K-th")
    ap.add_argument("--budget", type=float, default=float("inf"), help="start no family after this many seconds")
    ap.add_argument("--merge", nargs="+", default=None, help="shard files to join into --out")
    ap.add_argument("--skip", nargs="*", default=[], help="result files whose settled families are not run again")
    a = ap.parse_args()
    if a.merge:
        return merge(a.merge, a.out or ".")
    import json
    settled = {r["family"] for f in a.skip for r in json.loads(Path(f).read_text())["rows"]
               if r["status"] not in ("timeout", "not-run")}
    fams = [f for f in families(a.families, a.shard) if f not in settled]
    start = time.monotonic()
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # one intra-op thread a child: the children fill the cores
    rows = run_all(fams, a.cpu, a.jobs, a.timeout, lambda row: print(
        f"{row['family']:34s} {row['status']:8s} {row.get('kernel', ''):>3} {row.get('spec', ''):>3}  "
        f"err {row.get('rel_err', float('nan')):.1e} (eager {row.get('eager_rel_err', float('nan')):.1e}) "
        f"calls {row.get('calls_checked', 0)} worst/bound {row.get('worst_call_over_bound', float('nan')):.2f}  "
        f"{_short(row.get('why'))}", flush=True), a.budget,
                   str(Path(a.out) / "stacks") if a.out else None, a.gpus)
    if a.out:  # the stacks of the children killed past their time, in one file (empty files dropped)
        folder = Path(a.out) / "stacks"
        dumps = sorted(folder.glob("*.txt")) if folder.is_dir() else []
        text = "".join(f"== {f.stem}\n{f.read_text()}\n" for f in dumps if f.stat().st_size)
        for f in dumps:
            f.unlink()
        if folder.is_dir():
            folder.rmdir()
        if text:
            (Path(a.out) / "survey_stacks.txt").write_text(text)
    counts = collections.Counter(r["status"] for r in rows)
    total = round(time.monotonic() - start, 1)
    print(f"{len(rows)} families in {total} s: " + ", ".join(f"{n} {s}" for s, n in counts.most_common()))
    if a.out:
        sys.path.insert(0, str(HERE))
        from record import save
        import transformers
        print(save(a.out, "survey_families", {"device": "cpu" if a.cpu else "cuda", "transformers":
                                               transformers.__version__, "seconds": total,
                                               "counts": dict(counts), "shard": a.shard, "rows": rows}))


def _short(why) -> str:
    text = why[0] if isinstance(why, list) and why else why if isinstance(why, str) else ""
    text = " ".join(text.split("`: ")[-1].split())  # the refusal itself, past the line it names
    return text[:150]


if __name__ == "__main__":
    main()
