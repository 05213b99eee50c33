"""The layout's rules, checked on the source: probes/ and policies/ are imported only
as greend.probes and greend.policies, the wheel installs one top-level name, and no
two of greend's packages import each other in a circle."""

from __future__ import annotations

import ast
import functools
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


@functools.cache
def _tree(path: Path) -> ast.Module:
    """``path`` parsed, once for all the tests here (the trees are only read)."""
    return ast.parse(path.read_text(), str(path))


def _imports(path: Path, module: str) -> set[str]:
    """The greend modules that ``module`` imports anywhere in its file (lazy imports too:
    a function-level import that would be a cycle at the top is still a cycle)."""
    tree = _tree(path)
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
            text = path.read_text()
            if "probes" not in text and "policies" not in text:
                continue  # no import of either can be in it: not worth parsing
            for node in ast.walk(_tree(path)):
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


def _module_graph() -> dict[str, set[str]]:
    """Which of greend's modules each module imports (lazy and TYPE_CHECKING imports too).
    The root package ``greend`` only re-exports, lazily, and is left out."""
    mods = _modules()
    graph: dict[str, set[str]] = {}
    for mod, path in mods.items():
        if mod == "greend":
            continue
        for target in _imports(path, mod):
            while target not in mods and "." in target:  # `from pkg import name`: the module is pkg
                target = target.rpartition(".")[0]
            if target in mods and target not in ("greend", mod):
                graph.setdefault(mod, set()).add(target)
    return graph


def _package_graph() -> dict[str, set[str]]:
    """The same between the units of the picture in docs/ARCHITECTURE.md: each subpackage
    (greend.jobs, greend.probes, ...) and each top-level module (errors, protocol, ...)."""
    mods = _modules()
    packages = {m for m, p in mods.items() if p.name == "__init__.py" and m != "greend"}
    graph: dict[str, set[str]] = {}
    for src, targets in _module_graph().items():
        for target in targets:
            a, b = _package_of(src, packages), _package_of(target, packages)
            if a != b:
                graph.setdefault(a, set()).add(b)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
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
    return cycles


def test_no_import_cycle_between_greends_packages() -> None:
    cycles = _cycles(_package_graph())
    assert not cycles, "import cycles between packages:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_no_import_cycle_between_greends_files() -> None:
    # A lazy import inside a function, or one under TYPE_CHECKING, that closes a circle
    # is still a circle: the two files cannot be read, tested or moved one without the other.
    cycles = _cycles(_module_graph())
    assert not cycles, "import cycles between files:\n" + "\n".join(" -> ".join(c) for c in cycles)


def _drawn_arrows() -> dict[str, set[str]]:
    """The arrows listed in docs/ARCHITECTURE.md between its two markers, one line per
    package: ``jobs -> errors, points, protocol``."""
    text = (REPO / "docs" / "ARCHITECTURE.md").read_text()
    begin, end = "<!-- import-arrows:begin -->", "<!-- import-arrows:end -->"
    assert begin in text and end in text, f"docs/ARCHITECTURE.md has lost its {begin} ... {end} block"
    drawn: dict[str, set[str]] = {}
    for line in text.split(begin, 1)[1].split(end, 1)[0].splitlines():
        if "->" not in line:
            continue
        src, _, dsts = line.strip().partition("->")
        drawn[f"greend.{src.strip()}"] = {f"greend.{d.strip()}" for d in dsts.split(",") if d.strip()}
    return drawn


def test_architecture_draws_exactly_the_imports_between_packages() -> None:
    drawn, real = _drawn_arrows(), _package_graph()
    pairs = lambda g: {(a, b) for a, bs in g.items() for b in bs}  # noqa: E731 - a one-line helper
    undrawn = sorted(pairs(real) - pairs(drawn))
    gone = sorted(pairs(drawn) - pairs(real))
    short = lambda ab: f"{ab[0].removeprefix('greend.')} -> {ab[1].removeprefix('greend.')}"  # noqa: E731 - as above
    assert not undrawn, "imports that docs/ARCHITECTURE.md does not draw:\n" + "\n".join(map(short, undrawn))
    assert not gone, "arrows in docs/ARCHITECTURE.md that no import makes:\n" + "\n".join(map(short, gone))


def test_no_product_module_is_over_700_lines() -> None:
    long = {m: n for m, p in _modules().items() if (n := len(p.read_text().splitlines())) > 700}
    assert not long, f"split these by concept (one concept a file): {long}"


def test_the_real_nvml_probe_imports_no_fake_and_jobs_no_simulator_nor_socket() -> None:
    graph = _module_graph()
    for real in ("greend.probes.nvml", "greend.probes.nvml_device"):
        fakes = {m for m in graph.get(real, ()) if "fake" in m}
        assert not fakes, f"{real} imports {fakes}: the fake is injected from above, as the NVML module"
    for mod, targets in graph.items():
        if mod.startswith("greend.jobs"):
            bad = {t for t in targets if t.startswith("greend.probes.sim") or t == "greend.ipc.server"}
            assert not bad, f"{mod} imports {bad}: jobs/ gets the step executor injected and knows no socket"


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
