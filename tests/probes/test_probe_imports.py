"""The probes' import arrows: the real NVML probe knows no simulator, and no two of the
probes' files import each other in a circle (lazy imports counted)."""

from __future__ import annotations

from tests.test_layout import _imports, _modules


def _probe_graph() -> dict[str, set[str]]:
    mods = {m: p for m, p in _modules().items() if m.startswith("greend.probes")}
    graph: dict[str, set[str]] = {}
    for mod, path in mods.items():
        for target in _imports(path, mod):
            while target not in mods and "." in target:  # `from pkg import name`: the module is pkg
                target = target.rpartition(".")[0]
            if target in mods and target != mod:
                graph.setdefault(mod, set()).add(target)
    return graph


def test_the_real_nvml_probe_imports_no_fake_and_no_simulator() -> None:
    graph = _probe_graph()
    for mod in ("greend.probes.nvml", "greend.probes.nvml_device"):
        bad = sorted(t for t in graph.get(mod, ()) if "fake" in t or "sim" in t.rpartition(".")[2])
        assert not bad, f"{mod} imports {bad}"


def test_no_import_circle_between_the_probes_files() -> None:
    graph = _probe_graph()
    cycles: list[list[str]] = []

    def visit(node: str, stack: list[str], done: set[str]) -> None:
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt in stack:
                cycles.append(stack[stack.index(nxt) :] + [nxt])
            elif nxt not in done:
                visit(nxt, stack, done)
        stack.pop()
        done.add(node)

    done: set[str] = set()
    for n in sorted(graph):
        if n not in done:
            visit(n, [], done)
    assert not cycles, "import circles:\n" + "\n".join(" -> ".join(c) for c in cycles)
