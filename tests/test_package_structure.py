"""The package's shape, read from its source: which parts import which, and how long modules and classes get.

A part is a folder directly under megatron_dppo/ or a module at its root. Every import counts, also one inside a
function: a lazy import is still a dependency, and two parts that import each other cannot be read, tested or moved
one without the other.
"""

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "megatron_dppo"
MAX_MODULE_LINES = 600
MAX_CLASS_LINES = 250


def part_of(module: str) -> str | None:
    """'megatron_dppo.rollout.client' -> 'rollout'; None outside the package or for the package itself."""
    names = module.split(".")
    if names[0] != "megatron_dppo" or len(names) < 2:
        return None
    return names[1] if (PACKAGE / names[1]).is_dir() or (PACKAGE / f"{names[1]}.py").is_file() else None


def imported_modules(path: Path, root: Path = REPO) -> set[str]:
    """Absolute names of every module (and name) the file imports, relative imports resolved against `root`."""
    module = ".".join(path.relative_to(root).with_suffix("").parts)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    package = package.removesuffix(".__init__")
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parents = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(parents + ([node.module] if node.module else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def part_imports() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        source = part_of(".".join(path.relative_to(REPO).with_suffix("").parts))
        if source is None:  # megatron_dppo/__init__.py
            continue
        targets = {part_of(name) for name in imported_modules(path)} - {None, source}
        graph.setdefault(source, set()).update(targets)
    return graph


def mutual_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    return sorted((a, b) for a, targets in graph.items() for b in targets if a < b and a in graph.get(b, ()))


def test_no_two_parts_of_the_package_import_each_other():
    graph = part_imports()
    assert {"rollout", "pipeline", "actor", "algo"} <= graph.keys()  # the walk saw the package
    assert mutual_imports(graph) == [], "these parts import each other; move what both need into a leaf"


def test_the_check_finds_a_cycle_made_by_a_lazy_relative_import(tmp_path):
    """The check can fail: an import inside a function, written relative, is found as a top-level absolute one is,
    and two parts that name each other are reported."""
    stray = tmp_path / "megatron_dppo" / "rollout" / "stray.py"
    stray.parent.mkdir(parents=True)
    stray.write_text("def late():\n    from ..pipeline.trainer import Trainer\n")
    assert "megatron_dppo.pipeline.trainer.Trainer" in imported_modules(stray, tmp_path)
    graph = part_imports()
    graph["rollout"] = graph["rollout"] | {"pipeline"}  # as stray.py would make it
    assert ("pipeline", "rollout") in mutual_imports(graph)


def long_definitions(folder: Path) -> list[str]:
    found = []
    for path in sorted(folder.rglob("*.py")):
        text = path.read_text()
        lines = text.count("\n") + (not text.endswith("\n"))
        if lines > MAX_MODULE_LINES:
            found.append(f"{path.relative_to(REPO)}: {lines} lines")
        for node in ast.walk(ast.parse(text, filename=str(path))):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
                found.append(f"{path.relative_to(REPO)}: class {node.name} {node.end_lineno - node.lineno + 1} lines")
    return found


@pytest.mark.parametrize("folder", ["megatron_dppo", "bench"])
def test_no_module_over_600_lines_and_no_class_over_250(folder):
    assert long_definitions(REPO / folder) == []
