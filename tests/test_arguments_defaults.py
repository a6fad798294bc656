"""The pruners' defaults say the same thing in the three places a user reads them: the command line
(arguments.py, written out so that parsing stays torch-free), the config dataclasses (algo/pruning.py and
algo/dapo_filter.py), and the defaults table of docs/algorithms.md. Also: GSPO's clip ranges follow the importance
level, and D3S needs the run's length."""

import dataclasses
import re
import subprocess
import sys

import pytest

from megatron_dppo.algo import CPPOConfig, D3SConfig, DAPOConfig, DPPOConfig
from megatron_dppo.launch.arguments import build_parser, parse_args
from tests.launch import REPO_ROOT

CONFIGS = {"DPPOConfig": DPPOConfig, "CPPOConfig": CPPOConfig, "D3SConfig": D3SConfig, "DAPOConfig": DAPOConfig}


def documented_defaults() -> list[tuple[str, list[str], list[str]]]:
    """(flag, default words, config fields) per row of the '### Defaults' table."""
    text = (REPO_ROOT / "docs" / "algorithms.md").read_text()
    table = text.split("### Defaults", 1)[1].split("\n### ", 1)[0]
    rows = []
    for line in table.splitlines():
        match = re.fullmatch(r"\| `(--[a-z0-9-]+)` \| ([^|]+) \| (.+) \|", line.strip())
        if match:
            fields = re.findall(r"`(\w+\.\w+)`", match.group(3))
            rows.append((match.group(1), match.group(2).split(), fields))
    return rows


def as_words(value) -> list[str]:
    values = value if isinstance(value, (tuple, list)) else [value]
    return [str(v) for v in values]


def test_cli_config_and_docs_defaults_are_equal():
    rows = documented_defaults()
    assert len(rows) >= 13, "the defaults table lost rows"
    actions = {flag: action for action in build_parser()._actions for flag in action.option_strings}
    for flag, documented, fields in rows:
        cli = as_words(actions[flag].default)
        config = [str(getattr(CONFIGS[name](), attribute)) for name, attribute in (f.split(".") for f in fields)]
        assert cli == documented == config, f"{flag}: CLI {cli}, docs {documented}, config {config}"
    documented_fields = {field for _, _, fields in rows for field in fields}
    for name in ("DPPOConfig", "D3SConfig"):  # every tunable field of these is in the table
        for config_field in dataclasses.fields(CONFIGS[name]):
            if config_field.name not in ("seed", "scope"):
                assert f"{name}.{config_field.name}" in documented_fields, f"{name}.{config_field.name} undocumented"


def test_clip_ranges_default_by_importance_level_and_explicit_flags_win():
    token = parse_args([])
    assert (token.eps_clip, token.eps_clip_high) == (0.2, 0.28)
    sequence = parse_args(["--importance-level", "sequence"])
    assert (sequence.eps_clip, sequence.eps_clip_high) == (3e-4, 4e-4)
    explicit = parse_args(["--importance-level", "sequence", "--eps-clip", "0.01"])
    assert (explicit.eps_clip, explicit.eps_clip_high) == (0.01, 4e-4)


def test_d3s_without_a_run_length_is_refused_naming_the_flags(capsys):
    # a real run's flags (no embedded time budget); --dry-run leaves the model folder unchecked
    external = ["--rollout-backend", "external", "--rollout-urls", "http://127.0.0.1:1", "--hf-checkpoint", "model",
                "--dry-run"]
    with pytest.raises(SystemExit):
        parse_args([*external, "--algorithm", "d3s"])
    message = capsys.readouterr().err
    assert "--algorithm d3s relaxes" in message and "--train-iters or --time-budget-s" in message
    assert parse_args([*external, "--algorithm", "d3s", "--train-iters", "5"]).algorithm == "d3s"
    assert parse_args([*external, "--algorithm", "d3s", "--time-budget-s", "60"]).algorithm == "d3s"


def test_argument_parsing_stays_torch_free():
    # --dry-run runs before every Slurm launch: parsing and validating must not pay for importing torch
    code = ("import sys, megatron_dppo.launch.arguments as a; a.parse_args(['--dry-run']); "
            "a.parse_args(['--dry-run', '--prompt-data', 'math', '--hf-checkpoint', 'model']); "
            "print(sorted(m for m in ('torch', 'megatron') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "[]", f"argument parsing imported {result.stdout.strip()}"
