"""The import graph of ``fixes`` and ``ci``, and the layering rules they must keep.

    python -m ci.tools.imports [ROOT]    # the graph's summary and every violation; exit 1 if any

``fixes`` layers, lowest first:

* **framework** — ``fixes/*.py`` (and ``fixes/entries/__init__.py``): what ``import fixes``,
  ``fixes.apply()`` and ``fixbook`` load. Imports no entry and no harness module.
* **entry fix** — ``fixes/entries/<id>/__init__.py`` and the modules it imports: the fix and its
  probe; and ``trigger.py``, the jobs that hit the bug (``fixes.check`` and ``fixbook doctor --config`` load it).
  Imports the framework only: never the harness, never its own ``reproduce.py``.
* **harness** — ``fixes/harness/``: reproduction code two or more entries share. Imports the
  framework, never an entry.
* **entry reproduction** — the rest of ``fixes/entries/<id>/``: imports the framework, the
  harness and its own entry, never another entry.

``fixes`` is the runtime package a training job imports: no module of it imports ``ci``.

``ci`` packages, lowest first, as ``CI_ORDER`` lists them (``ci/__init__.py`` says what each owns): a module of
one imports only its own package, the packages before it and ``ci`` itself (``ROOT``); ``ci/__init__.py`` imports
no package. The packages of ``CI_APART`` (the developer tools) may import any, and none imports them. Every ci
module sits in one of these packages: a new flat module under ``ci/`` is reported.

There is no circle anywhere. The graph is read from the source (``ast``), every import (top-level
or inside a function) counted, so a lazy import is no way around a rule. Run on an older checkout
(one whose entries were ``fixes/<id>.py``, defining ``FIX``) it classifies those the same way, so
before/after graphs compare.
"""
from __future__ import annotations

import ast
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from .. import ROOT

CI_ORDER = ("processes", "releases", "notebooks", "sweep", "differential", "triage", "site", "bench")  # lowest first
CI_APART = ("tools",)  # may import any ci package; none imports them


@dataclass
class Graph:
    modules: dict[str, Path]  # dotted name -> file
    edges: set[tuple[str, str]] = field(default_factory=set)

    def layer(self, module: str) -> str:
        return classify(module, self.modules[module])

    def entry(self, module: str) -> str | None:
        """The entry a module belongs to, or None."""
        parts = module.split(".")
        if parts[:2] == ["fixes", "entries"] and len(parts) > 2:
            return parts[2]
        if _defines_fix(self.modules[module]):
            return parts[-1]
        return None


def _defines_fix(path: Path) -> bool:
    try:
        tree = ast.parse(path.read_text())
    except (OSError, SyntaxError):
        return False
    return any(isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "FIX" for t in node.targets)
               for node in tree.body)


def classify(module: str, path: Path) -> str:
    parts = module.split(".")
    if parts[0] == "ci":
        return "ci" if len(parts) == 1 else f"ci.{parts[1]}"
    if parts[:2] == ["fixes", "harness"]:
        return "harness"
    if parts[:2] == ["fixes", "entries"] and len(parts) > 2:
        return "entry"
    if _defines_fix(path):
        return "entry"
    return "framework"


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def build(root: Path = ROOT) -> Graph:
    """Every module under ``root/fixes`` and ``root/ci``, and every import between two of them."""
    files = sorted((root / "fixes").rglob("*.py")) + sorted((root / "ci").rglob("*.py"))
    graph = Graph({_module_name(path, root): path for path in files})
    for name, path in graph.modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[:len(base) - (node.level - 1)]
                    stem = ".".join(base + ([node.module] if node.module else []))
                else:
                    stem = node.module or ""
                # ``from pkg import sub`` imports the submodule where one exists
                targets = [f"{stem}.{alias.name}" if f"{stem}.{alias.name}" in graph.modules else stem
                           for alias in node.names]
            for target in targets:
                while target and target not in graph.modules:
                    target = target.rpartition(".")[0]
                if target and target != name and target != "fixes":
                    graph.edges.add((name, target))
    return graph


