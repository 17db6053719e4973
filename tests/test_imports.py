"""The import graph, read statically (every module parsed with ast, imports inside functions too):
the library imports only downward and never the tools; the tools have no import cycle."""
from __future__ import annotations

import ast
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("tabby", "tabby_bench")


def _modules() -> dict:
    """{module name: path} of every .py file of the packages."""
    out = {}
    for pkg in PACKAGES:
        for root, dirs, files in os.walk(os.path.join(REPO, pkg)):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            for f in files:
                if f.endswith(".py"):
                    parts = os.path.relpath(os.path.join(root, f), REPO)[:-3].split(os.sep)
                    if parts[-1] == "__init__":
                        parts = parts[:-1]
                    out[".".join(parts)] = os.path.join(root, f)
    return out


MODULES = _modules()


def _is_package(name: str) -> bool:
    return MODULES.get(name, "").endswith("__init__.py")


def imports_of(name: str) -> set:
    """Absolute names of the modules ``name`` imports (``from pkg import sub`` counts as pkg.sub
    where sub is a module, else as pkg)."""
    tree = ast.parse(open(MODULES[name]).read(), MODULES[name])
    here = name if _is_package(name) else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.split(".")
                base = base[:len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module
            for a in node.names:
                sub = f"{mod}.{a.name}"
                out.add(sub if sub in MODULES else mod)
    return out


def _ours(mod: str, pkg: str) -> bool:
    return mod == pkg or mod.startswith(pkg + ".")


def test_the_packages_are_found():
    assert {"tabby", "tabby.functional.moe", "tabby.ops", "tabby.validate", "tabby_bench.bench",
            "tabby_bench.cli"} <= set(MODULES)


def test_the_library_never_imports_the_tools():
    bad = {m: sorted(i for i in imports_of(m) if _ours(i, "tabby_bench")) for m in MODULES if _ours(m, "tabby")}
    assert not {m: v for m, v in bad.items() if v}


# Below the ops: the input checks, the choice of compiled or interpreted kernels and the experts'
# activation spec.
BASE = {"tabby.validate": set(), "tabby._runtime": {"tabby.validate"}, "tabby.activation": {"tabby.validate"}}


def test_ops_import_only_ops():
    bad = {}
    for m in MODULES:
        if _ours(m, "tabby.ops"):
            wrong = sorted(i for i in imports_of(m) if _ours(i, "tabby") and not _ours(i, "tabby.ops")
                           and i not in BASE)
            if wrong:
                bad[m] = wrong
    assert not bad


@pytest.mark.parametrize("base", sorted(BASE))
def test_the_base_modules_import_only_below_them(base):
    if base not in MODULES:
        pytest.skip(f"no {base}")
    mine = {i for i in imports_of(base) if _ours(i, "tabby") or _ours(i, "tabby_bench")}
    assert mine <= BASE[base]


def _cycles(nodes: list, edges=imports_of) -> list:
    """The strongly connected components of more than one module (Tarjan)."""
    graph = {m: sorted(i for i in edges(m) if i in nodes and i != m) for m in nodes}
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in nodes:
        if v not in index:
            visit(v)
    return out


@pytest.mark.parametrize("pkg", ["tabby.functional", "tabby_bench"])
def test_no_import_cycle(pkg):
    nodes = [m for m in MODULES if _ours(m, pkg)]
    assert len(nodes) > 3
    assert _cycles(nodes) == []


def test_the_cycle_finder_finds_one():
    fake = {"p.a": {"p.b"}, "p.b": {"p.c"}, "p.c": {"p.a"}, "p.d": {"p.a"}}
    assert _cycles(list(fake), fake.__getitem__) == [["p.a", "p.b", "p.c"]]
