"""The flag toolkit: the domains numeric flags take, and the parser whose errors are one line said once.

A leaf: the trainer's flags (arguments.py) and every server's command line (the embedded engine's) build on it, and it
imports nothing of the package but platform/process.py, nor torch.

    text of a flag ─► its Domain (argparse `type`) ─► value, or `argument --flag: VALUE is out of range; give RULE`
    every error ─► FlagParser.error ─► one line on rank 0, exit 2 on every rank
    --help ─► DefaultsShownFormatter: every flag's help ends in its default (and a mode's replacement of it)

Invariants:
- every numeric flag of a parser built here declares a Domain (require_domains refuses one without);
- a Domain's rule is the text its error gives, so the error and the range cannot disagree.
"""

import argparse
import copy
import math
import re
from dataclasses import dataclass

from megatron_dppo.platform.process import exit_saying_once


@dataclass(frozen=True)
class Domain:
    """The values a numeric flag takes, declared with the flag as its argparse `type`: argparse calls it on the
    flag's text, so a value outside stops parsing with `argument --flag: VALUE is out of range; give RULE`. Every
    numeric flag has one (build_parser refuses a flag without), so a new flag states its range where it is added."""

    rule: str  # the values, as the error says them: "a number in [0, 1)"
    number: type  # int or float (floats must be finite)
    low: float | None = None
    high: float | None = None
    low_open: bool = False  # low itself is excluded
    high_open: bool = False
    also: tuple = ()  # values taken besides the range (top-k's -1)
    words: tuple = ()  # words taken as they are ("auto")

    def contains(self, value) -> bool:
        if value in self.also or value in self.words:
            return True
        if isinstance(value, float) and not math.isfinite(value):
            return False
        above = self.low is None or (value > self.low if self.low_open else value >= self.low)
        below = self.high is None or (value < self.high if self.high_open else value <= self.high)
        return above and below

    def __call__(self, text: str):
        if text in self.words:
            return text
        try:
            value = self.number(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if self.number is int else 'a number'}; "
                                             f"give {self.rule}") from None
        if not self.contains(value):
            raise argparse.ArgumentTypeError(f"{text} is out of range; give {self.rule}")
        return value

    def outside(self) -> str:
        """A value this domain refuses (for the test that walks every flag)."""
        if self.low is not None:
            return str(self.low if self.low_open else self.low - 1)
        return str(self.high if self.high_open else self.high + 1)


# One rule per kind of flag.
COUNT = Domain("an integer >= 1", int, 1)  # sizes and counts of things that must exist
COUNT_OR_NONE = Domain("an integer >= 0", int, 0)  # counts where 0 means "none" or "off" (each flag's help says)
POSITIVE = Domain("a finite number > 0", float, 0, low_open=True)  # learning rates, budgets, timeouts, caps
NON_NEGATIVE = Domain("a finite number >= 0", float, 0)  # coefficients and penalties (0: off), temperatures
RATE = Domain("a number in [0, 1)", float, 0, 1, high_open=True)  # prune rates, decays, Adam betas
FRACTION = Domain("a number in (0, 1]", float, 0, 1, low_open=True)  # fractions kept, keep-probability floors, top-p
AT_LEAST_ONE = Domain("a finite number >= 1", float, 1)  # multipliers of a batch
ABOVE_ONE = Domain("a finite number > 1", float, 1, low_open=True)  # the dual-clip constant
TOP_K = Domain("-1 (every token) or an integer >= 1", int, 1, also=(-1,))
SEED = Domain("an integer in [0, 2**63)", int, 0, 2**63 - 1)
RATE_OR_AUTO = Domain("auto or a number in [0, 1)", float, 0, 1, high_open=True, words=("auto",))


