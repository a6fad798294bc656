"""Synthetic arithmetic tasks: exact worked solutions, seeded, held-out prompts never in training, a limited warm-start
set, and rewards that read the final answer only and score every format error 0."""

import collections
import itertools
import re
import statistics

import pytest

from megatron_dppo.data.synthetic import (
    ANSWER_MARKER,
    END_MARKER,
    STEP_SEPARATOR,
    TASK_CELLS,
    SyntheticArithmetic,
    WarmStartData,
    format_target,
    max_prompt_length,
    max_target_length,
    parse_cell,
)
from megatron_dppo.data.tokenizer import CharTokenizer
from megatron_dppo.rewards.synthetic import compute_answer_only_score, compute_score

WORKED_CELLS = TASK_CELLS["worked"]
ANSWER_CELLS = TASK_CELLS["answer"]


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
    for problem in SyntheticArithmetic(seed=0, cells=WORKED_CELLS).sample(2000):
        operators, digits = parse_cell(problem.cell)
        expression = problem.prompt.removeprefix("Q:").removesuffix("=?A:")
        operands = expression.replace("-", "+").split("+")
        assert len(operands) == operators + 1 == len(problem.operands) == len(problem.operators) + 1
        assert all(1 <= len(operand) <= digits for operand in operands)
        assert [int(o) for o in operands] == list(problem.operands)
        assert problem.answer == _evaluate_prompt(problem.prompt)


def test_worked_solution_chains_every_intermediate_result_to_the_final_answer():
    step_shape = re.compile(r"(-?\d+)([+-])(\d+)=(-?\d+)")
    for problem in SyntheticArithmetic(seed=3, cells=WORKED_CELLS).sample(2000):
        target = format_target(problem, "worked")
        work, final = target.removesuffix(END_MARKER).split(ANSWER_MARKER)
        assert target.endswith(END_MARKER) and target.count(END_MARKER) == target.count(ANSWER_MARKER) == 1
        assert int(final) == problem.answer
        total = problem.operands[0]
        steps = work.split(STEP_SEPARATOR)
        assert len(steps) == len(problem.operators)
        for step, operator, operand in zip(steps, problem.operators, problem.operands[1:]):
            left, sign, right, result = step_shape.fullmatch(step).groups()
            # each step starts from the previous result, applies the prompt's next operator and operand, and is exact
            assert (int(left), sign, int(right)) == (total, operator, operand)
            total = total + operand if operator == "+" else total - operand
            assert int(result) == total
        assert total == problem.answer


def test_worked_response_lengths_grow_with_difficulty_from_about_15_to_about_150_tokens():
    tokenizer = CharTokenizer.for_synthetic_task()
    lengths = {cell: [len(tokenizer.encode(format_target(p, "worked")))
                      for p in SyntheticArithmetic(seed=4, cells=[cell]).sample(500)] for cell in WORKED_CELLS}
    means = {cell: statistics.fmean(values) for cell, values in lengths.items()}
    shapes = {cell: parse_cell(cell) for cell in WORKED_CELLS}
    assert 12 <= min(min(v) for v in lengths.values()) <= 20
    assert 130 <= max(max(v) for v in lengths.values()) <= 180
    # more operators at the same digits, or more digits at the same operators: a longer mean response
    for first, second in itertools.permutations(WORKED_CELLS, 2):
        (ops_a, digits_a), (ops_b, digits_b) = shapes[first], shapes[second]
        if ops_a <= ops_b and digits_a <= digits_b and (ops_a, digits_a) != (ops_b, digits_b):
            assert means[first] < means[second], (first, second, means)
    # the length bounds used to size the model's context and the response limit hold for every problem
    for cell in WORKED_CELLS:
        problems = SyntheticArithmetic(seed=5, cells=[cell]).sample(500)
        assert max(len(format_target(p, "worked")) for p in problems) <= max_target_length([cell], "worked")
        assert max(len(format_target(p, "answer")) for p in problems) <= max_target_length([cell], "answer")
        assert max(len(p.prompt) for p in problems) <= max_prompt_length([cell])


