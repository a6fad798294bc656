"""The package's sides stay apart: the servers (megatron_dppo/servers/) never import the client side
(megatron_dppo/rollout/), which names them only by the module paths it launches; the weight-update wire protocol
both sides speak is a leaf; and the embedded engine's parts meet only at public members."""

import ast
import importlib
import importlib.util
from pathlib import Path

from tests.test_package_structure import imported_modules as file_imports

PACKAGE = Path(__file__).resolve().parents[1] / "megatron_dppo"


def imported_modules(directory_or_file: Path) -> dict[str, set[str]]:
    """Every module each file under `directory_or_file` imports, by the package-structure test's walk (absolute
    names, relative imports resolved, at the top or inside a function)."""
    files = [directory_or_file] if directory_or_file.is_file() else sorted(directory_or_file.rglob("*.py"))
    return {str(path.relative_to(PACKAGE.parent)): file_imports(path) for path in files}


def importing(directory_or_file: Path, prefix: str) -> list[str]:
    return [f"{path}: {name}" for path, names in imported_modules(directory_or_file).items() for name in sorted(names)
            if name == prefix or name.startswith(prefix + ".")]


def test_servers_never_import_the_client_side_and_the_client_never_imports_the_servers():
    assert importing(PACKAGE / "servers", "megatron_dppo.rollout") == []
    assert importing(PACKAGE / "rollout", "megatron_dppo.servers") == []


def test_weight_update_protocol_imports_nothing_of_the_package_but_platform():
    ours = [entry for entry in importing(PACKAGE / "weight_update_protocol.py", "megatron_dppo")
            if not entry.split(": ")[1].startswith("megatron_dppo.platform")]
    assert ours == []


def test_the_module_paths_the_client_launches_are_the_servers():
    from megatron_dppo.rollout.launcher import EMBEDDED_ENGINE_MODULE
    from megatron_dppo.rollout.vllm import WORKER_EXTENSION

    assert importlib.util.find_spec(f"{EMBEDDED_ENGINE_MODULE}.__main__") is not None, EMBEDDED_ENGINE_MODULE
    module, _, name = WORKER_EXTENSION.rpartition(".")
    extension = getattr(importlib.import_module(module), name)  # imports no vLLM until a method runs
    assert {"dppo_join_weight_group", "dppo_receive_bucket", "dppo_end_weight_update"} <= set(vars(extension))


# torch's own members of every tensor, not a part's: the in-place version counter (the RoPE table's cache key)
TORCH_TENSOR_MEMBERS = ("_version",)


def test_the_embedded_engines_parts_meet_only_at_public_members():
    """The engine is built by composition (request parser, scheduler, batch generator, weight updates, routes): no
    part reads or writes another's private members, only its own through self."""
    private = []
    for path in sorted((PACKAGE / "servers" / "embedded").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                    and ast.unparse(node.value) not in ("self", "cls") and node.attr not in TORCH_TENSOR_MEMBERS):
                private.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    assert private == []
