"""The package's shape: production code never imports the testing module; modules stay small."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "runner_fsm"
MODULES = sorted(PACKAGE.rglob("*.py"))
PRODUCTION = [p for p in MODULES if "testing" not in p.relative_to(PACKAGE).parts]


def _imported(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_the_package_has_a_testing_module_and_production_code():
    assert (PACKAGE / "testing" / "fakes.py") in MODULES
    assert (PACKAGE / "replica" / "replica.py") in PRODUCTION and len(PRODUCTION) > 50


@pytest.mark.parametrize("path", PRODUCTION, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_production_never_imports_the_testing_module(path):
    testing = sorted(n for n in _imported(path) if n == "runner_fsm.testing" or n.startswith("runner_fsm.testing."))
    assert testing == [], f"{path.relative_to(PACKAGE)} imports {testing}"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_module_over_350_lines(path):
    assert len(path.read_text().splitlines()) <= 350
