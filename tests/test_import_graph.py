"""fastkit's modules import each other without cycles, counting imports inside functions.

A function-level import that closes a cycle (``export.save`` -> ``export.gguf`` -> ``export.save``)
works at run time but hides a layering mistake: two modules that each need the other. The scan reads
every ``import`` statement of every file under ``fastkit/`` (module level and inside functions) and
finds strongly connected components of the module graph. The package ``__init__`` files are hubs that
re-export names; an edge to a package counts only when the name imported is defined in its
``__init__`` itself.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "fastkit"


def _modules(root: Path) -> dict[str, Path]:
    out = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _targets(node: ast.AST, modules: dict[str, Path], top: str) -> list[str]:
    """fastkit modules one ``import`` / ``from ... import`` statement depends on."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        names = [f"{node.module}.{a.name}" for a in node.names]  # a submodule, or a name in node.module
    else:
        return []
    found = (_resolve(n, modules) for n in names if n.split(".")[0] == top)
    return [t for t in found if t is not None and t != top]  # the package root re-exports everything


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    modules = _modules(root)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            graph[name].update(t for t in _targets(node, modules, root.name) if t != name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_fastkit_has_no_import_cycles():
    assert cycles(import_graph()) == []


def test_the_scan_finds_a_function_level_cycle(tmp_path):
    pkg = tmp_path / "fastkit"
    (pkg / "export").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from fastkit.export.save import save\n")
    (pkg / "export" / "__init__.py").write_text("")
    (pkg / "export" / "save.py").write_text("def save():\n    from fastkit.export.gguf import write\n")
    (pkg / "export" / "gguf.py").write_text("def write():\n    from fastkit.export import save\n")
    (pkg / "export" / "merge.py").write_text("from fastkit.export.gguf import write\n")
    assert cycles(import_graph(pkg)) == [["fastkit.export.gguf", "fastkit.export.save"]]


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The module graph with each subpackage of fastkit (``fastkit.export``, every ``fastkit.patches.*``
    together) as one node: the import layers docs/architecture.md draws."""
    def node(module: str) -> str:
        parts = module.split(".")
        return "fastkit.patches" if parts[1:2] == ["patches"] else ".".join(parts[:2])

    out: dict[str, set[str]] = {}
    for a, targets in graph.items():
        out.setdefault(node(a), set()).update(node(b) for b in targets if node(b) != node(a))
    return out


def test_fastkit_packages_form_layers():
    """No package imports one that imports it back (no upward import between the stages: a dashboard
    that imported the loader for ``report`` closed loader -> families -> export -> dashboard -> loader)."""
    assert cycles(package_graph(import_graph())) == []


# A private name (``_x``) is its module's own: another package reaches it only through a public name. The compat
# layers (``fastkit._hf``, ``_torch``, ``_stdlib``, ``_quiet``) and ``_lazy`` are private *modules*, imported whole.
# TEMPORARY: the options engineer's branch (issue 55, item 3) gives these training.options helpers public names; the
# lead empties this at merge.
def _package(module: str) -> str:
    return ".".join(module.split(".")[:2])


def private_imports(root: Path = ROOT) -> list[tuple[str, str, str]]:
    """``(importer, module, name)`` of every ``from <fastkit module> import _name`` across packages."""
    modules = _modules(root)
    found = []
    for importer, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.ImportFrom) and node.module and node.level == 0
                    and node.module.split(".")[0] == root.name):
                continue
            for alias in node.names:
                private = alias.name.startswith("_") and not alias.name.startswith("__")
                if private and f"{node.module}.{alias.name}" not in modules and (
                        _package(node.module) != _package(importer) or node.module == root.name):
                    found.append((importer, node.module, alias.name))
    return found


def test_no_private_name_is_imported_across_packages():
    assert private_imports() == []


def test_the_scan_finds_a_private_name_across_packages(tmp_path):
    pkg = tmp_path / "fastkit"
    for sub in ("plan", "families"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "_hf.py").write_text("")
    (pkg / "plan" / "source.py").write_text("def _config_from_dict(v):\n    return v\n")
    (pkg / "plan" / "planner.py").write_text("from fastkit.plan.source import _config_from_dict\n")  # same package
    (pkg / "families" / "load.py").write_text("from fastkit import _hf\n\ndef f():\n"
                                              "    from fastkit.plan.source import _config_from_dict\n")
    assert private_imports(pkg) == [("fastkit.families.load", "fastkit.plan.source", "_config_from_dict")]
