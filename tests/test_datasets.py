"""Prompt data: the built-in files, a user's JSONL / JSON / Parquet files and directories with their own field names
and chat messages, every bad input's error, length filtering, resumable shuffling, templates."""

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_dppo.data.datasets import (
    DATASETS,
    DataFormatError,
    PromptDataError,
    PromptSampler,
    encode_examples,
    filter_by_prompt_length,
    load_dataset,
    load_prompt_data,
)
from megatron_dppo.data.paths import shared_data_dir
from megatron_dppo.data.templates import BOXED_INSTRUCTION, encode_prompt, render_prompt, with_instruction
from megatron_dppo.data.tokenizer import CharTokenizer

PROJECT_ROOT = Path(__file__).resolve().parents[1]

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


@pytest.mark.shared_data
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_data_file_loads_with_the_right_problem_and_answer_fields(name):
    rows, problem_start, answer = EXPECTED[name]
    examples = load_dataset(name)
    assert len(examples) == rows
    assert examples[0].prompt.startswith(problem_start)
    assert all(e.prompt.endswith(f"\n\n{BOXED_INSTRUCTION}") for e in examples)
    assert examples[0].answer == answer
    assert all(e.prompt.strip() and e.answer.strip() for e in examples)


@pytest.mark.shared_data
def test_benchmark_spot_checks_of_answers_in_odd_layouts():
    assert load_dataset("aime24")[7].answer == "025"  # a string with a leading zero, kept as written
    amc = load_dataset("amc23")
    assert all("." not in e.answer for e in amc if float(e.answer).is_integer())  # 27.0 -> "27"
    olympiad = load_dataset("olympiadbench")
    assert olympiad[1].answer == "\\frac{1}{2 n+2}"  # '$...$' stripped from final_answer
    answers = {e.answer for e in olympiad}
    assert {"(1,8,19), (2,7,13), (4,5,7)", "69,84", "f(n)=n, g(n)=1"} <= answers  # '$69$,$84$' -> '69,84'
    assert not any("$" in answer.replace("\\$", "") for answer in answers)


@pytest.mark.shared_data
def test_math_train_has_two_rows_without_a_final_answer_reported_with_file_and_row(caplog):
    with pytest.raises(DataFormatError, match=r"math/train\.jsonl, row 5342: the solution has no \\boxed.*--skip-bad"):
        load_dataset("math_train")
    with caplog.at_level(logging.WARNING):
        examples = load_dataset("math_train", skip_bad_rows=True)
    assert len(examples) == 7498
    assert any("skipped 2 of 7500 rows" in r.getMessage() for r in caplog.records)


def test_malformed_rows_of_a_built_in_layout_raise_with_file_and_row_or_are_counted_when_skipped(tmp_path, caplog):
    """Up to 1% of a set's rows may be left out by --skip-bad-rows (counted in one warning); more is refused in one
    line naming the set, the count and the fix, as is a set with no usable row."""
    bench = tmp_path / "bench"
    bench.mkdir()
    good = [{"problem": f"{i}+1?", "answer": float(i + 1)} for i in range(198)]
    bad = [{"problem": "", "answer": "9"}, {"problem": "2+2?"}, {"problem": ["3+3?"], "answer": "6"}]
    (bench / "amc23.jsonl").write_text("".join(json.dumps(row) + "\n" for row in good[:1] + bad[:2] + good[1:]))
    with pytest.raises(DataFormatError, match=r"amc23\.jsonl, row 2: field 'problem' .*--skip-bad-rows"):
        load_dataset("amc23", data_dir=tmp_path)
    with caplog.at_level(logging.WARNING):
        examples = load_dataset("amc23", data_dir=tmp_path, skip_bad_rows=True)
    assert [(e.answer, e.row) for e in examples[:2]] == [("1", 1), ("2", 4)] and len(examples) == 198
    assert any("skipped 2 of 200 rows" in r.getMessage() and "amc23.jsonl, row 2" in r.getMessage()
               for r in caplog.records)

    (bench / "amc23.jsonl").write_text("".join(json.dumps(row) + "\n" for row in good[:1] + bad + good[1:]))
    with pytest.raises(PromptDataError, match=r"^amc23 \(.*amc23\.jsonl\): 3 of 201 rows are bad \(1\.5%; "
                                              r"--skip-bad-rows leaves out at most 1%\).*row 2.*: the local copy"):
        load_dataset("amc23", data_dir=tmp_path, skip_bad_rows=True)
    (bench / "amc23.jsonl").write_text("".join(json.dumps(row) + "\n" for row in bad))
    with pytest.raises(PromptDataError, match=r"^amc23 \(.*\): no usable rows \(all 3 bad and skipped; first: "):
        load_dataset("amc23", data_dir=tmp_path, skip_bad_rows=True)


