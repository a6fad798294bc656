"""The README's "Your cluster" section, run as a new user would: its commands as written, in a fresh copy of the
repository with no ../shared beside it, no local data and no network (HF_HUB_OFFLINE=1).

Only the settings' values change (the section's first block reads them from the environment): the model is a tiny
chat model under a Hub name in a Hugging Face cache built on disk, the data sets' public sources are tiny copies in
the same cache (so tools/prepare_data.py downloads every set from there), 2 CPU processes and TP 1, 2 steps, the
embedded engine in place of SGLang (as the trainer's rollout backend, and as the evaluation server: it takes SGLang's
--model-path and --port), small batches (`--bf16` kept), 2 problems per benchmark. Everything else runs as written:
data, conversion from the Hub name, the dry run, training that saves at its end, export with the Hub name's
tokenizer, evaluation through the server; then the resume block takes the run to 4 steps. The blocks that run
elsewhere are checked as such: the rollout node's SGLang command by SGLang's own parser (same model, deterministic,
TP equal to --rollout-server-gpus), and the single-node alternative by the dry run's plan. Every document under docs/
is linked from the README's index, and every link of the README leads to a file and heading that exist.
"""

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from fnmatch import fnmatch
from pathlib import Path

from megatron_dppo.platform.network import free_port
from tests.hub_cache import PUBLIC_SOURCE_FILES, place_in_hub_cache, place_public_sources
from tests.launch import REPO_ROOT

MODEL = "tiny-org/tiny-chat"
SETTINGS = {
    "MODEL": MODEL, "NPROC": "2", "TP": "1", "STEPS": "2",
    "ROLLOUT": "--rollout-backend embedded",
    "SIZES": "--bf16 --rollout-batch-size 2 --n-samples-per-prompt 2 --rollout-max-response-len 8 --eval-size 4 "
             "--max-tokens-per-gpu 16384",
    "EVAL": "--limit 2 --max-new-tokens 8 --no-progress",
    "SERVE": "python -m megatron_dppo.servers.embedded",
}
BENCHMARKS = ["math500", "gsm8k", "aime24", "amc23", "minerva_math", "olympiadbench"]


def readme() -> str:
    return (REPO_ROOT / "README.md").read_text()


def section(title: str) -> str:
    text = readme().split(f"\n## {title}\n", 1)
    assert len(text) == 2, f"README.md has no section '## {title}'"
    return text[1].split("\n## ", 1)[0]


def cluster_blocks() -> dict[str, list[str]]:
    """The bash blocks of "Your cluster" by role: "settings" (the first), "rollout node", "instead" and "after a stop"
    (by their first line's comment), and "flow", the rest in order: what a user runs on the training node."""
    blocks = re.findall(r"```bash\n(.*?)```", section("Your cluster"), re.DOTALL)
    roles: dict[str, list[str]] = {"settings": [blocks[0]], "rollout node": [], "instead": [], "after a stop": [],
                                   "flow": []}
    for block in blocks[1:]:
        role = next((name for name in ("rollout node", "instead", "after a stop") if block.startswith(f"# {name}")
                     or block.startswith(f"# on the {name}")), "flow")
        roles[role].append(block)
    assert all(len(roles[role]) == 1 for role in ("rollout node", "instead", "after a stop")), roles
    return roles


def training_command(flow: list[str]) -> str:
    """The TRAIN=... assignment of the flow's training block (the resume and the dry run reuse it)."""
    (block,) = [block for block in flow if block.startswith("TRAIN=")]
    return re.match(r'TRAIN=".*?"\n', block, re.DOTALL).group(0)


def settings_default(name: str) -> str:
    match = re.search(rf'{name}=\$\{{{name}:-"?(.*?)"?\}}', cluster_blocks()["settings"][0])
    assert match, f"the settings block has no {name}=${{{name}:-...}}"
    return match.group(1)


