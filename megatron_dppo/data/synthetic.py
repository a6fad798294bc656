"""Synthetic multi-step integer arithmetic: the task of the embedded default, in two forms.

    seed ──► cell (ops x max digits, uniform over `cells`) ──► operands in [0, 10^digits) and +/- operators
         ──► Problem(prompt "Q:37+58-12=?A:", answer 83, cell "2x2", operands (37, 58, 12), operators "+-")
         ──► supervised target:  worked "37+58=95,95-12=83#83$"  |  answer "83$"

- Two tasks (`TASKS`). `worked` (the default) writes every intermediate result before the final answer, as a
  math solution does: one step `<running total><op><operand>=<new total>` per operator, steps separated by `,`, then
  the final-answer marker `#`, the answer and the end marker `$`. Responses grow with the cell from 14 to about
  160 characters (one token each). `answer` is the older task: the answer alone, then `$`.
- Difficulty cells `OxD`: O operators (O+1 operands), each operand with at most D digits. Each task has its own
  default cells (`TASK_CELLS`); the worked task's reach chains of 16 operations, so its longest responses come near
  160 tokens.
- Held-out split: a prompt is held out when a stable hash of its string falls in a reserved bucket
  (1/`HELDOUT_BUCKETS` of all prompts). The training stream skips those prompts, and `heldout(n, seed)` draws only
  from them, so no held-out prompt string ever appears in training, whatever n, seed or stream length.
- Supervised data may be limited on purpose (`WarmStartData`): worked solutions for some cells only, or for a fixed
  number of problems revisited in epochs, while RL prompts carry only the final answer (the reward's reference)
  for every cell, as MATH's do. Then RL has something to earn that more supervised steps on the same data cannot.
- Deterministic: the same seed gives the same stream, and `state_dict()` resumes it exactly.
"""

import hashlib
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from megatron_dppo.answers import ANSWER_MARKER, END_MARKER, STEP_SEPARATOR

TASKS = ("worked", "answer")
TASK_CELLS = {
    # 14 to ~160 response tokens: chains of 2 to 16 one-digit operations, and short chains of two-digit ones (a
    # 0.8M-parameter model learns one-digit steps within minutes; wider numbers mostly cost it accuracy, not length)
    "worked": ("2x1", "3x1", "4x1", "6x1", "8x1", "12x1", "16x1", "2x2", "3x2", "4x2"),
    # chosen by calibration: a 0.6M-parameter model starts low after a short warm start, with room for RL
    "answer": ("2x1", "2x2", "2x3", "3x1", "3x2", "4x1", "4x2"),
}
DEFAULT_HELDOUT_SEED = 12345
HELDOUT_BUCKETS = 16  # 1 prompt in 16 is reserved for evaluation


@dataclass(frozen=True)
class Problem:
    prompt: str  # "Q:37+58-12=?A:"
    answer: int
    cell: str  # "2x2": operators x max digits
    operands: tuple[int, ...]  # (37, 58, 12)
    operators: str  # "+-", one per operand after the first


def parse_cell(cell: str) -> tuple[int, int]:
    """'3x2' -> (3 operators, 2 max digits)."""
    operators, separator, digits = cell.partition("x")
    if separator != "x" or not operators.isdigit() or not digits.isdigit() or int(operators) < 1 or int(digits) < 1:
        raise ValueError(f"difficulty cell {cell!r} must read '<operators>x<max digits>' with both >= 1, e.g. '3x2'")
    return int(operators), int(digits)


def check_task(task: str) -> str:
    if task not in TASKS:
        raise ValueError(f"synthetic task {task!r} is not one of {TASKS} (--synthetic-task)")
    return task


