"""No import cycles inside ``src/moeserve`` (imports inside functions count; imports under
``if TYPE_CHECKING:`` are type hints only and do not)."""

import ast
from pathlib import Path

import moeserve

ROOT = Path(moeserve.__file__).parent


def module_graph() -> dict[str, set[str]]:
    mods = {}
    for p in ROOT.rglob("*.py"):
        parts = p.relative_to(ROOT.parent).with_suffix("").parts
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p

    def resolve(name: str) -> str:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name

    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, p in mods.items():
        tree = ast.parse(p.read_text())
        for n in ast.walk(tree):
            if isinstance(n, ast.If) and getattr(n.test, "id", getattr(n.test, "attr", "")) == "TYPE_CHECKING":
                n.body = []
        for n in ast.walk(tree):
            targets = []
            if isinstance(n, ast.ImportFrom) and n.module and n.module.startswith("moeserve"):
                targets = [f"{n.module}.{a.name}" if f"{n.module}.{a.name}" in mods else n.module for a in n.names]
            elif isinstance(n, ast.Import):
                targets = [a.name for a in n.names if a.name.startswith("moeserve")]
            graph[m].update(t for t in map(resolve, targets) if t and t != m)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(v: str) -> list[str] | None:
        state[v] = 1
        path.append(v)
        for w in sorted(graph[v]):
            if state.get(w) == 1:
                return path[path.index(w) :] + [w]
            if w not in state and (found := visit(w)):
                return found
        path.pop()
        state[v] = 2
        return None

    for v in sorted(graph):
        if v not in state and (found := visit(v)):
            return found
    return None


def test_no_import_cycles_inside_the_package():
    graph = module_graph()
    assert len(graph) > 50  # the walk found the package
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def test_the_check_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
