"""Loaders for every shared data file, malformed rows, length filtering, resumable shuffling, templates."""

import json
import logging

import pytest

from megatron_dppo.data.datasets import (
    DATASETS,
    DataFormatError,
    PromptSampler,
    filter_by_prompt_length,
    load_dataset,
)
from megatron_dppo.data.paths import shared_data_dir
from megatron_dppo.data.templates import BOXED_INSTRUCTION, encode_prompt, render_prompt
from megatron_dppo.data.tokenizer import CharTokenizer

# name -> (rows, first problem starts with, first answer)
EXPECTED = {
    "math500": (500, "Convert the point $(0,3)$", "\\left( 3, \\frac{\\pi}{2} \\right)"),
    "gsm8k": (1319, "Janet\u2019s ducks lay 16 eggs", "18"),
    "aime24": (30, "Every morning Aya goes for a $9$-kilometer", "204"),
    "amc23": (40, "Cities $A$ and $B$ are $45$ miles apart", "27"),
    "minerva_math": (272, "Each of the two Magellan telescopes", "1.6"),
    "olympiadbench": (675, "Xenia and Sergey play the following game", "2"),
    "math_test": (5000, "How many vertical asymptotes", "2"),
    "gsm8k_test": (1319, "Janet\u2019s ducks lay 16 eggs", "18"),
    "gsm8k_train": (7473, "Natalia sold clips to 48", "72"),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_data_file_loads_with_the_right_problem_and_answer_fields(name):
    rows, problem_start, answer = EXPECTED[name]
    examples = load_dataset(name)
    assert len(examples) == rows
    assert examples[0].problem.startswith(problem_start)
    assert examples[0].answer == answer
    assert all(e.problem.strip() and e.answer.strip() for e in examples)


def test_benchmark_spot_checks_of_answers_in_odd_layouts():
    assert load_dataset("aime24")[7].answer == "025"  # a string with a leading zero, kept as written
    amc = load_dataset("amc23")
    assert all("." not in e.answer for e in amc if float(e.answer).is_integer())  # 27.0 -> "27"
    olympiad = load_dataset("olympiadbench")
    assert olympiad[1].answer == "\\frac{1}{2 n+2}"  # '$...$' stripped from final_answer
    answers = {e.answer for e in olympiad}
    assert {"(1,8,19), (2,7,13), (4,5,7)", "69,84", "f(n)=n, g(n)=1"} <= answers  # '$69$,$84$' -> '69,84'
    assert not any("$" in answer.replace("\\$", "") for answer in answers)


def test_math_train_has_two_rows_without_a_final_answer_reported_with_file_and_line(caplog):
    with pytest.raises(DataFormatError, match=r"math/train\.jsonl:5342: the solution has no \\boxed"):
        load_dataset("math_train")
    with caplog.at_level(logging.WARNING):
        examples = load_dataset("math_train", skip_bad_rows=True)
    assert len(examples) == 7498
    assert any("skipped 2 malformed rows" in r.getMessage() for r in caplog.records)


def test_malformed_rows_raise_with_file_and_line_or_are_counted_when_skipped(tmp_path, caplog):
    bench = tmp_path / "bench"
    bench.mkdir()
    rows = [
        json.dumps({"problem": "1+1?", "answer": 2.0}),
        "{not json",
        json.dumps({"problem": "2+2?"}),
        json.dumps({"problem": "3+3?", "answer": "6"}),
    ]
    (bench / "amc23.jsonl").write_text("\n".join(rows) + "\n")
    with pytest.raises(DataFormatError, match=r"amc23\.jsonl:2: .*--skip-bad-rows"):
        load_dataset("amc23", data_dir=tmp_path)
    with caplog.at_level(logging.WARNING):
        examples = load_dataset("amc23", data_dir=tmp_path, skip_bad_rows=True)
    assert [(e.answer, e.line) for e in examples] == [("2", 1), ("6", 4)]
    assert any("skipped 2 malformed rows" in r.getMessage() for r in caplog.records)


def test_unknown_data_set_name_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown data set 'math600'"):
        load_dataset("math600")


def test_every_registered_file_exists_in_the_shared_data():
    assert all((shared_data_dir() / spec.relative_path).is_file() for spec in DATASETS.values())


def test_length_filter_keeps_exactly_the_prompts_within_the_budget():
    examples = load_dataset("gsm8k_test", limit=200)
    render = lambda problem: render_prompt(problem, "plain")
    kept = filter_by_prompt_length(examples, render, list, max_prompt_tokens=300)  # one token per character
    assert 0 < len(kept) < len(examples)
    assert kept == [e for e in examples if len(render(e.problem)) <= 300]


def test_prompt_sampler_is_deterministic_covers_each_epoch_and_resumes_exactly():
    sampler = PromptSampler(10, seed=3)
    first_epoch = sampler.next_indices(10)
    assert sorted(first_epoch) == list(range(10))
    assert PromptSampler(10, seed=3).next_indices(10) == first_epoch
    assert PromptSampler(10, seed=4).next_indices(10) != first_epoch
    sampler.next_indices(4)
    state = sampler.state_dict()
    expected = sampler.next_indices(23)
    resumed = PromptSampler(10, seed=3)
    resumed.load_state_dict(state)
    assert resumed.next_indices(23) == expected
    with pytest.raises(ValueError, match="resume with the same data and seed"):
        PromptSampler(11, seed=3).load_state_dict(state)


def test_templates_ask_for_a_boxed_answer_and_use_a_chat_template_only_when_there_is_one(tmp_path):
    from transformers import AutoTokenizer

    CharTokenizer.for_text().save_pretrained(tmp_path)
    hf_tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    plain = render_prompt("What is 2+2?", "auto", hf_tokenizer)  # no chat template: plain
    assert plain.startswith("Question: What is 2+2?") and BOXED_INSTRUCTION in plain
    with pytest.raises(ValueError, match="needs a tokenizer with a chat template"):
        render_prompt("What is 2+2?", "chat", hf_tokenizer)
    hf_tokenizer.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    chat = render_prompt("What is 2+2?", "auto", hf_tokenizer)
    assert chat == f"<user>What is 2+2?\n\n{BOXED_INSTRUCTION}<assistant>"
    assert encode_prompt("What is 2+2?", "auto", hf_tokenizer) == hf_tokenizer.encode(chat)