def test_unknown_data_set_name_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown data set 'math600'"):
        load_dataset("math600")


@pytest.mark.shared_data
def test_every_registered_file_exists_in_the_shared_data():
    assert all((shared_data_dir() / spec.relative_path).is_file() for spec in DATASETS.values())


@pytest.mark.shared_data
def test_length_filter_keeps_exactly_the_prompts_within_the_budget():
    examples = load_dataset("gsm8k_test", limit=200)
    render = lambda prompt: render_prompt(prompt, apply_chat_template=False)
    kept = filter_by_prompt_length(examples, render, list, max_prompt_tokens=300)  # one token per character
    assert 0 < len(kept) < len(examples)
    assert kept == [e for e in examples if len(render(e.prompt)) <= 300]


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


def test_text_prompts_are_used_as_written_and_chat_messages_need_the_chat_template(tmp_path):
    tokenizer = CharTokenizer.for_text()
    assert render_prompt("What is 2+2?", apply_chat_template=False) == "What is 2+2?"
    assert encode_prompt("What is 2+2?", False, tokenizer) == tokenizer.encode("What is 2+2?")
    assert with_instruction("What is 2+2?") == f"What is 2+2?\n\n{BOXED_INSTRUCTION}"
    with pytest.raises(ValueError, match="pass --apply-chat-template"):
        render_prompt([{"role": "user", "content": "hi"}], apply_chat_template=False)
    with pytest.raises(ValueError, match="has no chat template.*drop the flag"):
        render_prompt("What is 2+2?", True, tokenizer)


