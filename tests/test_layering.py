"""Imports go one way (DESIGN.md section 2): tiles and planner never import swarm or trio;
planner is pure (no torch); the transport layer never imports torch."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

RULES = {
    "tiles": {"swarm", "trio", "zeroconf", "msgpack"},
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
