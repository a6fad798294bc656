"""Synthetic multi-step integer arithmetic: the task of the embedded default demo.

    seed ──► cell (ops x max digits, uniform over `cells`) ──► operands in [0, 10^digits) and +/- operators
         ──► Problem(prompt "Q:37+58-12=?A:", answer -> "33", cell "2x2")

- Difficulty cells `OxD`: O operators (O+1 operands), each operand with at most D digits. The default cells
  (2x1 2x2 2x3 3x1 3x2 4x1 4x2) start a 0.6M-parameter model low after a short warm start, with room for RL
  (research/calibration.md).
- Held-out split: a prompt is held out when a stable hash of its string falls in a reserved bucket
  (1/`HELDOUT_BUCKETS` of all prompts). The training stream skips those prompts, and `heldout(n, seed)` draws only
  from them, so no held-out prompt string ever appears in training, whatever n, seed or stream length.
- Deterministic: the same seed gives the same stream, and `state_dict()` resumes it exactly.
- Supervised target: `format_target(problem)` is the answer followed by the end marker `$` (the char tokenizer's
  eos); the reward (`megatron_dppo.rewards.synthetic`) demands exactly that shape.
"""

import hashlib
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

END_MARKER = "$"
DEFAULT_CELLS = ("2x1", "2x2", "2x3", "3x1", "3x2", "4x1", "4x2")
DEFAULT_HELDOUT_SEED = 12345
HELDOUT_BUCKETS = 16  # 1 prompt in 16 is reserved for evaluation


@dataclass(frozen=True)
class Problem:
    prompt: str  # "Q:37+58-12=?A:"
    answer: int
    cell: str  # "2x2": operators x max digits


def parse_cell(cell: str) -> tuple[int, int]:
    """'3x2' -> (3 operators, 2 max digits)."""
    operators, separator, digits = cell.partition("x")
    if separator != "x" or not operators.isdigit() or not digits.isdigit() or int(operators) < 1 or int(digits) < 1:
        raise ValueError(f"difficulty cell {cell!r} must read '<operators>x<max digits>' with both >= 1, e.g. '3x2'")
    return int(operators), int(digits)


def is_heldout(prompt: str) -> bool:
    """True for the prompts reserved for evaluation (a stable hash, the same in every process)."""
    digest = hashlib.blake2b(prompt.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % HELDOUT_BUCKETS == 0


def format_target(problem: Problem) -> str:
    """The supervised completion for a prompt: the decimal answer and the end marker."""
    return f"{problem.answer}{END_MARKER}"


class SyntheticArithmetic:
    """An unlimited, seeded stream of training problems, and a disjoint held-out split."""

    def __init__(self, seed: int, cells: Sequence[str] = DEFAULT_CELLS):
        if not cells:
            raise ValueError("cells must name at least one difficulty cell, e.g. ('2x1', '3x2')")
        self.cells = tuple(cells)
        self._shapes = [parse_cell(cell) for cell in self.cells]
        self.seed = seed
        self._rng = random.Random(seed)

    def _draw(self, rng: random.Random) -> Problem:
        cell_index = rng.randrange(len(self.cells))
        operators, digits = self._shapes[cell_index]
        operands = [rng.randrange(10**digits) for _ in range(operators + 1)]
        signs = [rng.choice("+-") for _ in range(operators)]
        expression = str(operands[0])
        answer = operands[0]
        for sign, operand in zip(signs, operands[1:]):
            expression += f"{sign}{operand}"
            answer += operand if sign == "+" else -operand
        return Problem(f"Q:{expression}=?A:", answer, self.cells[cell_index])

    def next_problem(self) -> Problem:
        """The next training problem (never a held-out prompt)."""
        while True:
            problem = self._draw(self._rng)
            if not is_heldout(problem.prompt):
                return problem

    def sample(self, count: int) -> list[Problem]:
        return [self.next_problem() for _ in range(count)]

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
