"""Synthetic arithmetic task: exact answers, seeded, held-out prompts never in training, exact-shape reward."""

import collections
import itertools

import pytest

from megatron_dppo.data.synthetic import (
    DEFAULT_CELLS,
    END_MARKER,
    SyntheticArithmetic,
    format_target,
    parse_cell,
)
from megatron_dppo.data.tokenizer import CharTokenizer
from megatron_dppo.rewards.synthetic import compute_score


def _evaluate_prompt(prompt: str) -> int:
    expression = prompt.removeprefix("Q:").removesuffix("=?A:")
    total, sign, number = 0, 1, ""
    for character in expression + "+":
        if character.isdigit():
            number += character
        else:
            total += sign * int(number)
            sign, number = (1 if character == "+" else -1), ""
    return total


def test_problems_have_exact_answers_and_the_shape_of_their_cell():
    for problem in SyntheticArithmetic(seed=0).sample(2000):
        operators, digits = parse_cell(problem.cell)
        expression = problem.prompt.removeprefix("Q:").removesuffix("=?A:")
        operands = expression.replace("-", "+").split("+")
        assert len(operands) == operators + 1
        assert all(1 <= len(operand) <= digits for operand in operands)
        assert problem.answer == _evaluate_prompt(problem.prompt)


def test_cells_are_drawn_uniformly_and_answers_can_be_negative():
    problems = SyntheticArithmetic(seed=1).sample(7000)
    counts = collections.Counter(p.cell for p in problems)
    assert set(counts) == set(DEFAULT_CELLS)
    assert all(800 < count < 1200 for count in counts.values())
    assert any(p.answer < 0 for p in problems)


def test_same_seed_same_stream_and_state_dict_resumes_it():
    first, second = SyntheticArithmetic(seed=7), SyntheticArithmetic(seed=7)
    assert first.sample(50) == list(itertools.islice(second, 50))
    assert SyntheticArithmetic(seed=8).sample(50) != SyntheticArithmetic(seed=7).sample(50)
    state = first.state_dict()
    expected = first.sample(20)
    resumed = SyntheticArithmetic(seed=7)
    resumed.load_state_dict(state)
    assert resumed.sample(20) == expected


def test_heldout_prompts_never_appear_in_the_training_stream():
    task = SyntheticArithmetic(seed=0)
    heldout = task.heldout(256)
    assert len({p.prompt for p in heldout}) == 256
    assert heldout == SyntheticArithmetic(seed=99).heldout(256)  # fixed by its own seed, not the stream's
    assert set(p.cell for p in heldout) == set(DEFAULT_CELLS)
    heldout_prompts = {p.prompt for p in task.heldout(2000)}
    training_prompts = {p.prompt for p in task.sample(100_000)}
    assert not heldout_prompts & training_prompts
    # The 2x1 cell has only 4000 prompts, so the stream revisits them: the exclusion is what keeps them apart.
    small = SyntheticArithmetic(seed=0, cells=["2x1"])
    assert not {p.prompt for p in small.heldout(100)} & {p.prompt for p in small.sample(20_000)}


def test_supervised_target_is_the_answer_then_the_end_marker_and_scores_one():
    tokenizer = CharTokenizer.for_synthetic_task()
    for problem in SyntheticArithmetic(seed=2).sample(200):
        target = format_target(problem)
        assert target == f"{problem.answer}{END_MARKER}"
        ids = tokenizer.encode(problem.prompt + target)
        assert ids[-1] == tokenizer.eos_token_id
        assert compute_score(tokenizer.decode(tokenizer.encode(target)), problem.answer) == 1.0


@pytest.mark.parametrize(
    "response, score",
    [("-38$", 1.0), ("-038$", 1.0), ("-38", 0.0), ("-38$7", 0.0), ("-38$$", 0.0), (" -38$", 0.0), ("38$", 0.0),
     ("", 0.0), ("$", 0.0)],
)
def test_synthetic_reward_needs_the_exact_integer_followed_only_by_the_end_marker(response, score):
    assert compute_score(response, -38) == score


def test_bad_cells_and_references_are_clear_errors():
    with pytest.raises(ValueError, match="must read '<operators>x<max digits>'"):
        SyntheticArithmetic(seed=0, cells=["2by1"])
    with pytest.raises(ValueError, match="is not an integer"):
        compute_score("3$", "three")
