"""A reward of your own: --custom-reward-function PATH.py:NAME (verl's custom_reward_function path and name, slime's
--custom-rm-path), in place of --reward-type's, for training and for the held-out accuracy.

    PATH.py:NAME ─► load_reward_function: PATH imported as a module, NAME a callable taking (response, label, **fields)
                    (checked at flag-check time, so a bad PATH or NAME stops the run before anything starts)
    CustomReward(responses, labels, fields) ─► one asyncio loop over the batch: an `async def` NAME is awaited, a plain
        one runs in a daemon thread (at most MAX_CONCURRENT calls at once), each under --reward-timeout-s
        ─► a float per response

The label is the reference answer as a string (as the built-in rewards take it); `fields` are the row's own fields
(data.datasets.Example.fields: every field of a row of your file or of a built-in set; the synthetic task gives
`prompt` and `cell`), passed as keywords: all of them to a NAME that takes **kwargs, else those it names.

Invariants (the math reward's rule for its timeouts and dead workers):
- every response gets exactly one reward, in order; a call that raises, returns anything but a finite real number
  (NaN, None, a string, a tensor) or runs past the timeout scores 0.0, and the batch says so in one warning line
  (how many, and the first cause); the group is then trained as any group with that reward, nothing is dropped and
  the run goes on;
- a plain NAME that never returns keeps its daemon thread; it cannot hold up the batch past the timeout, nor the
  process at exit.
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
from pathlib import Path

from megatron_dppo.errors import UserInputError

logger = logging.getLogger(__name__)
FLAG = "--custom-reward-function"
MAX_CONCURRENT = 32  # calls in flight at once (threads for a plain function)
RESERVED = ("response", "label")  # the positional arguments; a row field of either name is not passed again


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
                             "PATH.py:NAME of a function NAME(response, label, **fields) -> float")
    try:
        inspect.signature(function).bind_partial("response", "label")
    except TypeError:
        raise UserInputError(f"{FLAG} {spec}: {name}{inspect.signature(function)} cannot be called as "
                             f"{name}(response, label): give it the signature (response, label, **fields)") from None
    return function


def reward_function_flag(text: str) -> str:
    """--custom-reward-function's argparse type: PATH.py:NAME loads, or parsing stops with one line saying what is
    wrong (the run loads it again on each rank that scores)."""
    try:
        load_reward_function(text)
    except UserInputError as error:
        raise argparse.ArgumentTypeError(str(error).removeprefix(f"{FLAG} ")) from None
    return text


class CustomReward:
    """`reward(responses, labels, fields) -> [float]`: NAME of PATH.py:NAME over a batch (see the module docstring)."""

    def __init__(self, spec: str, timeout_s: float):
        self.spec = spec
        self.function = load_reward_function(spec)
        self.timeout_s = timeout_s
        self.is_async = inspect.iscoroutinefunction(self.function)
        parameters = inspect.signature(self.function).parameters.values()
        self.takes_any_keyword = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)
        self.keywords = {p.name for p in parameters if p.kind in (inspect.Parameter.KEYWORD_ONLY,
                                                                   inspect.Parameter.POSITIONAL_OR_KEYWORD)}
        self.failures = 0  # responses scored 0 for a bad call, over the run

    def __call__(self, responses: Sequence[str], labels: Sequence, fields: Sequence[dict]) -> list[float]:
        outcomes = asyncio.run(self._score_all(responses, labels, fields))
        scores = [score for score, _ in outcomes]
        causes = [cause for _, cause in outcomes if cause is not None]
        if causes:
            self.failures += len(causes)
            kinds = ", ".join(f"{count} {kind}" for kind, count in Counter(c.split(":")[0] for c in causes).items())
            logger.warning("%s %s: %d of %d responses scored 0 (%s); first: %s", FLAG, self.spec, len(causes),
                           len(outcomes), kinds, causes[0])
        return scores

    async def _score_all(self, responses, labels, fields) -> list[tuple[float, str | None]]:
        slots = asyncio.Semaphore(MAX_CONCURRENT)

        async def one(response, label, row):
            async with slots:
                return await self._score(response, label, row)

        return await asyncio.gather(*(one(r, str(label), row) for r, label, row in zip(responses, labels, fields,
                                                                                       strict=True)))

    async def _score(self, response: str, label, row: dict) -> tuple[float, str | None]:
        """(reward, None), or (0.0, the cause) for a call that raised, timed out or returned no finite number."""
        keywords = {key: value for key, value in row.items() if key not in RESERVED
                    and (self.takes_any_keyword or key in self.keywords)}
        call = (self.function(response, label, **keywords) if self.is_async
                else _in_daemon_thread(self.function, response, label, keywords))
        try:
            value = await asyncio.wait_for(call, self.timeout_s)
        except TimeoutError:
            return 0.0, f"timeout: no return within --reward-timeout-s {self.timeout_s:g}"
        except Exception as error:  # the user's function: whatever it raises scores 0 and is reported
            return 0.0, f"raised: {type(error).__name__}: {error}"
        if isinstance(value, numbers.Real) and math.isfinite(value):
            return float(value), None
        return 0.0, f"returned no finite number: {value!r:.80}"


def _in_daemon_thread(function: Callable, response: str, label, keywords: dict) -> asyncio.Future:
    """function(response, label, **keywords) in a daemon thread, as a future of the running loop: awaiting it can
    time out, and a call that never returns neither blocks the loop nor keeps the process alive."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(setter: Callable, value) -> None:
        if not future.done():  # a timed-out call's future is cancelled already
            setter(value)

    def run():
        try:
            outcome = (future.set_result, function(response, label, **keywords))
        except Exception as error:  # reported by the caller as the call's cause
            outcome = (future.set_exception, error)
        try:
            loop.call_soon_threadsafe(settle, *outcome)
        except RuntimeError:  # the batch's loop has closed: this call had timed out
            pass

    threading.Thread(target=run, name="custom-reward", daemon=True).start()
    return future
