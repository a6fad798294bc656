"""A reward of your own: --custom-reward-function PATH.py:NAME (verl's custom_reward_function path and name, slime's
--custom-rm-path), in place of --reward-type's, for training, the held-out accuracy and tools/evaluate.py.

    PATH.py:NAME ─► load_reward_function: PATH imported as a module, NAME a callable, its calling convention read from
                    its parameters (checked at flag-check time, so a bad PATH, NAME or signature stops the run before
                    anything starts):
                      ours    NAME(response, label, **fields)
                      verl's  compute_score(data_source, solution_str, ground_truth, extra_info=None)
                      slime's custom_rm(args, sample) is refused: its Sample object has no counterpart here
    CustomReward(responses, rows) ─► one asyncio loop over the batch: an `async def` NAME is awaited, a plain one runs
        in a daemon thread (at most MAX_CONCURRENT calls at once), each under --reward-timeout-s
        ─► RewardBatch: a float per response, and the other keys of each dict it returned

What a call gets. Ours: the decoded response, the label (the reference answer as a string, as the built-in rewards
take it) and the row's fields (data.datasets.Example.fields: every field of a row of your file or of a built-in set;
the synthetic task gives `prompt` and `cell`) as keywords, all of them to a NAME that takes **kwargs, else those it
names. verl's: solution_str the response, ground_truth the label, data_source the row's "data_source" field (verl's
data layout) or else the source the row came from (--prompt-data's name or file), extra_info the row's "extra_info"
field when it is a dict (verl's layout) or else the whole row; each passed by keyword, as verl passes them.

What a call returns: a real number, or a dict with a real "score" (verl's convention) whose other keys are kept per
response (RewardBatch.extras: the trainer logs the numeric ones, averaged over the step, as reward_extra/<key>).

Invariants:
- every response gets exactly one reward, in order;
- a call that raises or returns no finite score (NaN, None, a string, a dict without "score") is a failure: the run
  tolerates --custom-reward-max-failures of them (default 0), each scoring 0 with one warning line per batch, and the
  next one stops it with a UserInputError, one line naming NAME, the row and the cause: never silent zeros;
- a call that runs past --reward-timeout-s scores 0 with a warning line (the math reward's rule for its timeouts),
  and a plain NAME that never returns keeps its daemon thread: it holds up neither the batch past the timeout nor
  the process at exit.
"""

import argparse
import asyncio
import importlib.util
import inspect
import logging
import math
import numbers
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from megatron_dppo.errors import UserInputError
from megatron_dppo.rewards import RewardBatch, RewardRow

logger = logging.getLogger(__name__)
FLAG = "--custom-reward-function"
MAX_FAILURES_FLAG = "--custom-reward-max-failures"
MAX_CONCURRENT = 32  # calls in flight at once (threads for a plain function)
RESERVED = ("response", "label")  # our positional arguments; a row field of either name is not passed again
VERL_KEYWORDS = ("data_source", "solution_str", "ground_truth", "extra_info")  # verl's reward manager's call
SIGNATURES = "NAME(response, label, **fields) or verl's compute_score(data_source, solution_str, ground_truth, " \
             "extra_info=None)"


def load_reward_function(spec: str) -> Callable:
    """NAME of the Python file PATH, from `PATH.py:NAME`; a UserInputError names what is wrong and the fix."""
    path_text, separator, name = spec.rpartition(":")
    if not separator or not path_text or not name:
        raise UserInputError(f"{FLAG} {spec}: give PATH.py:NAME, the file and the function in it")
    path = Path(path_text).expanduser()
    if path.suffix != ".py":
        raise UserInputError(f"{FLAG} {spec}: {path_text} is not a .py file; give PATH.py:NAME")
    if not path.is_file():
        raise UserInputError(f"{FLAG} {spec}: no such file {path_text}; give PATH.py:NAME")
    module_spec = importlib.util.spec_from_file_location(f"custom_reward_{path.stem}", path)
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except Exception as error:  # the user's module: any exception it raises on import is theirs to fix
        raise UserInputError(f"{FLAG} {spec}: importing {path_text} raised {type(error).__name__}: {error}") from None
    function = getattr(module, name, None)
    if not callable(function):
        defined = sorted(key for key, value in vars(module).items() if callable(value) and not key.startswith("_")
                         and getattr(value, "__module__", None) == module.__name__)
        state = "is not callable" if hasattr(module, name) else "is not defined there"
        raise UserInputError(f"{FLAG} {spec}: {name} {state} (its functions: {', '.join(defined) or 'none'}); give "
                             f"PATH.py:NAME of a function {SIGNATURES}")
    calling_convention(function, spec)
    return function


