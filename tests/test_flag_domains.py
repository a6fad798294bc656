"""Every flag of examples/pretrain_dppo.py has a domain, checked at parse time: walking the parser, each numeric or
choice flag given a value outside its domain ends parsing with exit status 2 and one error line naming that flag
and the value. A numeric flag added without a Domain is refused when the parser is built, and a free-text flag must
be listed here with where it is checked, so a new flag cannot slip past unchecked."""

import argparse
import math

import pytest

from megatron_dppo.flags import COUNT, Domain, FlagParser, require_domains
from megatron_dppo.launch.arguments import EMBEDDED_DEFAULTS, EMBEDDED_TASK_DEFAULTS, build_parser, parse_args

# Flags whose values are text: paths, names, URLs, cells. Each is checked where it is used (the model folder and
# prompt sources at parse time, arguments.model_and_data_errors; cells, arguments.embedded_errors), not by a range.
TEXT_FLAGS = {
    "--hf-checkpoint", "--load", "--save", "--log-dir", "--rollout-python", "--rollout-urls",
    "--weight-sync-master-address", "--prompt-data", "--prompt-data-split", "--eval-prompt-data",
    "--eval-prompt-data-split", "--prompt-data-config", "--eval-prompt-data-config",
    "--input-key", "--label-key", "--data-synthetic-cells", "--warm-start-cells",
    "--cache-dir", "--difficulty-key",
    # checked by their argparse type: the reward file loads (rewards/custom.py), the wandb package is installed, a
    # JSON object (data/templates.py; its keys against the tokenizer's template where the prompts are encoded)
    "--custom-reward-function", "--wandb-project", "--apply-chat-template-kwargs",
    # free text: W&B's run name, entity and group, folders
    "--wandb-exp-name", "--wandb-save-dir", "--wandb-entity", "--wandb-group", "--save-debug-rollout-data",
    "--heartbeat-port", "--weight-sync-port",  # PORT or FIRST-LAST, checked by their argparse type (PortRange.parse)
}


def options() -> list[argparse.Action]:
    return [action for action in build_parser()._actions if action.option_strings and action.dest != "help"]


def out_of_domain_values(action: argparse.Action) -> list[str]:
    """Values the flag must refuse: one past its range (and NaN for real numbers), or a word that is no choice."""
    if action.choices is not None:
        return ["not-a-choice"]
    domain = action.type
    return [domain.outside()] + (["nan"] if domain.number is float else [])


def test_every_option_is_a_switch_a_choice_a_domain_or_listed_text():
    for action in options():
        flag = action.option_strings[0]
        kind = ("switch" if action.nargs == 0 else "choice" if action.choices is not None
                else "domain" if isinstance(action.type, Domain) else "text" if flag in TEXT_FLAGS else None)
        assert kind is not None, (f"{flag} has no domain: give it type=COUNT, RATE, ... (a Domain), choices, or, "
                                  "for a text flag checked elsewhere, list it in TEXT_FLAGS with where it is checked")


@pytest.mark.parametrize("action", [action for action in options()
                                    if action.choices is not None or isinstance(action.type, Domain)],
                         ids=lambda action: action.option_strings[0])
def test_a_value_outside_the_domain_exits_2_with_one_line_naming_the_flag(action, capsys):
    flag = action.option_strings[0]
    for value in out_of_domain_values(action):
        values = [value] * (action.nargs if isinstance(action.nargs, int) else 1)
        with pytest.raises(SystemExit) as exit_info:
            parse_args([flag, *values])
        assert exit_info.value.code == 2
        lines = capsys.readouterr().err.splitlines()
        assert lines[-1] == "(--help lists every flag)" and len(lines) == 2, lines
        assert lines[0].startswith(f"pretrain_dppo.py: error: argument {flag}: ") and value in lines[0], lines[0]


def test_every_default_lies_in_its_domain():
    defaults = {action.dest: [action.default] for action in options()}
    for overrides in (EMBEDDED_DEFAULTS, *EMBEDDED_TASK_DEFAULTS.values()):
        for dest, value in overrides.items():
            defaults[dest].append(value)
    for action in options():
        if not isinstance(action.type, Domain):
            continue
        for default in defaults[action.dest]:
            values = default if isinstance(default, (tuple, list)) else [default]
            for value in values:
                assert value is None or action.type.contains(value), f"{action.option_strings[0]} default {value}"


def test_a_numeric_flag_without_a_domain_is_refused_when_the_parser_is_built():
    for declaration in (dict(type=int), dict(type=float, default=None), dict(default=3)):
        parser = FlagParser()
        parser.add_argument_group("new").add_argument("--new-size", **declaration)
        with pytest.raises(TypeError, match="--new-size is numeric but declares no Domain"):
            require_domains(parser)


def test_domains_refuse_non_numbers_non_integers_and_non_finite_values():
    for text in ("x", "1.5", "", "inf"):
        with pytest.raises(argparse.ArgumentTypeError):
            COUNT(text)
    real = Domain("a finite number", float)
    for text in ("inf", "-inf", "nan"):
        with pytest.raises(argparse.ArgumentTypeError, match="out of range"):
            real(text)
    assert COUNT("3") == 3 and math.isclose(real("1e-6"), 1e-6)