def fresh_copy(destination: Path) -> Path:
    """The repository's files (tracked and new, not ignored) as a clone has them, with no ../shared beside."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=REPO_ROOT,
                            capture_output=True, text=True, check=True).stdout.split("\0")
    for name in filter(None, listed):
        source = REPO_ROOT / name
        if source.is_file():
            (destination / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, destination / name)
    return destination


def source_rows(name: str) -> int:
    """Rows of built-in set `name` in the tiny copy of its public source (tests/hub_cache.py)."""
    from megatron_dppo.data.public_sources import PUBLIC_SOURCES

    source = PUBLIC_SOURCES[name]
    return sum(len(rows) for path, rows in PUBLIC_SOURCE_FILES[source.repo_id].items()
               if any(fnmatch(path, pattern) for pattern in source.files))


def run_bash(script: str, cwd: Path, env: dict) -> subprocess.CompletedProcess:
    finished = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=cwd, env=env, capture_output=True,
                              text=True, timeout=900, start_new_session=True)
    assert finished.returncode == 0, f"{finished.stdout[-4000:]}\n{finished.stderr[-6000:]}"
    return finished


def new_user(tmp_path: Path, model: str) -> tuple[Path, Path, dict]:
    """(a fresh copy of the repository, the snapshot of `model`, the environment a command runs in) as a new user
    has them, offline: no ../shared beside the copy, no local data, the tiny chat model under the Hub name `model`
    and tiny copies of the data sets' public sources in a Hugging Face cache, HF_HUB_OFFLINE=1."""
    from tests.tiny_chat import save_tiny_chat_model

    clone = fresh_copy(tmp_path / "clone" / "megatron_dppo")
    assert not (clone.parent / "shared").exists()
    hf_home = tmp_path / "hf_home"
    save_tiny_chat_model(tmp_path / "tiny-chat")
    snapshot = place_in_hub_cache(hf_home, model, tmp_path / "tiny-chat")
    place_public_sources(hf_home, tmp_path / "sources")
    environment = {**os.environ, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1",
                   "DPPO_DATA_DIR": str(tmp_path / "no-local-data"), "PYTHONPATH": str(clone), "OMP_NUM_THREADS": "1",
                   "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    return clone, snapshot, environment


def test_readme_cluster_section_runs_as_written_from_a_hub_name_and_downloaded_data_offline(tmp_path):
    clone, snapshot, environment = new_user(tmp_path, MODEL)
    environment.update(SETTINGS, EVAL_PORT=str(free_port()))
    blocks = cluster_blocks()
    finished = run_bash("\n".join(blocks["settings"] + blocks["flow"]), clone, environment)

    prepared = [line for line in finished.stdout.splitlines() if " rows  data/" in line]
    assert len(prepared) == 10 and all("from https://huggingface.co/datasets/" in line for line in prepared), prepared
    assert "launch plan (dry run: nothing started)" in finished.stdout
    assert (clone / "ckpt" / "run" / "latest").read_text().strip() == "iter_0000002"
    assert (clone / "hf" / "run" / "tokenizer.json").read_bytes() == (snapshot / "tokenizer.json").read_bytes()
    results = json.loads((clone / "eval" / "run" / "results.json").read_text())
    assert list(results["benchmarks"]) == BENCHMARKS
    assert {name: summary["num_problems"] for name, summary in results["benchmarks"].items()} == {
        name: min(2, source_rows(name)) for name in BENCHMARKS}  # --limit 2 of the tiny sources' rows

    # the resume block, after the run stopped at its 2 steps: the same command to 4 steps with --load ckpt/run
    resume = "\n".join([*blocks["settings"], training_command(blocks["flow"]), *blocks["after a stop"]])
    run_bash(resume, clone, {**environment, "STEPS": "4"})
    assert (clone / "ckpt" / "run" / "latest").read_text().strip() == "iter_0000004"
    steps = [json.loads(line) for line in (clone / "runs" / "dppo" / "metrics.jsonl").read_text().splitlines()]
    assert [step["step"] for step in steps] == [1, 2, 3, 4]
    assert json.loads((clone / "runs" / "dppo" / "summary.json").read_text())["steps"] == 4


def test_readme_rollout_servers_are_the_ones_the_trainer_expects():
    """The rollout node's command is SGLang's (its own parser reads it): the settings' model, deterministic, TP equal
    to the settings' --rollout-server-gpus, on the port of their --rollout-urls. The single-node alternative, laid
    out by the flow's dry run on an 8-GPU node, starts SGLang servers on GPUs 6 and 7 with that TP, deterministic."""
    from tests.test_engine_parsers import sglang_parse

    blocks = cluster_blocks()
    (node_block,) = blocks["rollout node"]
    command = shlex.split(node_block.split("\n", 1)[1].replace("\\\n", " "))
    (parsed,) = sglang_parse([[sys.executable, *command[1:]]])
    assert parsed["error"] is None, parsed["error"]
    rollout = shlex.split(settings_default("ROLLOUT"))
    url = rollout[rollout.index("--rollout-urls") + 1]
    server_gpus = int(rollout[rollout.index("--rollout-server-gpus") + 1])
    values = parsed["values"]
    assert values["model_path"] == settings_default("MODEL") and values["enable_deterministic_inference"]
    assert values["tp_size"] == server_gpus and f":{values['port']}" in url

    dry_run = next(line for block in blocks["flow"] for line in block.splitlines() if "--dry-run" in line)
    script = "\n".join([*blocks["settings"], *blocks["instead"], training_command(blocks["flow"]), dry_run])
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    plan = run_bash(script, REPO_ROOT, {**os.environ, "PYTHONPATH": str(REPO_ROOT), "DPPO_GPUS_PER_NODE": "8",
                                        "PATH": path}).stdout
    assert re.findall(r"CUDA_VISIBLE_DEVICES=(\S+)", plan) == ["6", "7"], plan
    servers = [shlex.split(line) for line in plan.splitlines() if "-m sglang.launch_server" in line]
    assert len(servers) == 2
    for parsed in sglang_parse(servers):
        assert parsed["error"] is None and parsed["values"]["enable_deterministic_inference"], parsed
        assert parsed["values"]["tp_size"] == 1


def slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_doc_is_in_the_readme_index_and_every_readme_link_resolves():
    index = section("Documentation")
    documents = sorted(str(path.relative_to(REPO_ROOT)) for path in (REPO_ROOT / "docs").glob("*.md"))
    assert documents and [doc for doc in documents if f"]({doc})" not in index] == []
    assert "](CONTRIBUTING.md)" in index
    for target in re.findall(r"\]\(([^)#:]+\.md)(?:#([\w-]+))?\)", readme()):
        path, anchor = REPO_ROOT / target[0], target[1]
        assert path.is_file(), target[0]
        if anchor:
            headings = re.findall(r"^#+ (.+)$", path.read_text(), re.MULTILINE)
            assert anchor in {slug(heading) for heading in headings}, f"{target[0]}#{anchor}"