def calling_convention(function: Callable, spec: str) -> str:
    """"verl" for a function whose parameters name verl's solution_str and ground_truth, "ours" for one that can be
    called as NAME(response, label); anything else, slime's (args, sample) included, is a UserInputError."""
    name, signature = function.__name__, inspect.signature(function)
    parameters = signature.parameters
    if {"solution_str", "ground_truth"} <= parameters.keys():
        required = [p.name for p in parameters.values() if p.default is inspect.Parameter.empty
                    and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
                    and p.name not in VERL_KEYWORDS]
        if required or any(p.kind is inspect.Parameter.POSITIONAL_ONLY for p in parameters.values()):
            raise UserInputError(f"{FLAG} {spec}: {name}{signature} takes verl's solution_str and ground_truth, but "
                                 f"verl calls it with the keywords {', '.join(VERL_KEYWORDS)} only"
                                 + (f" and it also requires {', '.join(required)}" if required else
                                    ", which its positional-only parameters cannot take")
                                 + ": give the others defaults")
        return "verl"
    if list(parameters)[:2] == ["args", "sample"]:
        raise UserInputError(f"{FLAG} {spec}: {name}{signature} is slime's custom reward (args, sample), whose "
                             f"Sample object has no counterpart here: write {SIGNATURES}")
    try:
        signature.bind_partial("response", "label")
    except TypeError:
        raise UserInputError(f"{FLAG} {spec}: {name}{signature} cannot be called as {name}(response, label): give "
                             f"it the signature {SIGNATURES}") from None
    return "ours"


def reward_function_flag(text: str) -> str:
    """--custom-reward-function's argparse type: PATH.py:NAME loads, or parsing stops with one line saying what is
    wrong (the run loads it again on each rank that scores)."""
    try:
        load_reward_function(text)
    except UserInputError as error:
        raise argparse.ArgumentTypeError(str(error).removeprefix(f"{FLAG} ")) from None
    return text


