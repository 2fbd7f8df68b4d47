"""Imports go one way over the whole tree (docs/architecture.md): every module of swarm, planner
and tiles sits in a layer of LAYERS and imports only its own layer or lower ones; swarm's root
holds only the package face; no modules import each other round in a circle; tiles and planner
never import swarm, trio, zeroconf or msgpack; tiles never imports planner; planner is pure (no
torch); the transport layer never imports torch; every module says what it is for. Each check
also runs on a small fake tree with a fault put in, to show that it can fail."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("swarm", "planner", "tiles")

LAYERS = [  # lowest first; a module is in the layer of its longest matching prefix
    # the package face: version, the user-error type, named bounds, the agent's default port
    ["swarm", "swarm.errors", "swarm.limits", "swarm.ports"],
    ["tiles"],
    ["planner"],
    ["swarm.wire"],
    ["swarm.host", "swarm.service"],
    ["swarm.net"],
    ["swarm.agent"],
    ["swarm.cluster"],
    ["swarm.data", "swarm.zoo"],
    ["swarm.local"],
    # the workers' messaging and collectives, which the profile job times (swarm.profiling.reduction)
    ["swarm.execution.mailbox", "swarm.execution.endpoint", "swarm.execution.channels",
     "swarm.execution.collectives"],
    ["swarm.profiling"],
    ["swarm.execution"],
    ["swarm.testbed"],
    ["swarm.commands"],
    ["swarm.cli", "swarm.__main__"],
]
RANK = {prefix: rank for rank, layer in enumerate(LAYERS) for prefix in layer}

RULES = {
    "tiles": {"swarm", "trio", "zeroconf", "msgpack", "planner"},
    "planner": {"swarm", "trio", "zeroconf", "msgpack", "torch"},
}
TRANSPORT = ["swarm/wire", "swarm/net", "swarm/agent", "swarm/cluster", "swarm/host", "swarm/service",
             "swarm/testbed"]


def parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def tree_modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every module of swarm, planner and tiles (an __init__ as its package)."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def imported_roots(path: Path) -> set[str]:
    """The top-level names of the absolute imports in a file, inside functions too."""
    roots = set()
    for node in ast.walk(parse(path)):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


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
    for node in ast.walk(parse(path)):
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


def import_graph(root: Path) -> dict[str, list[str]]:
    """Module -> the tree's modules it imports."""
    modules = tree_modules(root)
    return {name: sorted(imported_modules(name, path, modules)) for name, path in modules.items()}


def layer_of(name: str) -> str | None:
    """The longest prefix of LAYERS that is `name` or a package above it; None for none. Bare
    "swarm" matches swarm/__init__.py only: a loose module in swarm's root belongs to no layer."""
    matches = [p for p in RANK if name == p or (name.startswith(p + ".") and p != "swarm")]
    return max(matches, key=len, default=None)


def loose_modules(root: Path) -> list[str]:
    """The modules that belong to no layer."""
    return [f"{path.relative_to(root)} belongs to no layer"
            for name, path in tree_modules(root).items() if layer_of(name) is None]


def layer_violations(root: Path) -> list[str]:
    """Every import of a module in a higher layer than the importer's."""
    modules, bad = tree_modules(root), []
    for name, imports in import_graph(root).items():
        mine = layer_of(name)
        for other in imports:
            theirs = layer_of(other)
            if mine and theirs and RANK[theirs] > RANK[mine]:
                bad.append(f"{modules[name].relative_to(root)} ({mine}) imports {other} ({theirs})")
    return bad


def import_circles(root: Path) -> list[str]:
    """Circles of imports among all the tree's modules, each as "a -> b -> a"."""
    graph = import_graph(root)
    circles, state, path = [], {}, []  # state: 1 on the current path, 2 done

    def visit(name: str) -> None:
        state[name] = 1
        path.append(name)
        for nxt in graph[name]:
            if state.get(nxt) == 1:
                circles.append(" -> ".join(path[path.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt)
        path.pop()
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name)
    return circles


def forbidden_imports(root: Path) -> list[str]:
    """Files of tiles and planner that import what RULES forbids them."""
    bad = []
    for package, forbidden in RULES.items():
        for path in sorted((root / package).rglob("*.py")):
            hits = imported_roots(path) & forbidden
            if hits:
                bad.append(f"{path.relative_to(root)} imports {sorted(hits)}")
    return bad


def torch_in_transport(root: Path) -> list[str]:
    """Files of the transport layer that import torch."""
    return [f"{path.relative_to(root)} imports torch" for name in TRANSPORT
            for path in sorted((root / name).rglob("*.py")) if "torch" in imported_roots(path)]


def missing_docstrings(root: Path) -> list[str]:
    """Non-empty files with no docstring."""
    return [f"{path.relative_to(root)} has no docstring" for path in tree_modules(root).values()
            if path.stat().st_size and not ast.get_docstring(parse(path))]


CHECKS = [layer_violations, loose_modules, import_circles, forbidden_imports, torch_in_transport,
          missing_docstrings]


@pytest.mark.parametrize("check", CHECKS, ids=lambda check: check.__name__)
def test_the_tree_keeps_the_rule(check):
    problems = check(ROOT)
    assert not problems, "\n".join(problems)


FAKE = {  # a clean fake tree: a downward import across layers, and planner over tiles
    "swarm/__init__.py": "",
    "swarm/wire/__init__.py": "",
    "swarm/wire/x.py": "import swarm",
    "swarm/net/__init__.py": "",
    "swarm/net/y.py": "from swarm.wire import x",
    "tiles/__init__.py": "",
    "planner/__init__.py": "import tiles",
}
UPWARD = "swarm/wire/x.py (swarm.wire) imports swarm.net.y (swarm.net)"
FAULTS = [  # files written over the fake tree, the check that must see it, what it says
    ({"swarm/wire/x.py": "import swarm.net.y"}, layer_violations, UPWARD),
    ({"swarm/wire/x.py": "def f():\n    from swarm.net import y"}, layer_violations, UPWARD),
    ({"swarm/net/z.py": "from . import y", "swarm/net/y.py": "from swarm.net import z"}, import_circles,
     "swarm.net.y -> swarm.net.z -> swarm.net.y"),
    ({"swarm/host/__init__.py": "", "swarm/host/a.py": "from swarm.service import b",
      "swarm/service/__init__.py": "", "swarm/service/b.py": "def f():\n    import swarm.host.a"},
     import_circles, "swarm.host.a -> swarm.service.b -> swarm.host.a"),
    ({"swarm/foo.py": ""}, loose_modules, "swarm/foo.py belongs to no layer"),
]


def write_tree(root: Path, files: dict[str, str]) -> None:
    """The fake tree with `files` written over it, each file with a docstring."""
    for name, body in {**FAKE, **files}.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(f'"""Fake {name}."""\n{body}\n')


def test_a_clean_fake_tree_passes(tmp_path):
    write_tree(tmp_path, {})
    assert [check(tmp_path) for check in CHECKS] == [[] for _ in CHECKS]


@pytest.mark.parametrize("files, check, problem", FAULTS, ids=["upward", "upward-in-a-function",
                         "circle-in-a-package", "circle-across-packages", "loose-root-module"])
def test_a_fault_put_in_is_reported(tmp_path, files, check, problem):
    write_tree(tmp_path, files)
    assert check(tmp_path) == [problem]
