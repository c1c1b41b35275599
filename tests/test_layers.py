"""labsupport's layers are used in one direction, and what a cluster runs stays lean.

The layers, lowest first (README): launch, comm, models, parallel, estimate, measure,
viz, labs. A module may import its own layer and the ones below it, never one above.
``launch``, ``comm``, ``models`` and ``parallel`` are what a user takes to a cluster:
importing them (and running a rank) must not load matplotlib, ipywidgets or IPython.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "labsupport"
LAYERS = ["launch", "comm", "models", "parallel", "estimate", "measure", "viz", "labs"]
CLUSTER = ["launch", "comm", "models", "parallel"]
#: Modules allowed past ~300 lines, and why.
LONG = {
    "labs/lab04_one_device.py": "one lab, four techniques (accumulation, mixed precision, "
    "checkpointing, fusion), each with its experiment and exercise",
    "launch/launcher.py": "launch() and the loop that watches the ranks, read together",
    "estimate/datasheets.py": "one table per kind of hardware, each entry with its source",
}


def layer_of(path: Path) -> str:
    relative = path.relative_to(PACKAGE)
    if len(relative.parts) == 1:  # labsupport/__init__.py, labsupport/run.py: the launch layer
        return "launch"
    return relative.parts[0]


def imported_layers(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {n.split(".")[1] for n in names if n.startswith("labsupport.") and n.count(".") >= 1}


MODULES = sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_a_module_imports_only_its_layer_and_those_below(path):
    mine = LAYERS.index(layer_of(path))
    above = {
        layer for layer in imported_layers(path) if layer in LAYERS and LAYERS.index(layer) > mine
    }
    assert not above, f"{path.relative_to(PACKAGE)} ({LAYERS[mine]}) imports {sorted(above)}"


def _lab_number(module: str) -> str | None:
    """``"14"`` for ``labsupport.labs.lab14_zero`` (or ``lab14_zero.py``), else None."""
    name = module.rsplit(".", 1)[-1]
    return name[3:5] if name.startswith("lab") and name[3:5].isdigit() else None


LAB_MODULES = [p for p in MODULES if layer_of(p) == "labs" and _lab_number(p.stem)]


@pytest.mark.parametrize("path", LAB_MODULES, ids=lambda p: p.stem)
def test_a_lab_module_imports_no_other_labs_module(path):
    """What two labs share belongs in a core layer, not in one of the two labs."""
    tree = ast.parse(path.read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            imported.add(node.module)
            imported.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
    others = {
        m
        for m in imported
        if m.startswith("labsupport.labs.") and _lab_number(m) not in (None, _lab_number(path.stem))
    }
    assert not others, f"{path.stem} imports {sorted(others)}"


def test_every_module_belongs_to_a_layer():
    assert {layer_of(p) for p in MODULES} <= set(LAYERS)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_a_module_reads_in_one_sitting(path):
    name = str(path.relative_to(PACKAGE))
    lines = len(path.read_text().splitlines())
    assert lines <= 300 or (name in LONG and lines <= 400), f"{name}: {lines} lines"


def test_what_a_cluster_runs_never_loads_plotting_or_widgets():
    present = [
        f"labsupport.{layer}" for layer in CLUSTER if (PACKAGE / layer / "__init__.py").exists()
    ]
    code = (
        "import sys, importlib, pkgutil\n"
        f"for name in {present!r} + ['labsupport', 'labsupport.run']:\n"
        "    package = importlib.import_module(name)\n"
        "    for info in pkgutil.iter_modules(getattr(package, '__path__', [])):\n"
        "        importlib.import_module(f'{name}.{info.name}')\n"
        "print(sorted(m for m in ('matplotlib', 'ipywidgets', 'IPython') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