class CustomReward:
    """`reward(responses, rows) -> RewardBatch`: NAME of PATH.py:NAME over a batch (see the module docstring)."""

    def __init__(self, spec: str, timeout_s: float, max_failures: int = 0):
        self.spec = spec
        self.function = load_reward_function(spec)
        self.name = self.function.__name__
        self.convention = calling_convention(self.function, spec)
        self.timeout_s = timeout_s
        self.max_failures = max_failures
        self.is_async = inspect.iscoroutinefunction(self.function)
        parameters = inspect.signature(self.function).parameters.values()
        self.takes_any_keyword = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)
        self.keywords = {p.name for p in parameters if p.kind in (inspect.Parameter.KEYWORD_ONLY,
                                                                   inspect.Parameter.POSITIONAL_OR_KEYWORD)}
        self.failures = 0  # calls that raised or returned no finite score, over the run

    def __call__(self, responses: Sequence[str], rows: Sequence[RewardRow]) -> RewardBatch:
        outcomes = asyncio.run(self._score_all(responses, rows))
        failed = [(row, outcome) for outcome, row in zip(outcomes, rows, strict=True) if outcome.kind in FAILURES]
        self.failures += len(failed)
        if failed and self.failures > self.max_failures:
            row, outcome = failed[0]
            raise UserInputError(
                f"{FLAG} {self.spec}: {self.name} {outcome.cause} on {row.location or 'a row'}; {self.failures} "
                f"failed calls so far, more than {MAX_FAILURES_FLAG} {self.max_failures}: fix {self.name} (it must "
                f"return a finite number or a dict with a finite 'score'), or raise {MAX_FAILURES_FLAG} to score such "
                "calls 0")
        zeros = [outcome for outcome in outcomes if outcome.kind is not None]
        if zeros:
            kinds = ", ".join(f"{count} {kind}" for kind, count in Counter(o.kind for o in zeros).items())
            logger.warning("%s %s: %d of %d responses scored 0 (%s; failed calls so far: %d, %s %d); first: %s",
                           FLAG, self.spec, len(zeros), len(outcomes), kinds, self.failures, MAX_FAILURES_FLAG,
                           self.max_failures, zeros[0].cause)
        return RewardBatch([outcome.score for outcome in outcomes], [outcome.extras for outcome in outcomes])

    async def _score_all(self, responses, rows) -> list["Outcome"]:
        slots = asyncio.Semaphore(MAX_CONCURRENT)

        async def one(response, row):
            async with slots:
                return await self._score(response, row)

        return await asyncio.gather(*(one(response, row) for response, row in zip(responses, rows, strict=True)))

    def _arguments(self, response: str, row: RewardRow) -> tuple[tuple, dict]:
        """The call's positional and keyword arguments, by the function's convention (module docstring)."""
        if self.convention == "verl":
            extra_info = row.fields.get("extra_info")
            data_source = row.fields.get("data_source")
            keywords = {"data_source": data_source if isinstance(data_source, str) else row.source,
                        "solution_str": response, "ground_truth": row.label,
                        "extra_info": extra_info if isinstance(extra_info, dict) else dict(row.fields)}
            return (), {key: value for key, value in keywords.items()
                        if self.takes_any_keyword or key in self.keywords}
        return (response, row.label), {key: value for key, value in row.fields.items() if key not in RESERVED
                                       and (self.takes_any_keyword or key in self.keywords)}

    async def _score(self, response: str, row: RewardRow) -> "Outcome":
        positional, keywords = self._arguments(response, row)
        call = (self.function(*positional, **keywords) if self.is_async
                else _in_daemon_thread(self.function, positional, keywords))
        try:
            value = await asyncio.wait_for(call, self.timeout_s)
        except TimeoutError:
            return Outcome(kind="timeout", cause=f"timed out: no return within --reward-timeout-s {self.timeout_s:g}")
        except Exception as error:  # the user's function: whatever it raises is reported
            return Outcome(kind="raised", cause=one_line(f"raised {type(error).__name__}: {error}"))
        extras = {}
        if isinstance(value, dict):
            if "score" not in value:
                return Outcome(kind="no score", cause=one_line(f"returned a dict without 'score' (keys: "
                                                               f"{', '.join(map(str, value))})"))
            value, extras = value["score"], {key: item for key, item in value.items() if key != "score"}
        if isinstance(value, numbers.Real) and math.isfinite(value):
            return Outcome(float(value), extras)
        return Outcome(kind="no score", cause=one_line(f"returned no finite number: {value!r:.80}"))


FAILURES = ("raised", "no score")  # the kinds of Outcome that count against --custom-reward-max-failures


@dataclass
class Outcome:
    """One call's reward and the other keys of the dict it returned; or 0 with the kind and cause of what went wrong
    (a failure, FAILURES, or a timeout)."""

    score: float = 0.0
    extras: dict = field(default_factory=dict)
    kind: str | None = None
    cause: str = ""


def one_line(text: str, limit: int = 300) -> str:
    """`text` on one line (a user's exception message may hold newlines), at most `limit` characters."""
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[:limit - 3] + "..."


def _in_daemon_thread(function: Callable, positional: tuple, keywords: dict) -> asyncio.Future:
    """function(*positional, **keywords) in a daemon thread, as a future of the running loop: awaiting it can time
    out, and a call that never returns neither blocks the loop nor keeps the process alive."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(setter: Callable, value) -> None:
        if not future.done():  # a timed-out call's future is cancelled already
            setter(value)

    def run():
        try:
            outcome = (future.set_result, function(*positional, **keywords))
        except Exception as error:  # reported by the caller as the call's cause
            outcome = (future.set_exception, error)
        try:
            loop.call_soon_threadsafe(settle, *outcome)
        except RuntimeError:  # the batch's loop has closed: this call had timed out
            pass

    threading.Thread(target=run, name="custom-reward", daemon=True).start()
    return future
