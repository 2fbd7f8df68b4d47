"""Every repository path and every swarm/planner/tiles module name that README.md and docs/*.md mention exists."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# swarm/wire/messages.py, deploy/swarm.service, tests/, examples/*cluster*.json; not /etc/swarm/swarm.toml
PATH = re.compile(r"(?<![\w./*-])((?:swarm|planner|tiles|bench|tests|examples|deploy|docs)/[\w./*-]*?"
                  r"(?:\.py|\.md|\.json|\.sh|\.cfg|\.service|/))(?![\w/*-])")
# inline `code` or a fenced block
CODE = re.compile(r"```.*?```|`[^`\n]+`", re.S)
# swarm.execution.replay.BACKUP_SHARE, "swarm.profiling.profiler:run_profile_job"
DOTTED = re.compile(r"(?<![\w./-])((?:swarm|planner|tiles)(?:[.:][A-Za-z_]\w*)+)")


def mentions(pattern: re.Pattern, text_of) -> list[tuple[str, str]]:
    """(document, match) for every match of `pattern` in each document's text_of(text)."""
    found = []
    for doc in DOCS:
        for text in text_of(doc.read_text()):
            found += [(doc.name, m) for m in pattern.findall(text)]
    return sorted(set(found))


def exists(path: str) -> bool:
    return any(ROOT.glob(path)) if "*" in path else (ROOT / path).exists()


def module_file(dotted: str) -> Path | None:
    """The file of module or package `dotted`, or None."""
    base = ROOT.joinpath(*dotted.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def top_level_names(path: Path) -> set[str]:
    """Names a module defines or imports at its top level."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def resolves(name: str) -> bool:
    """`name` is a module or package, or a module followed by a name defined in it (and its attributes)."""
    parts = name.replace(":", ".").split(".")
    for i in range(len(parts), 0, -1):
        path = module_file(".".join(parts[:i]))
        if path is not None:
            return i == len(parts) or parts[i] in top_level_names(path)
    return False


def test_the_docs_mention_something():
    assert len(mentions(PATH, lambda text: [text])) > 20
    assert len(mentions(DOTTED, CODE.findall)) > 10


@pytest.mark.parametrize("doc, path", mentions(PATH, lambda text: [text]))
def test_path_exists(doc, path):
    assert exists(path), f"{doc} mentions {path}, which is not in the repository"


@pytest.mark.parametrize("doc, name", mentions(DOTTED, CODE.findall))
def test_module_name_resolves(doc, name):
    assert resolves(name), f"{doc} mentions `{name}`, which names no module (or nothing in it)"