def is_heldout(prompt: str) -> bool:
    """True for the prompts reserved for evaluation (a stable hash, the same in every process)."""
    digest = hashlib.blake2b(prompt.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % HELDOUT_BUCKETS == 0


def worked_steps(problem: Problem) -> list[str]:
    """['37+58=95', '95-12=83']: each operation on the running total, with its result."""
    steps, total = [], problem.operands[0]
    for operator, operand in zip(problem.operators, problem.operands[1:]):
        result = total + operand if operator == "+" else total - operand
        steps.append(f"{total}{operator}{operand}={result}")
        total = result
    return steps


def format_target(problem: Problem, task: str = "worked") -> str:
    """The supervised completion of a prompt: '37+58=95,95-12=83#83$' (worked) or '83$' (answer)."""
    if check_task(task) == "answer":
        return f"{problem.answer}{END_MARKER}"
    return f"{STEP_SEPARATOR.join(worked_steps(problem))}{ANSWER_MARKER}{problem.answer}{END_MARKER}"


def max_target_length(cells: Sequence[str], task: str = "worked") -> int:
    """An upper bound on len(format_target(p, task)) over every problem of `cells` (reached when every operand is
    the largest and the signs keep the running total as wide as possible), for sizing response and context limits."""
    check_task(task)
    longest = 0
    for cell in cells:
        operators, digits = parse_cell(cell)
        # widest running total over k operands, sign included: k x the largest operand
        width = [len(str(k * (10**digits - 1))) + 1 for k in range(operators + 2)]
        answer = width[operators + 1] + len(END_MARKER)
        if task == "worked":
            steps = sum(width[k] + 1 + digits + 1 + width[k + 1] for k in range(1, operators + 1))
            answer += steps + (operators - 1) * len(STEP_SEPARATOR) + len(ANSWER_MARKER)
        longest = max(longest, answer)
    return longest


def max_prompt_length(cells: Sequence[str]) -> int:
    """len(prompt) of the longest problem of `cells`: 'Q:' + operands and operators + '=?A:'."""
    shapes = [parse_cell(cell) for cell in cells]
    return max(2 + (operators + 1) * digits + operators + 4 for operators, digits in shapes)


def rl_pool_seed(seed: int) -> str:
    """The seed of the RL prompt pool's stream, named apart from the warm start's (which draws from `seed` itself):
    with one --seed for both, the pool would otherwise begin with the warm start's own worked problems, already
    solved, and a small pool would be little else."""
    return f"rl pool {seed}"


class SyntheticArithmetic:
    """An unlimited, seeded stream of training problems, and a disjoint held-out split."""

    def __init__(self, seed: int | str, cells: Sequence[str]):
        if not cells:
            raise ValueError("cells must name at least one difficulty cell, e.g. ('2x1', '3x2')")
        self.cells = tuple(cells)
        self._shapes = [parse_cell(cell) for cell in self.cells]
        self.seed = seed
        self._rng = random.Random(seed)

    def _draw(self, rng: random.Random) -> Problem:
        cell_index = rng.randrange(len(self.cells))
        operator_count, digits = self._shapes[cell_index]
        operands = tuple(rng.randrange(10**digits) for _ in range(operator_count + 1))
        operators = "".join(rng.choice("+-") for _ in range(operator_count))
        expression = str(operands[0])
        answer = operands[0]
        for operator, operand in zip(operators, operands[1:]):
            expression += f"{operator}{operand}"
            answer += operand if operator == "+" else -operand
        return Problem(f"Q:{expression}=?A:", answer, self.cells[cell_index], operands, operators)

    def next_problem(self) -> Problem:
        """The next training problem (never a held-out prompt)."""
        while True:
            problem = self._draw(self._rng)
            if not is_heldout(problem.prompt):
                return problem

    def sample(self, count: int) -> list[Problem]:
        return [self.next_problem() for _ in range(count)]

    def distinct(self, count: int) -> list[Problem]:
        """The next `count` training problems with distinct prompts (a fixed pool of problems)."""
        problems: dict[str, Problem] = {}
        attempts = 0
        while len(problems) < count:
            attempts += 1
            if attempts > 20 * count + 10_000:  # far more than drawing `count` of a big enough cell needs
                raise ValueError(f"cells {self.cells} hold fewer than {count} distinct training problems: ask for "
                                 "fewer (--warm-start-problems) or add wider cells (--warm-start-cells)")
            problem = self.next_problem()
            problems.setdefault(problem.prompt, problem)
        return list(problems.values())

    def __iter__(self) -> Iterator[Problem]:
        while True:
            yield self.next_problem()

    def heldout(self, count: int, seed: int = DEFAULT_HELDOUT_SEED) -> list[Problem]:
        """`count` distinct held-out problems drawn with `seed` (the same list for the same cells and seed)."""
        rng = random.Random(seed)
        problems: dict[str, Problem] = {}
        attempts = 0
        while len(problems) < count:
            attempts += 1
            if attempts > 1000 * count + 10_000:
                raise ValueError(
                    f"could not find {count} distinct held-out problems in cells {self.cells}; ask for fewer"
                )
            problem = self._draw(rng)
            if is_heldout(problem.prompt):
                problems.setdefault(problem.prompt, problem)
        return list(problems.values())

    def state_dict(self) -> dict:
        return {"seed": self.seed, "cells": list(self.cells), "rng_state": self._rng.getstate()}

    def load_state_dict(self, state: dict) -> None:
        if state["seed"] != self.seed or tuple(state["cells"]) != self.cells:
            raise ValueError(
                f"synthetic task state is for seed {state['seed']} and cells {state['cells']}, not seed "
                f"{self.seed} and cells {list(self.cells)}; resume with the same settings"
            )
        version, internal, gauss_next = state["rng_state"]
        self._rng.setstate((version, tuple(internal), gauss_next))


class WarmStartData:
    """The supervised warm start's problems: a fresh stream over `cells` (`problems` 0), or a fixed pool of
    `problems` distinct ones, revisited in a new seeded order each epoch. Never a held-out prompt."""

    def __init__(self, seed: int, cells: Sequence[str], problems: int = 0):
        if problems < 0:
            raise ValueError(f"warm-start problems {problems} must be >= 0 (0: a fresh problem every time)")
        self._stream = SyntheticArithmetic(seed, cells)
        self.pool = self._stream.distinct(problems) if problems else None
        self._order_rng = random.Random(f"warm-start order {seed}")  # apart from the stream of problems
        self._order: list[int] = []

    def sample(self, count: int) -> list[Problem]:
        if self.pool is None:
            return self._stream.sample(count)
        batch = []
        while len(batch) < count:
            if not self._order:
                self._order = list(range(len(self.pool)))
                self._order_rng.shuffle(self._order)
            batch.append(self.pool[self._order.pop()])
        return batch
