"""docs/architecture.md is drawn from the code: every top-level module and package of fastkit/ is in its layout, and
its import-layers table matches the imports (a package imports only from layers listed before it)."""

from __future__ import annotations

import re
from pathlib import Path

from tests.test_import_graph import ROOT, import_graph, package_graph

DOC = ROOT.parent / "docs" / "architecture.md"


def _block(text: str, heading: str) -> str:
    """The first fenced code block under ``## <heading>``."""
    section = text.split(f"## {heading}", 1)[1]
    return section.split("```", 2)[1]


def top_level(root: Path = ROOT) -> list[str]:
    """fastkit's top-level modules (``loader.py``) and packages (``families/``)."""
    modules = [p.name for p in root.glob("*.py")]
    packages = [f"{p.name}/" for p in root.iterdir() if (p / "__init__.py").is_file()]
    return sorted(modules + packages)


def missing_from_layout(text: str, root: Path = ROOT) -> list[str]:
    layout = _block(text, "Layout")
    words = set(re.findall(r"[\w.]+/?", layout))
    packages = {m.group(1) + "/" for m in re.finditer(r"^ {2}(\w+)/", layout, re.M)}  # drawn at the top level
    return [n for n in top_level(root) if (n not in packages if n.endswith("/") else n not in words)]


def layers(text: str) -> dict[str, int]:
    """The import-layers table: node (``fastkit.loader``; ``fastkit`` for the API) -> its layer."""
    out = {}
    for line in _block(text, "Import layers").splitlines():
        m = re.match(r"^(\d+)\s+(.*)$", line.strip())
        if not m:
            continue
        names = re.sub(r"\(.*?\)", "", m.group(2)).split("·")
        for name in (n.strip() for n in names if n.strip()):
            out["fastkit" if name == "fastkit" else f"fastkit.{name}"] = int(m.group(1))
    return out


def against_the_layers(table: dict[str, int], graph: dict[str, set[str]]) -> list[str]:
    """Nodes the table leaves out, and imports from a layer not listed before the importer's."""
    bad = [f"{n}: not in the table" for n in sorted(graph) if n not in table]
    for a in sorted(graph):
        for b in sorted(graph[a]):
            if b != "fastkit" and a in table and b in table and table[b] >= table[a]:
                bad.append(f"{a} (layer {table[a]}) imports {b} (layer {table[b]})")
    return bad


def test_every_top_level_module_and_package_is_in_the_layout():
    assert missing_from_layout(DOC.read_text()) == []


def test_the_import_layers_match_the_imports():
    assert against_the_layers(layers(DOC.read_text()), package_graph(import_graph())) == []


def test_the_checks_fail_on_a_module_left_out_and_an_import_against_the_layers(tmp_path):
    text = DOC.read_text()
    assert missing_from_layout(text.replace("loader.py", "loading.py")) == ["loader.py"]
    assert missing_from_layout(text.replace("  distributed/", "  several/")) == ["distributed/"]
    table = layers(text)
    assert table["fastkit.registry"] == 0 and table["fastkit.loader"] == table["fastkit"]
    graph = {"fastkit.registry": {"fastkit.export"}, "fastkit.export": {"fastkit.registry"}, "fastkit.new": set()}
    assert against_the_layers(table, graph) == ["fastkit.new: not in the table",
                                                "fastkit.registry (layer 0) imports fastkit.export (layer 4)"]
