"""The package's layers hold: no module imports one of a higher layer (function-level imports
included), and no group of modules imports itself in a loop (scripts/import_graph.py)."""

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "import_graph.py"


@pytest.fixture(scope="module")
def import_graph():
    spec = importlib.util.spec_from_file_location("import_graph", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_no_module_imports_a_higher_layer(import_graph):
    bad = import_graph.upward_imports(import_graph.graph())
    assert not bad, "upward imports:\n" + "\n".join(
        f"  {module} (layer {import_graph.layer_of(module)}) imports {target} "
        f"(layer {import_graph.layer_of(target)}) at line {line}" for module, target, line in bad)


def test_no_import_cycle(import_graph):
    loops = import_graph.cycles(import_graph.graph())
    assert not loops, "import cycles:\n" + "\n".join(f"  {' -> '.join(loop)}" for loop in loops)


def test_every_module_has_a_layer(import_graph):
    """A new top-level module lands in the faces (layer 7) unless LAYERS places it: say where it belongs."""
    unplaced = [m for m in import_graph.graph() if m and m.split(".")[0] not in import_graph.LAYERS]
    assert not unplaced, f"modules missing from scripts/import_graph.py's LAYERS: {unplaced}"


def test_the_checker_catches_an_upward_import_and_a_cycle(import_graph, tmp_path):
    """The same functions on a file tree of their own: a ground module importing the cli through a
    function-level import, and two methods importing each other."""
    package = tmp_path / import_graph.PACKAGE
    (package / "methods").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "cli.py").write_text("import argparse\n")
    (package / "config.py").write_text("def parse():\n    from .cli import main\n")
    (package / "methods" / "__init__.py").write_text("")
    (package / "methods" / "a.py").write_text("from . import b\n")
    (package / "methods" / "b.py").write_text("from .a import thing\n")
    original = import_graph.ROOT
    import_graph.ROOT = package
    try:
        graph = import_graph.graph()
    finally:
        import_graph.ROOT = original
    assert import_graph.upward_imports(graph) == [("config", "cli", 2)]
    assert import_graph.cycles(graph) == [["methods.a", "methods.b"]]
