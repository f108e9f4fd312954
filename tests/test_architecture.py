"""The shape of the tree: no import cycle between any two modules, small modules, a small agents/ top.

The layers themselves are import-linter contracts (pyproject.toml, run by scripts/check.sh); this test
adds what those contracts do not say: a cycle through any modules at all (lazy and TYPE_CHECKING imports
count), and the size rules of the architecture issue.
"""

from __future__ import annotations

from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("geosched", "planner", "agents")
MAX_MODULE_LINES = 500
MAX_AGENTS_TOP_MODULES = 6


def import_cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Every strongly connected set of two or more modules (Tarjan, iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    cycles: list[list[str]] = []
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.find_modules_directly_imported_by(child)))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                members = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    members.append(member)
                    if member == node:
                        break
                if len(members) > 1:
                    cycles.append(sorted(members))
    return cycles


def test_cycle_finder_sees_a_planted_cycle() -> None:
    graph = grimp.ImportGraph()
    for a, b in (("p.a", "p.b"), ("p.b", "p.c"), ("p.c", "p.a"), ("p.c", "p.d")):
        graph.add_import(importer=a, imported=b)
    assert import_cycles(graph) == [["p.a", "p.b", "p.c"]]


def test_no_import_cycles_between_any_modules() -> None:
    graph = grimp.build_graph(*PACKAGES)
    assert len(graph.modules) > 50  # the graph really holds the tree
    cycles = import_cycles(graph)
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_every_module_is_at_most_500_lines() -> None:
    sizes = {
        str(path.relative_to(ROOT)): len(path.read_text(encoding="utf-8").splitlines())
        for folder in (*PACKAGES, "benchmarks", "tests", "scripts")
        for path in (ROOT / folder).rglob("*.py")
    }
    assert len(sizes) > 100
    too_big = {name: lines for name, lines in sizes.items() if lines > MAX_MODULE_LINES}
    assert not too_big, f"modules over {MAX_MODULE_LINES} lines (split them by concern): {too_big}"


def test_agents_top_level_stays_small_and_every_package_says_what_it_owns() -> None:
    agents = ROOT / "agents"
    top = sorted(p.name for p in agents.glob("*.py") if p.name != "__init__.py")
    assert len(top) <= MAX_AGENTS_TOP_MODULES, top
    for init in [ROOT / pkg / "__init__.py" for pkg in PACKAGES] + sorted(agents.glob("*/__init__.py")):
        text = init.read_text(encoding="utf-8")
        assert text.startswith('"""') and len(text.split('"""')[1].split()) >= 20, f"{init}: no docstring"
