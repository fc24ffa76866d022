"""The architecture the README promises: one module owns the stage order, and imports form no cycle.

Every import counts, also those inside functions: a lazy import is still a
dependency, and a cycle hidden in a function is still a cycle.
"""
import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "torch_cubridge"


def _module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    me = _module_name(path)
    pkg = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out = set()
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for blk in ast.walk(tree) if isinstance(blk, ast.If) and "TYPE_CHECKING" in ast.unparse(blk.test)
                   for stmt in blk.body for n in ast.walk(stmt)}
    for node in ast.walk(tree):
        if id(node) in typing_only:  # imports for annotations only are no runtime dependency
            continue
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.startswith("torch_cubridge"):
                out.add(mod)
                out.update(f"{mod}.{a.name}" for a in node.names)  # `from . import x` may name a module
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("torch_cubridge"))
    return out


def _graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in PKG.rglob("*.py")}
    graph = {}
    for name, path in files.items():
        deps = {d for d in _imports(path) if d in files and d != name}
        # a package's __init__ re-exports its children: a child importing its own package is not a cycle
        graph[name] = {d for d in deps if not name.startswith(d + ".")}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for d in sorted(graph.get(n, ())):
            if state.get(d) == 1:
                return stack[stack.index(d):] + [d]
            if d not in state:
                found = visit(d)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return None
    for n in sorted(graph):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def test_no_import_cycles():
    cyc = _cycle(_graph())
    assert cyc is None, " -> ".join(cyc)


def test_the_detector_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_one_module_owns_the_stage_order():
    """Only the pipeline calls the stages; compile and api reach them through it."""
    graph = _graph()
    stage_entry = {"torch_cubridge.capture.trace", "torch_cubridge.transfer", "torch_cubridge.verify.cpu",
                   "torch_cubridge.transfer.generalize"}
    for user in ("torch_cubridge.compile", "torch_cubridge.api", "torch_cubridge.integrations.transformers"):
        direct = graph[user] & stage_entry - {"torch_cubridge.capture.trace"}
        assert not direct, f"{user} calls stages directly: {direct}"
    assert "torch_cubridge.pipeline" not in set().union(*(graph[m] for m in graph if m.startswith(
        ("torch_cubridge.capture", "torch_cubridge.transfer", "torch_cubridge.verify", "torch_cubridge.lower",
         "torch_cubridge.build", "torch_cubridge.cache", "torch_cubridge.ops", "torch_cubridge.ir"))))