def violations(graph: Graph) -> list[str]:
    """Every import that breaks a layering rule, and every circle."""
    problems = []
    fix_side = _fix_side(graph)
    problems += [f"ci module {m} is in no package of the order (ci.tools.imports.CI_ORDER, CI_APART)"
                 for m in sorted(graph.modules) if _ci_rank(graph.layer(m)) is None]
    for source, target in sorted(graph.edges):
        s_layer, t_layer = graph.layer(source), graph.layer(target)
        s_entry, t_entry = graph.entry(source), graph.entry(target)
        if s_layer.startswith("ci") or t_layer.startswith("ci"):
            problems += _ci_problems(source, s_layer, target, t_layer)
        elif s_layer == "framework" and t_layer in ("entry", "harness"):
            problems.append(f"framework {source} imports {t_layer} {target}")
        elif s_layer == "harness" and t_layer == "entry":
            problems.append(f"harness {source} imports entry {target}")
        elif s_entry and t_entry and s_entry != t_entry:
            problems.append(f"entry {s_entry} ({source}) imports another entry's {target}")
        elif source in fix_side and (t_layer == "harness" or target.endswith(".reproduce")):
            problems.append(f"fix-side {source} (loaded by the fix or its probe) imports {target}")
    problems += [f"circle: {' -> '.join(cycle)}" for cycle in cycles(graph)]
    return problems


def _ci_rank(layer: str) -> int | None:
    """Where a layer sits in the ci order: -1 for ``ci`` itself, then ``CI_ORDER``'s index, ``CI_APART`` above all;
    0 for a ``fixes`` layer (not ranked here); None for a ci module in no known package."""
    if not layer.startswith("ci"):
        return 0
    if layer == "ci":
        return -1
    name = layer.removeprefix("ci.")
    if name in CI_ORDER:
        return CI_ORDER.index(name)
    return len(CI_ORDER) if name in CI_APART else None


def _ci_problems(source: str, s_layer: str, target: str, t_layer: str) -> list[str]:
    """What an import that touches ``ci`` breaks: fixes importing ci, or a ci package importing one above it."""
    if not s_layer.startswith("ci"):
        return [f"fixes {source} imports {target}: the runtime package never imports ci"]
    if not t_layer.startswith("ci") or s_layer == t_layer:
        return []
    s_rank, t_rank = _ci_rank(s_layer), _ci_rank(t_layer)
    if s_rank is None or t_rank is None or s_layer.removeprefix("ci.") in CI_APART:
        return []  # a module in no package is reported once, by itself; the tools may import any
    if t_rank > s_rank:
        return [f"{s_layer} ({source}) imports {t_layer} ({target}), above it in the order {' < '.join(CI_ORDER)}"]
    return []


def _fix_side(graph: Graph) -> set[str]:
    """The modules an entry's fix loads: its ``__init__`` and what that imports within the entry."""
    found: set[str] = set()
    todo = [m for m in graph.modules if graph.layer(m) == "entry" and
            (graph.modules[m].name in ("__init__.py", "trigger.py") or not m.startswith("fixes.entries."))]
    while todo:
        module = todo.pop()
        if module in found:
            continue
        found.add(module)
        todo += [t for s, t in graph.edges if s == module and graph.entry(t) == graph.entry(module)
                 and not t.endswith(".reproduce") and graph.layer(t) == "entry"]
    return found


def cycles(graph: Graph) -> list[list[str]]:
    """One path per strongly connected component of more than one module (Tarjan)."""
    adjacency: dict[str, list[str]] = {m: [] for m in graph.modules}
    for source, target in graph.edges:
        adjacency[source].append(target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(adjacency[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                components.append(sorted(component) + [sorted(component)[0]])

    sys.setrecursionlimit(max(10000, sys.getrecursionlimit()))
    for node in sorted(adjacency):
        if node not in index:
            visit(node)
    return components


def summary(graph: Graph) -> str:
    layers = Counter(graph.layer(m) for m in graph.modules)
    lines = Counter()
    for module, path in graph.modules.items():
        lines[graph.layer(module)] += len(path.read_text().splitlines())
    between = Counter(f"{graph.layer(s)} -> {'its own entry' if graph.entry(s) and graph.entry(s) == graph.entry(t) else graph.layer(t)}"
                      for s, t in graph.edges)
    out = [f"{len(graph.modules)} modules, {len(graph.edges)} imports"]
    out += [f"  {layer}: {layers[layer]} modules, {lines[layer]} lines" for layer in sorted(layers)]
    out += [f"  imports {kind}: {count}" for kind, count in sorted(between.items())]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    root = Path(args[0]).resolve() if args else ROOT
    graph = build(root)
    problems = violations(graph)
    print(summary(graph))
    print(f"{len(problems)} layering problems, {len(cycles(graph))} circles")
    for problem in problems:
        print(f"  {problem}")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