def test_cells_are_drawn_uniformly_and_answers_can_be_negative():
    problems = SyntheticArithmetic(seed=1, cells=ANSWER_CELLS).sample(7000)
    counts = collections.Counter(p.cell for p in problems)
    assert set(counts) == set(ANSWER_CELLS)
    assert all(800 < count < 1200 for count in counts.values())
    assert any(p.answer < 0 for p in problems)


def test_same_seed_same_stream_and_state_dict_resumes_it():
    first, second = SyntheticArithmetic(seed=7, cells=WORKED_CELLS), SyntheticArithmetic(seed=7, cells=WORKED_CELLS)
    assert first.sample(50) == list(itertools.islice(second, 50))
    assert SyntheticArithmetic(seed=8, cells=WORKED_CELLS).sample(50) != SyntheticArithmetic(7, WORKED_CELLS).sample(50)
    state = first.state_dict()
    expected = first.sample(20)
    resumed = SyntheticArithmetic(seed=7, cells=WORKED_CELLS)
    resumed.load_state_dict(state)
    assert resumed.sample(20) == expected


def test_heldout_prompts_never_appear_in_the_training_stream_or_the_warm_start():
    task = SyntheticArithmetic(seed=0, cells=ANSWER_CELLS)
    heldout = task.heldout(256)
    assert len({p.prompt for p in heldout}) == 256
    assert heldout == SyntheticArithmetic(seed=99, cells=ANSWER_CELLS).heldout(256)  # fixed by its own seed
    assert set(p.cell for p in heldout) == set(ANSWER_CELLS)
    heldout_prompts = {p.prompt for p in task.heldout(2000)}
    training_prompts = {p.prompt for p in task.sample(100_000)}
    assert not heldout_prompts & training_prompts
    # The 2x1 cell has only 4000 prompts, so the stream revisits them: the exclusion is what keeps them apart.
    small = SyntheticArithmetic(seed=0, cells=["2x1"])
    small_heldout = {p.prompt for p in small.heldout(100)}
    assert not small_heldout & {p.prompt for p in small.sample(20_000)}
    assert not small_heldout & {p.prompt for p in WarmStartData(0, ["2x1"], problems=3000).pool}
    assert not small_heldout & {p.prompt for p in WarmStartData(0, ["2x1"]).sample(20_000)}


def test_warm_start_set_is_limited_to_its_problems_and_cells_and_revisited_in_epochs():
    data = WarmStartData(seed=2, cells=["2x1", "3x1"], problems=300)
    pool = {p.prompt for p in data.pool}
    assert len(pool) == 300 and {p.cell for p in data.pool} == {"2x1", "3x1"}
    drawn = data.sample(900)  # three epochs
    assert {p.prompt for p in drawn} == pool
    for epoch in range(3):  # each epoch shows every problem exactly once, in a new order
        assert sorted(p.prompt for p in drawn[300 * epoch: 300 * (epoch + 1)]) == sorted(pool)
    assert [p.prompt for p in drawn[:300]] != [p.prompt for p in drawn[300:600]]
    again = WarmStartData(seed=2, cells=["2x1", "3x1"], problems=300)
    assert again.sample(900) == drawn  # deterministic
    fresh = WarmStartData(seed=2, cells=["2x1"]).sample(2000)  # problems=0: a stream, not a pool
    assert len({p.prompt for p in fresh}) > 1000
    with pytest.raises(ValueError, match="hold fewer than 5000 distinct training problems"):
        WarmStartData(seed=0, cells=["2x1"], problems=5000)
    with pytest.raises(ValueError, match="must be >= 0"):
        WarmStartData(seed=0, cells=["2x1"], problems=-1)


