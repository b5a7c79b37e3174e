"""The offload package's layers: the planner is pure arithmetic (no torch, fla or transformers,
directly or through the flame modules it imports), and the runtime depends on the planner, never
the other way round. Read from the source (no import), so a violation is found without torch."""

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HEAVY = ("torch", "fla", "transformers", "triton")


def _module_file(name: str) -> str | None:
    """Source file of a flame module (package: its __init__.py), None outside flame."""
    if name != "flame" and not name.startswith("flame."):
        return None
    base = os.path.join(ROOT, *name.split("."))
    for path in (base + ".py", os.path.join(base, "__init__.py")):
        if os.path.isfile(path):
            return path
    return None


def imports_of(path: str, name: str) -> set[str]:
    """Every module `path` imports (top level or inside functions), as absolute dotted names."""
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            out.add(base)
            # `from flame.x import y` may name a submodule y
            out |= {f"{base}.{a.name}" for a in node.names if _module_file(f"{base}.{a.name}")}
    return out


def reachable(start: list[str]) -> dict[str, str]:
    """Every module reachable from `start` through flame's own imports: {module: who imports it}.
    Parent packages' __init__ are not followed (flame/__init__ registers model families with fla;
    the planner's modules do not use it)."""
    seen, todo = {}, [(m, "") for m in start]
    while todo:
        name, by = todo.pop()
        if name in seen:
            continue
        seen[name] = by
        path = _module_file(name)
        if path is not None:
            todo += [(m, name) for m in imports_of(path, name)]
    return seen


def planner_modules() -> list[str]:
    d = os.path.join(ROOT, "flame", "offload", "planner")
    return sorted(f"flame.offload.planner.{f[:-3]}" if f != "__init__.py" else "flame.offload.planner"
                  for f in os.listdir(d) if f.endswith(".py"))


def _chain(seen: dict[str, str], name: str) -> str:
    out = [name]
    while seen.get(out[-1]):
        out.append(seen[out[-1]])
    return " <- ".join(out)


def test_planner_imports_no_torch_fla_or_transformers():
    mods = planner_modules()
    assert "flame.offload.planner.solver" in mods and "flame.offload.planner.cost_model" in mods
    seen = reachable(mods)
    bad = [_chain(seen, m) for m in seen if m.split(".")[0] in HEAVY]
    assert not bad, "the planner reaches " + "; ".join(bad)
    # the planner never reaches up into the layers that execute or measure it
    up = [_chain(seen, m) for m in seen if m.startswith(("flame.offload.runtime", "flame.offload.measure"))]
    assert not up, "the planner imports " + "; ".join(up)


def test_the_import_walk_finds_torch(tmp_path, monkeypatch):
    """The walk follows flame's imports transitively: a module that reaches torch through another
    flame module is caught."""
    seen = reachable(["flame.offload.measure.tracing"])
    assert "torch" in seen
    seen = reachable(["flame.offload.calculator"])
    assert "torch" in seen and "flame.offload.planner.solver" in seen


@pytest.mark.parametrize("layer", ["runtime", "measure"])
def test_lower_layers_do_not_import_the_orchestration(layer):
    """runtime and measure import the planner (their contract), not flame.offload's entry points."""
    d = os.path.join(ROOT, "flame", "offload", layer)
    for f in sorted(os.listdir(d)):
        if f.endswith(".py"):
            name = f"flame.offload.{layer}.{f[:-3]}"
            imported = imports_of(os.path.join(d, f), name)
            assert not imported & {"flame.offload", "flame.offload.calculator"}, f"{name} imports {imported}"
