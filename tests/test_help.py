"""`pretrain_dppo.py --help` and the tools' --help as a user reads them: every flag shows its default (added once, by
the parser's formatter, so a flag added later shows its own without a word in its help; a help that mentions another
program's default still gets its own), the embedded default's replacements beside them, the --sglang-* pass-through,
and the truth about --transformer-impl."""

import os
import re
import subprocess
import sys

import pytest

from megatron_dppo.flags import COUNT, STATES_DEFAULT, FlagParser
from megatron_dppo.launch.arguments import EMBEDDED_DEFAULTS, build_parser
from tests.launch import REPO_ROOT


def trainer_help() -> str:
    finished = subprocess.run([sys.executable, str(REPO_ROOT / "examples" / "pretrain_dppo.py"), "--help"],
                              capture_output=True, text=True, timeout=120, cwd=REPO_ROOT,
                              env={**os.environ, "PYTHONPATH": str(REPO_ROOT), "COLUMNS": "250"})
    assert finished.returncode == 0, finished.stderr
    return finished.stdout


def flag_help(text: str, flag: str) -> str:
    """The help of `flag` (its line, and the lines under it up to the next flag or section)."""
    match = re.search(rf"^  {re.escape(flag)}\b.*?(?=^  -|^\S|\Z)", text, re.MULTILINE | re.DOTALL)
    assert match, f"{flag} is not in --help"
    return " ".join(match.group(0).split())


def test_help_lists_the_new_flags_and_every_default_with_the_embedded_defaults_beside():
    text = trainer_help()
    assert flag_help(text, "--lr").endswith("(default: 1e-06; the embedded default: 0.0001)")
    assert "(default: runs/dppo; the embedded default: runs/embedded)" in flag_help(text, "--log-dir")
    assert "(default: 1024; the embedded default, by --synthetic-task: worked 176, answer 8)" in flag_help(
        text, "--rollout-max-response-len")
    assert "(default: off; the embedded default: on)" in flag_help(text, "--dapo-filter")
    assert "NAME(response, label, **fields) -> float" in flag_help(text, "--custom-reward-function")
    assert "Weights & Biases" in flag_help(text, "--wandb-project")
    assert "default: transformer_engine on every GPU, local on the CPU" in flag_help(text, "--transformer-impl")
    assert flag_help(text, "--distributed-timeout-minutes").endswith("(Megatron-LM's default, 10, does not) "
                                                                     "(default: 120.0)")
    assert "--sglang-FLAG [VALUE]: any flag of `python -m sglang.launch_server`" in " ".join(text.split())
    parser = build_parser()
    for action in parser._actions:
        if action.option_strings and action.dest != "help":
            assert STATES_DEFAULT.search(flag_help(text, action.option_strings[0])), action.option_strings[0]
    for key in EMBEDDED_DEFAULTS:  # each replacement is named, except where it equals the flag's own default
        flag = next(a.option_strings[0] for a in parser._actions if a.dest == key)
        assert ("the embedded default" in flag_help(text, flag)) == (parser.get_default(key) != EMBEDDED_DEFAULTS[key])


def test_a_flag_added_without_help_shows_its_default_from_the_formatter():
    parser = FlagParser(prog="p")
    group = parser.add_argument_group("a later group")
    group.add_argument("--recompute-layers", type=COUNT, default=3)
    group.add_argument("--no-load-optim", action="store_true")
    group.add_argument("--rate", type=COUNT, default=5, help="a rate of 5%% or so")
    text = parser.format_help()
    assert "--recompute-layers RECOMPUTE_LAYERS\n                        (default: 3)" in text
    assert "--no-load-optim       (default: off)" in text
    assert "a rate of 5% or so (default: 5)" in text


TOOLS = {"prepare_data": "parse_args", "evaluate": "parse_args", "convert_hf_to_megatron": "parse_args",
         "convert_megatron_to_hf": "parse_args", "plot_metrics": "main", "gpu_check": "main"}


@pytest.mark.parametrize("tool", sorted(TOOLS))
def test_every_flag_of_each_tool_shows_its_default_or_that_it_is_required(tool, capsys, monkeypatch):
    import importlib

    monkeypatch.setenv("COLUMNS", "250")
    with pytest.raises(SystemExit) as exited:
        getattr(importlib.import_module(f"tools.{tool}"), TOOLS[tool])(["--help"])
    assert exited.value.code == 0
    options = capsys.readouterr().out.split("\noptions:\n", 1)[1]
    flags = re.findall(r"^  (--[\w-]+)", options, re.MULTILINE)
    assert flags and "--help" not in flags
    shown = {flag: flag_help(options, flag) for flag in flags}
    missing = [flag for flag, text in shown.items() if not (STATES_DEFAULT.search(text) or text.endswith("(required)"))]
    assert missing == [], f"tools/{tool}.py --help shows no default for {missing}"
