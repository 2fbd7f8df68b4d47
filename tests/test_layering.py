"""Imports go one way (DESIGN.md section 2): tiles and planner never import swarm or trio;
tiles never imports planner (the planner imports tiles); planner is pure (no torch); the
transport layer never imports torch; no module of planner or tiles imports itself back
through others."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

RULES = {
    "tiles": {"swarm", "trio", "zeroconf", "msgpack", "planner"},
    "planner": {"swarm", "trio", "zeroconf", "msgpack", "torch"},
}
TRANSPORT = ["swarm/wire", "swarm/net", "swarm/discovery", "swarm/agent", "swarm/cluster", "swarm/membership",
             "swarm/state", "swarm/testbed"]  # files or packages, where they exist


def imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def test_packages_import_only_downwards():
    bad = []
    for package, forbidden in RULES.items():
        for path in (ROOT / package).rglob("*.py"):
            hits = imported_roots(path) & forbidden
            if hits:
                bad.append(f"{path.relative_to(ROOT)} imports {sorted(hits)}")
    assert not bad, bad


def test_transport_does_not_import_torch():
    bad = []
    for name in TRANSPORT:
        base = ROOT / name
        files = list(base.rglob("*.py")) if base.is_dir() else [p for p in [base.with_suffix(".py")] if p.exists()]
        for path in files:
            if "torch" in imported_roots(path):
                bad.append(str(path.relative_to(ROOT)))
    assert not bad, bad


def test_every_module_says_what_it_is_for():
    missing = []
    for package in ("swarm", "tiles", "planner"):
        for path in (ROOT / package).rglob("*.py"):
            tree = ast.parse(path.read_text())
            if path.stat().st_size and not ast.get_docstring(tree):
                missing.append(str(path.relative_to(ROOT)))
    assert not missing, missing


def package_modules(package: str) -> dict[str, Path]:
    """Dotted module name -> file, for every module of a package (its __init__ as the package)."""
    modules = {}
    for path in (ROOT / package).rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def imported_modules(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of `modules` that file `path` (module `name`) imports anywhere in it, inside
    functions too. `from pkg import x` counts as importing pkg.x when x is a submodule. An
    import of pkg.x counts as pkg.x only: that Python runs pkg's __init__ first is no circle."""
    def known(dotted: str) -> str | None:
        while dotted and dotted not in modules:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {known(a.name) for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                found.add(sub if sub in modules else known(base))
    return found - {None, name}


def import_circles(package: str) -> list[list[str]]:
    """Circles of imports among a package's modules: each as the modules around it, first again at the end."""
    modules = package_modules(package)
    graph = {name: sorted(imported_modules(name, path, modules)) for name, path in modules.items()}
    circles, state, path = [], {}, []  # state: 1 on the current path, 2 done

    def visit(name: str) -> None:
        state[name] = 1
        path.append(name)
        for nxt in graph[name]:
            if state.get(nxt) == 1:
                circles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        path.pop()
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name)
    return circles


@pytest.mark.parametrize("package", ["planner", "tiles"])
def test_no_import_circles_within_a_package(package):
    circles = import_circles(package)
    assert not circles, [" -> ".join(c) for c in circles]