# ------------------------------------------------------------------ a user's own files
# The same three rows, written as JSON lines, a JSON list, Parquet and a directory of shards in mixed formats, under
# the user's own field names ("question" / "final"), with chat-message prompts and integer labels.
USER_ROWS = [
    {"question": [{"role": "user", "content": "What is 2+2?"}], "final": 4},
    {"question": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 3+5?"}], "final": 8},
    {"question": [{"role": "user", "content": "What is 6*7?"}], "final": 42},
]
USER_KEYS = dict(input_key="question", label_key="final")


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def write_parquet(path: Path, rows: list[dict]) -> Path:
    from datasets import Dataset

    Dataset.from_list(rows).to_parquet(str(path))
    return path


def user_sources(root: Path) -> dict[str, Path]:
    shards = root / "shards"
    shards.mkdir()
    write_parquet(shards / "part-00.parquet", USER_ROWS[:2])
    write_jsonl(shards / "part-01.jsonl", USER_ROWS[2:])
    (root / "rows.json").write_text(json.dumps(USER_ROWS))
    return {"jsonl": write_jsonl(root / "rows.jsonl", USER_ROWS), "json": root / "rows.json",
            "parquet": write_parquet(root / "rows.parquet", USER_ROWS), "shards": shards}


def test_jsonl_json_parquet_and_a_directory_of_shards_load_the_same_prompts_and_labels(tmp_path):
    loaded = {kind: load_prompt_data(str(path), **USER_KEYS, reward_type="gsm8k")
              for kind, path in user_sources(tmp_path).items()}
    expected = [(row["question"], str(row["final"])) for row in USER_ROWS]
    for kind, examples in loaded.items():
        assert [(e.prompt, e.answer) for e in examples] == expected, kind
    assert [(e.source.endswith(name), e.row) for e, name in zip(loaded["shards"], ("parquet",) * 2 + ("jsonl",))] == [
        (True, 1), (True, 2), (True, 1)]  # each row names its own shard and its row in it
    assert [len(e) for e in (load_prompt_data(str(tmp_path / "rows.parquet"), **USER_KEYS, limit=2),)] == [2]


def test_chat_template_applied_equals_the_tokenizers_own_apply_chat_template(tmp_path):
    from tests.tiny_chat import save_chat_tokenizer

    tokenizer = save_chat_tokenizer(tmp_path / "tokenizer")
    examples = load_prompt_data(str(write_parquet(tmp_path / "rows.parquet", USER_ROWS)), **USER_KEYS)
    text_prompts = load_prompt_data(str(write_jsonl(tmp_path / "text.jsonl", [{"prompt": "What is 1+1?",
                                                                                "label": "2"}])))
    encoded = encode_examples(examples + text_prompts, apply_chat_template=True, tokenizer=tokenizer)
    own = [tokenizer.apply_chat_template(row["question"], add_generation_prompt=True)["input_ids"] for row in USER_ROWS]
    own.append(tokenizer.apply_chat_template([{"role": "user", "content": "What is 1+1?"}],
                                             add_generation_prompt=True)["input_ids"])
    assert encoded == own
    assert all(ids.count(tokenizer.bos_token_id) == 1 for ids in encoded)  # the template's own BOS, none added
    assert tokenizer.decode(encoded[-1]) == "<bos><|user|>What is 1+1?<|end|>\n<|assistant|>"


BAD_INPUTS = [  # (rows of a JSON-lines file, reward type, error pattern)
    ([{"question": "a?"}], "math",
     r"rows\.jsonl: has no field 'final' \(its fields: \['question'\]\): pass --label-key"),
    ([{"final": "1"}], "math", r"has no field 'question' .*pass --input-key"),
    ([{"question": "a?", "final": "1"}, {"question": "b?"}], "math",
     r"rows\.jsonl, row 2: field 'final' is missing or null \(fix the row, or leave bad rows out with --skip-bad-rows"),
    ([{"question": "  ", "final": "1"}], "math", r"row 1: field 'question' is empty or malformed.*--skip-bad-rows"),
    ([{"question": [], "final": "1"}], "math", r"row 1: field 'question' is empty or malformed"),
    ([{"question": "a?", "final": " "}], "math", r"row 1: field 'final' is empty"),
    ([{"question": "a?", "final": "four"}], "gsm8k",
     r"row 1: field 'final' = 'four' cannot be read by the gsm8k reward"),
    ([{"question": "a?", "final": "4.5"}], "synthetic", r"cannot be read by the synthetic reward"),
    ([{"question": "a?", "final": {"value": 4}}], "math", r"row 1: field 'final' must be a string or a number"),
]


@pytest.mark.parametrize("rows, reward_type, error", BAD_INPUTS)
def test_each_bad_row_names_the_file_the_row_and_the_fix(tmp_path, rows, reward_type, error):
    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    with pytest.raises(PromptDataError, match=error):
        load_prompt_data(str(path), **USER_KEYS, reward_type=reward_type)


def test_unreadable_and_missing_sources_name_themselves(tmp_path):
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 this is not a parquet file")
    (tmp_path / "broken.jsonl").write_text('{"question": "a?", "final": "1"}\n{"question": "b?", "final": \n')
    (tmp_path / "rows.csv").write_text("question,final\na?,1\n")
    (tmp_path / "empty").mkdir()
    cases = {
        "broken.parquet": r"broken\.parquet: cannot be read as parquet",
        "broken.jsonl": r"broken\.jsonl:2: not valid JSON .*fix or delete the line",
        "rows.csv": r"unsupported file type '\.csv'; use \.jsonl",
        "missing.jsonl": r"--prompt-data .*missing\.jsonl: no such file or directory",
        "empty": r"the directory holds no \.jsonl, \.json, \.parquet files",
    }
    for name, error in cases.items():
        with pytest.raises(PromptDataError, match=error):
            load_prompt_data(str(tmp_path / name), **USER_KEYS)


def test_skip_bad_rows_leaves_them_out_counts_and_reports_them(tmp_path, caplog):
    good = [{"question": f"{i}+1?", "final": i + 1} for i in range(198)]
    rows = [good[0], {"question": "", "final": "1"}, *good[1:], {"question": "b?", "final": None}]
    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    with caplog.at_level(logging.WARNING):
        examples = load_prompt_data(str(path), **USER_KEYS, skip_bad_rows=True)
    assert [(e.answer, e.row) for e in examples[:2]] == [("1", 1), ("2", 3)] and len(examples) == 198
    (warning,) = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert "skipped 2 of 200 rows" in warning and "rows.jsonl, row 2" in warning
    with pytest.raises(PromptDataError, match="no usable rows"):
        load_prompt_data(str(write_jsonl(tmp_path / "bad.jsonl", rows[1::199])), **USER_KEYS, skip_bad_rows=True)


def test_a_label_field_of_another_type_is_refused_with_skip_bad_rows_not_skipped_into_an_empty_set(tmp_path):
    """A file whose label field changed type (numbers became records) makes every row bad: --skip-bad-rows refuses
    it in one line naming the source, the count and the fields to check, where it would have trained on nothing."""
    rows = [{"question": f"{i}+1?", "final": {"value": i + 1}} for i in range(50)]
    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    with pytest.raises(PromptDataError) as refused:
        load_prompt_data(str(path), **USER_KEYS, skip_bad_rows=True)
    message = str(refused.value)
    assert "\n" not in message and message.startswith(f"--prompt-data {path}: no usable rows (all 50 bad and skipped")
    assert "check 'question' (--input-key) and 'final' (--label-key)" in message
    rows[0]["final"] = 1  # one readable row in 50: 98% bad
    with pytest.raises(PromptDataError, match=r"49 of 50 rows are bad \(98\.0%"):
        load_prompt_data(str(write_jsonl(path, rows)), **USER_KEYS, skip_bad_rows=True)


def test_a_folder_holding_a_hugging_face_data_set_is_read_in_the_configuration_given(tmp_path):
    """--prompt-data-config picks one configuration of a Hugging Face data set (its card's `configs`), on the Hub or
    downloaded whole into a folder (read here: no network); without it, a folder is a directory of files, and a
    configuration given for a file or a built-in set is refused, one line each."""
    from megatron_dppo.data.checks import prompt_source_errors

    folder = tmp_path / "gsm8k"
    for config, answers in (("main", (3, 4)), ("socratic", (5,))):
        write_parquet_at(folder / config / "train-00000-of-00001.parquet",
                         [{"question": f"{config} {a}?", "answer": f"so\n#### {a}"} for a in answers])
    (folder / "README.md").write_text("---\nconfigs:\n" + "".join(
        f"- config_name: {config}\n  data_files:\n  - split: train\n    path: {config}/train-*\n"
        for config in ("main", "socratic")) + "---\n")
    keys = dict(input_key="question", label_key="answer", reward_type="gsm8k")
    main = load_prompt_data(str(folder), **keys, config="main")
    assert [(e.prompt, e.answer) for e in main] == [("main 3?", "so\n#### 3"), ("main 4?", "so\n#### 4")]
    assert [e.prompt for e in load_prompt_data(str(folder), **keys, config="socratic")] == ["socratic 5?"]
    assert main[0].source == f"{folder} [main, train]"
    with pytest.raises(PromptDataError, match="the directory holds no"):
        load_prompt_data(str(folder), **keys)
    rows = write_jsonl(tmp_path / "rows.jsonl", [{"question": "a?", "answer": "1"}])
    assert prompt_source_errors("--prompt-data", str(rows), "train", False, "main", training=True) == [
        f"--prompt-data-config main names a configuration of a Hugging Face data set; {rows} is a local source "
        "read whole: drop it"]
    assert prompt_source_errors("--prompt-data", str(folder), "train", True, "main", training=True) == []


def write_parquet_at(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_parquet(path, rows)


def test_chat_messages_without_the_flag_and_a_flag_without_a_template_name_the_row_or_the_tokenizer(tmp_path):
    examples = load_prompt_data(str(write_jsonl(tmp_path / "rows.jsonl", USER_ROWS)), **USER_KEYS)
    with pytest.raises(PromptDataError, match=r"rows\.jsonl, row 1: the prompt is a list of chat messages: pass "
                                              r"--apply-chat-template"):
        encode_examples(examples, apply_chat_template=False, tokenizer=CharTokenizer.for_text())
    with pytest.raises(ValueError, match="has no chat template"):
        encode_examples(examples, apply_chat_template=True, tokenizer=CharTokenizer.for_text())


def test_a_hub_name_says_it_needs_the_network_when_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # this machine has no hub access; the message must say what to do
    with pytest.raises(PromptDataError, match=r"--prompt-data someone/math-prompts: no local file or directory has "
                                              r"that name, so it was taken as a Hugging Face hub data set, which needs "
                                              r"network access, and HF_HUB_OFFLINE forbid.*Pass a local \.jsonl"):
        load_prompt_data("someone/math-prompts")


def test_a_built_in_name_without_the_data_says_where_to_put_it_or_what_to_pass(monkeypatch, tmp_path):
    monkeypatch.setenv("DPPO_DATA_DIR", str(tmp_path / "nowhere"))
    with pytest.raises(PromptDataError, match=r"--prompt-data math: the built-in set is read from .*nowhere/math/"
                                              r"train\.jsonl, which does not exist \(DPPO_DATA_DIR=.*\(does not "
                                              r"exist\)\)\..*docs/data_and_rewards\.md.*tools/prepare_data\.py"):
        load_prompt_data("math", training=True)


@pytest.mark.shared_data
def test_prepared_parquet_holds_exactly_the_built_in_prompts_and_labels(tmp_path):
    command = [sys.executable, str(PROJECT_ROOT / "tools" / "prepare_data.py"), "--out", str(tmp_path), "--sets",
               "math500", "gsm8k_test", "olympiadbench"]
    finished = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=PROJECT_ROOT)
    assert finished.returncode == 0, finished.stderr[-3000:]
    for name in ("math500", "gsm8k_test", "olympiadbench"):
        prepared = load_prompt_data(str(tmp_path / f"{name}.parquet"), reward_type=DATASETS[name].reward_type)
        assert [(e.prompt, e.answer) for e in prepared] == [(e.prompt, e.answer) for e in load_dataset(name)], name


def test_prepare_data_writes_every_set_it_can_and_names_each_one_it_cannot_a_changed_type_among_them(tmp_path):
    """Offline, from tiny copies of the public sources where amc23's `problem` became a list (a type change the
    presence check alone would pass, and every row then bad) and aime24's source is not cached: both are refused in
    one line each, naming the set and why, while the sets after them are still written; the exit status is 1."""
    from tests.hub_cache import PUBLIC_SOURCE_FILES, place_in_hub_cache, write_rows

    hf_home, staging = tmp_path / "hf_home", tmp_path / "staging"
    for repo in ("FlippyDora/amc23", "knoveleng/Minerva-Math", "Hothan/OlympiadBench"):
        for relative, rows in PUBLIC_SOURCE_FILES[repo].items():
            changed = [{**row, "problem": [row["problem"]]} for row in rows] if repo == "FlippyDora/amc23" else rows
            write_rows(changed, staging / repo / relative)
        place_in_hub_cache(hf_home, repo, staging / repo, repo_type="dataset")
    finished = subprocess.run(
        [sys.executable, str(PROJECT_ROOT / "tools" / "prepare_data.py"), "--out", str(tmp_path / "out"), "--sets",
         "aime24", "amc23", "minerva_math", "olympiadbench", "--skip-bad-rows"], capture_output=True, text=True,
        timeout=300, cwd=PROJECT_ROOT, env={**os.environ, "PYTHONPATH": str(PROJECT_ROOT),
                                            "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1",
                                            "DPPO_DATA_DIR": str(tmp_path / "nowhere")})
    assert finished.returncode == 1, finished.stderr[-3000:]
    written = [line.split()[0] for line in finished.stdout.splitlines()]
    assert written == ["minerva_math", "olympiadbench"], finished.stdout
    assert all("(0 bad rows left out;" in line for line in finished.stdout.splitlines())
    aime, amc, summary = finished.stderr.strip().splitlines()
    assert aime.startswith("prepare_data.py: error: aime24 (no local copy; its public source) HuggingFaceH4/aime_2024")
    assert amc.startswith("prepare_data.py: error: amc23: FlippyDora/amc23@") and (
        "'s field 'problem' holds List(Value('string')), where text was expected: the source has changed; put "
        "bench/amc23.jsonl under DPPO_DATA_DIR instead") in amc, amc
    assert summary == "prepare_data.py: error: 2 of 4 sets not written (aime24, amc23): see their lines above"
    assert sorted(path.name for path in (tmp_path / "out").iterdir()) == ["minerva_math.parquet",
                                                                         "olympiadbench.parquet"]
