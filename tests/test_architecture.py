"""The package's shape: docs/architecture.md lists every module, and imports flow one way, from the inputs
through the cost model and the search to the market, the launchers, the charts and the command line."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "fasop"
# Each name's layer: a module may import from its own layer's package or from lower layers only.
LAYERS = {
    "fasop.errors": 0, "fasop.files": 1,
    "fasop.inputs": 3,
    # the roofline (a cost concept) needs only a model and a GPU spec; the profiles scale measured times by its
    # shape, and the rest of the cost model reads the profiles
    # what FP8 changes (which GPUs run it, casts, bytes) likewise; the roofline prices its GEMMs
    "fasop.cost.fp8": 3.2, "fasop.cost.roofline": 3.3, "fasop.inputs.profiles": 3.6,
    "fasop.cost": 4, "fasop.plans": 4,
    "fasop.search": 5, "fasop.profile": 5, "fasop.runtime": 5,
    "fasop.market": 6, "fasop.launch": 6, "fasop.calibration": 6,
    "fasop.chart": 6.5, "fasop.plot": 7, "fasop.timeline": 8, "fasop.report": 8.5,
    "fasop.cli": 9, "fasop": 10, "fasop.__main__": 10,
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def home(name: str) -> str:
    """The LAYERS key that holds module `name`: the longest prefix listed."""
    parts = name.split(".")
    return next(".".join(parts[:n]) for n in range(len(parts), 0, -1) if ".".join(parts[:n]) in LAYERS)


def fasop_imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.split(".")[0] == "fasop")
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "fasop":
            # `from fasop.inputs import bundled` imports the module fasop.inputs.bundled
            found.update(f"{node.module}.{alias.name}" if (PACKAGE.parent / node.module.replace(".", "/")
                                                            / f"{alias.name}.py").exists() else node.module
                         for alias in node.names)
    return found


MODULES = sorted(PACKAGE.rglob("*.py"))


def test_the_layers_cover_every_module():
    assert MODULES and all(home(module_name(path)) in LAYERS for path in MODULES)


def test_imports_flow_one_way():
    wrong = []
    for path in MODULES:
        importer = home(module_name(path))
        for imported in fasop_imports(path):
            target = home(imported)
            if target != importer and LAYERS[target] >= LAYERS[importer]:
                wrong.append(f"{module_name(path)} imports {imported}")
    assert not wrong


def test_architecture_page_lists_every_module_and_nothing_else():
    text = (ROOT / "docs" / "architecture.md").read_text()
    listed = set(re.findall(r"`(fasop/[\w/]+\.py)`", text))
    present = {str(path.relative_to(ROOT)) for path in MODULES if path.name != "__init__.py"}
    assert listed == present


def test_no_module_imports_itself_through_others():
    """No import cycle between modules, including imports inside functions (a cycle left to a late import
    still ties both modules together)."""
    graph = {module_name(path): {name for name in fasop_imports(path) if name != module_name(path)} for path in MODULES}
    cycles = []

    def visit(name: str, trail: list[str]) -> None:
        if name in trail:
            cycles.append(" -> ".join(trail[trail.index(name):] + [name]))
            return
        if name in done:
            return
        for imported in sorted(graph.get(name, ())):
            visit(imported, trail + [name])
        done.add(name)

    done: set[str] = set()
    for name in sorted(graph):
        visit(name, [])
    assert not cycles