def shown_default(value) -> str:
    """A default as --help says it: 1e-06, 0.25 0.75, on / off for switches, none."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if value is None or value == "" or value == [] or value == ():
        return "none"
    if isinstance(value, (list, tuple)):
        return " ".join(map(str, value))
    return str(value)


# A help that states its own default in words: "(default: ...", "; default: --seed", "(default 1)" (not "Megatron-LM's
# default, 10", nor "the embedded default's task")
STATES_DEFAULT = re.compile(r"(^|[(;,.]\s*)default[: ]")


class DefaultsShownFormatter(argparse.HelpFormatter):
    """--help with every flag's default, added once here rather than in each help string: `(default: X)` after the
    help, unless the help already states its default in words (STATES_DEFAULT: a default that depends on other
    flags); `(required)` for a flag without one; and where the parser's `default_notes` has the flag (its dest), the
    note too (`the embedded default: 0.0001`)."""

    default_notes: dict[str, str] = {}
    NO_HELP = "\0"  # stands in for a flag's missing help, which argparse would print nothing for

    def _format_action(self, action: argparse.Action) -> str:
        if action.option_strings and not action.help:
            action = copy.copy(action)
            action.help = self.NO_HELP
        return super()._format_action(action)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help.removeprefix(self.NO_HELP).replace(" (default: %(default)s)", "")  # BooleanOptionalAction's
        if action.default is argparse.SUPPRESS or not action.option_strings:
            return text
        if action.required:
            shown = ["required"]
        else:
            shown = [] if STATES_DEFAULT.search(text) else [f"default: {shown_default(action.default)}"]
        if action.dest in self.default_notes:
            shown.append(self.default_notes[action.dest])
        added = "; ".join(shown).replace("%", "%%")  # help strings are %-formatted; what is added is plain text
        return f"{text} ({added})".strip() if shown else text


class ToolHelpFormatter(argparse.RawDescriptionHelpFormatter, DefaultsShownFormatter):
    """The tools' --help (tools/*.py): their docstring as written above, every flag's default below."""


class FlagParser(argparse.ArgumentParser):
    """argparse, whose errors (a value out of its domain, an unknown flag, a bad combination) end the run with one
    line per problem, said once under torchrun, without the usage block that would bury it; and whose --help shows
    every flag's default (DefaultsShownFormatter), with `default_notes[dest]` beside the flag's own where a mode
    of the program replaces it."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", DefaultsShownFormatter)
        self.default_notes: dict[str, str] = {}  # before argparse's own init, which formats -h's help
        super().__init__(*args, **kwargs)

    def note_replaced_defaults(self, mode: str, values: dict, values_by_case: dict[str, dict], case_flag: str) -> None:
        """Note in --help, beside a flag's own default, the value `mode` gives it where that differs: one for every
        case (`values`, by dest), or one per value of `case_flag` (`values_by_case`: {case: {dest: value}})."""
        for dest, value in values.items():
            if self.get_default(dest) != value:
                self.default_notes[dest] = f"{mode}: {shown_default(value)}"
        for dest in next(iter(values_by_case.values())):
            by_case = {case: case_values[dest] for case, case_values in values_by_case.items()}
            if any(value != self.get_default(dest) for value in by_case.values()):
                self.default_notes[dest] = f"{mode}, by {case_flag}: " + ", ".join(
                    f"{case} {shown_default(value)}" for case, value in by_case.items())

    def _get_formatter(self) -> argparse.HelpFormatter:
        formatter = super()._get_formatter()
        formatter.default_notes = self.default_notes
        return formatter

    def error(self, message: str):
        exit_saying_once(2, f"{self.prog}: error: {message}\n(--help lists every flag)")


def require_domains(parser: argparse.ArgumentParser) -> None:
    """Refuse a numeric flag declared without its Domain (argparse's plain int or float, or a number as default)."""
    for action in parser._actions:
        numeric_default = isinstance(action.default, (int, float)) and not isinstance(action.default, bool)
        if action.nargs == 0 or isinstance(action.type, Domain) or action.choices is not None:
            continue
        if action.type in (int, float) or numeric_default:
            raise TypeError(f"{action.option_strings[0]} is numeric but declares no Domain: give it type=COUNT, "
                            "RATE, ... (megatron_dppo.flags), or a new Domain if none fits")


def changed_flags(args: argparse.Namespace, parser: argparse.ArgumentParser, *flags: str) -> list[str]:
    """Those of `flags` whose value is not the parser's default, in the order given (--no-X: X turned off)."""
    dests = {flag: parser._option_string_actions[flag].dest for flag in flags}
    return [flag for flag, dest in dests.items() if getattr(args, dest) != parser.get_default(dest)]