def test_targets_round_trip_through_the_tokenizer_and_score_one():
    tokenizer = CharTokenizer.for_synthetic_task()
    for problem in SyntheticArithmetic(seed=2, cells=WORKED_CELLS).sample(300):
        for task, score in (("worked", compute_score), ("answer", compute_answer_only_score)):
            text = problem.prompt + format_target(problem, task)
            assert not tokenizer.unknown_characters(text)
            ids = tokenizer.encode(text)
            assert len(ids) == len(text) and ids[-1] == tokenizer.eos_token_id
            assert tokenizer.decode(ids) == text
            response = tokenizer.decode(tokenizer.encode(format_target(problem, task)))
            assert score(response, problem.answer) == 1.0
    assert format_target(SyntheticArithmetic(0, ["2x1"]).sample(1)[0], "answer").count(ANSWER_MARKER) == 0


@pytest.mark.parametrize(
    "response, score",
    [
        ("37+58=95,95-12=83#83$", 1.0),
        ("37+58=96,96-12=84#83$", 1.0),  # wrong work, right final answer: the final answer alone is graded
        ("#83$", 1.0),  # no work at all, as a math reward would accept a bare \boxed{83}
        ("37+58=95#083$", 1.0),  # leading zeros are the same integer
        ("37+58=95,95-12=83#84$", 0.0),  # right work, wrong final answer
        ("37+58=95,95-12=83$", 0.0),  # no final-answer marker
        ("37+58=95#95,95-12=83#83$", 0.0),  # two markers: which answer is final?
        ("37+58=95,95-12=83#83", 0.0),  # no end marker: ran out of tokens
        ("37+58=95,95-12=83#83$1", 0.0),  # anything after the end marker
        ("37+58=95,95-12=83#83$$", 0.0),
        ("37+58=95,95-12=83# 83$", 0.0),  # anything but the integer between the markers
        ("37+58=95,95-12=83#83+0$", 0.0),
        ("37+58=95,95-12=83#$", 0.0),
        ("83$", 0.0),  # the answer-only shape is a format error in the worked task
        ("", 0.0),
    ],
)
def test_worked_reward_reads_the_final_answer_only_and_scores_format_errors_zero(response, score):
    assert compute_score(response, 83) == score


@pytest.mark.parametrize(
    "response, score",
    [("-38$", 1.0), ("-038$", 1.0), ("-38", 0.0), ("-38$7", 0.0), ("-38$$", 0.0), (" -38$", 0.0), ("38$", 0.0),
     ("", 0.0), ("$", 0.0), ("#-38$", 0.0)],
)
def test_answer_only_reward_needs_the_exact_integer_followed_only_by_the_end_marker(response, score):
    assert compute_answer_only_score(response, -38) == score


def test_bad_cells_tasks_and_references_are_clear_errors():
    with pytest.raises(ValueError, match="must read '<operators>x<max digits>'"):
        SyntheticArithmetic(seed=0, cells=["2by1"])
    with pytest.raises(ValueError, match="synthetic task 'proof' is not one of"):
        format_target(SyntheticArithmetic(0, ["2x1"]).sample(1)[0], "proof")
    for score in (compute_score, compute_answer_only_score):
        with pytest.raises(ValueError, match="is not an integer"):
            score("3$", "three")


def test_the_rl_pool_is_drawn_apart_from_the_warm_starts_worked_problems():
    from megatron_dppo.data.synthetic import TASK_CELLS
    from megatron_dppo.pipeline.tasks import synthetic_task

    # one --seed for both: without a stream of its own the pool would begin with the warm start's 500 problems
    warm = {p.prompt for p in WarmStartData(seed=1, cells=TASK_CELLS["worked"], problems=500).pool}
    pool = {p.text for p in synthetic_task(CharTokenizer.for_synthetic_task(), 1, 500, 1).prompts}
    assert len(warm & pool) < 25  # chance overlaps only (the one-digit cells hold a few thousand problems)
