"""The layout's rules, checked on the source: probes/ and policies/ are imported only
as greend.probes and greend.policies, the wheel installs one top-level name, and no
two of greend's packages import each other in a circle."""

from __future__ import annotations

import ast
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from .support import REPO

SOURCE_DIRS = ("greend", "probes", "policies", "tests", "bench")


def _modules() -> dict[str, Path]:
    """Every module of the product by its installed name (greend.probes.nvml, ...)."""
    out: dict[str, Path] = {}
    for top, prefix in (("greend", "greend"), ("probes", "greend.probes"), ("policies", "greend.policies")):
        for path in (REPO / top).rglob("*.py"):
            rel = path.relative_to(REPO / top).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([prefix, *parts])] = path
    return out


def _imports(path: Path, module: str) -> set[str]:
    """The greend modules that ``module`` imports anywhere in its file (lazy imports too:
    a function-level import that would be a cycle at the top is still a cycle)."""
    tree = ast.parse(path.read_text(), str(path))
    is_pkg = path.name == "__init__.py"
    package = module if is_pkg else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            found.add(name)
            found.update(f"{name}.{a.name}" for a in node.names)
    return {n for n in found if n.startswith("greend.")}


def test_probes_and_policies_are_never_imported_by_their_bare_names() -> None:
    bad = []
    for d in SOURCE_DIRS:
        for path in (REPO / d).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                names = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                bad += [
                    f"{path.relative_to(REPO)}:{node.lineno}: {n}"
                    for n in names
                    if n.split(".")[0] in ("probes", "policies")
                ]
    assert not bad, "import greend.probes / greend.policies instead:\n" + "\n".join(bad)


def _package_of(module: str, packages: set[str]) -> str:
    parts = module.split(".")
    for i in range(len(parts), 1, -1):
        if ".".join(parts[:i]) in packages:
            return ".".join(parts[:i])
    return module


def test_no_import_cycle_between_greends_packages() -> None:
    mods = _modules()
    # The units of the picture in docs/ARCHITECTURE.md: each subpackage, and each
    # top-level module (errors, protocol, config, ...). The root package greend itself
    # only re-exports, lazily, and is left out.
    packages = {m for m, p in mods.items() if p.name == "__init__.py" and m != "greend"}
    graph: dict[str, set[str]] = {}
    for mod, path in mods.items():
        if mod == "greend":
            continue
        src = _package_of(mod, packages)
        for target in _imports(path, mod):
            while target not in mods and "." in target:  # `from pkg import name`: the module is pkg
                target = target.rpartition(".")[0]
            if target in mods and target != "greend":
                dst = _package_of(target, packages)
                if dst != src:
                    graph.setdefault(src, set()).add(dst)
    cycles: list[list[str]] = []

    def visit(node: str, stack: list[str], on_stack: set[str], done: set[str]) -> None:
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt in on_stack:
                cycles.append(stack[stack.index(nxt) :] + [nxt])
            elif nxt not in done:
                visit(nxt, stack, on_stack, done)
        stack.pop()
        on_stack.discard(node)
        done.add(node)

    done: set[str] = set()
    for n in sorted(graph):
        if n not in done:
            visit(n, [], set(), done)
    assert not cycles, "import cycles between packages:\n" + "\n".join(" -> ".join(c) for c in cycles)


@pytest.mark.slow
def test_the_wheel_installs_one_top_level_name(tmp_path: Path) -> None:
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(REPO),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    (wheel,) = tmp_path.glob("greend-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert tops == {"greend"}
    assert "greend/probes/nvml.py" in names and "greend/policies/efficient.py" in names
    assert "greend/testing/harness.py" in names
