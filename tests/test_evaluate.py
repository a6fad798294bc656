"""Evaluation: pass@1 / maj@k aggregation on fixed completions, and tools/evaluate.py end to end."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_dppo.pipeline.evaluation import SampleScore, aggregate, majority_score, markdown_table, score_samples
from megatron_dppo.rewards.math import VerifierPool

PROJECT_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def pool():
    with VerifierPool(num_workers=1) as verifier_pool:
        yield verifier_pool


def test_pass_at_1_is_the_mean_over_samples_and_maj_at_k_votes_on_parsed_answers(pool):
    # Problem 1 (answer 1/2): 2 of 4 right ('0.5' and '\\frac12', by math-verify), but '3' has the most votes.
    # Problem 2 (answer 7): 2 of 4 right; '7' (boxed, and "the answer is 7.") wins; the last sample has no answer.
    texts = [
        "so \\boxed{0.5}", "the answer is 3", "\\boxed{3}", "\\boxed{\\frac12}",
        "\\boxed{7}", "the answer is 7.", "\\boxed{8}", "nothing here",
    ]
    references = ["\\frac{1}{2}"] * 4 + ["7"] * 4
    scores = score_samples("math", texts, references, pool)
    assert [s.score for s in scores] == [1, 0, 0, 1, 1, 1, 0, 0]
    per_problem = [scores[:4], scores[4:]]
    assert majority_score(per_problem[0]) == 0.0  # '3' (2 votes) beats '0.5' and '\\frac12' (1 each)
    assert majority_score(per_problem[1]) == 1.0  # '7' (2 votes)
    summary = aggregate(per_problem)
    assert summary == {"pass@1": pytest.approx((2 / 4 + 2 / 4) / 2), "maj@k": 0.5}


def test_gsm8k_votes_group_equal_numbers_written_differently():
    texts = ["#### 1,000", "the answer is 1000.0", "\\boxed{999}"]
    scores = score_samples("gsm8k", texts, ["1000"] * 3, None)
    assert [s.score for s in scores] == [1.0, 1.0, 0.0]
    assert scores[0].vote_key == scores[1].vote_key
    assert majority_score(scores) == 1.0


def test_majority_ties_go_to_the_first_answer_and_no_vote_scores_zero():
    assert majority_score([SampleScore(0.0, "a"), SampleScore(1.0, "b")]) == 0.0
    assert majority_score([SampleScore(1.0, "b"), SampleScore(0.0, "a")]) == 1.0
    assert majority_score([SampleScore(0.0, None), SampleScore(0.0, None)]) == 0.0


def test_markdown_table_has_one_row_per_benchmark():
    table = markdown_table({"aime24": {"num_problems": 30, "k": 4, "pass@1": 0.125, "maj@k": 0.2}})
    assert table.splitlines()[2] == "| aime24 | 30 | 4 | 12.5 | 20.0 |"


@pytest.mark.shared_data
def test_evaluate_tool_runs_end_to_end_with_the_embedded_engine_on_a_20_problem_slice(tmp_path):
    from megatron_dppo.convert.tiny import save_random_hf_model, tiny_hf_config
    from megatron_dppo.data.tokenizer import CharTokenizer

    model_dir = tmp_path / "model"
    tokenizer = CharTokenizer.for_text()
    config = tiny_hf_config(
        "qwen2", vocab_size=tokenizer.vocab_size, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
        ffn_hidden_size=64, max_position_embeddings=2048, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
    )
    save_random_hf_model(config, model_dir)
    tokenizer.save_pretrained(model_dir)
    output_dir = tmp_path / "eval"
    command = [
        sys.executable, str(PROJECT_ROOT / "tools" / "evaluate.py"), "--model-dir", str(model_dir),
        "--benchmarks", "gsm8k", "math500", "--limit", "20", "--k", "2", "--temperature", "1.0",
        "--max-new-tokens", "24", "--output-dir", str(output_dir), "--reward-workers", "1", "--no-progress",
    ]
    finished = subprocess.run(command, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=300)
    assert finished.returncode == 0, finished.stderr[-3000:]

    results = json.loads((output_dir / "results.json").read_text())
    assert results["config"]["k"] == 2 and results["config"]["limit"] == 20
    assert list(results["benchmarks"]) == ["gsm8k", "math500"]
    for summary in results["benchmarks"].values():
        assert summary["num_problems"] == 20 and summary["k"] == 2
        assert len(summary["problems"]) == 20
        for problem in summary["problems"]:
            assert all(len(problem[field]) == 2 for field in ("scores", "answers", "finish_reasons", "responses"))
        mean = sum(sum(p["scores"]) / 2 for p in summary["problems"]) / 20
        assert summary["pass@1"] == pytest.approx(mean)
        assert 0.0 <= summary["maj@k"] <= 1.0
    table = (output_dir / "results.md").read_text().splitlines()
    assert table[0].startswith("| benchmark | problems | k | pass@1")
    assert [row.split("|")[1].strip() for row in table[2:]] == ["gsm8k", "math500"]
    assert finished.stdout.splitlines()[-2:] == table[-2:]


def test_evaluate_tool_scores_a_users_parquet_file_through_the_chat_template(tmp_path):
    from datasets import Dataset

    from tests.tiny_chat import save_tiny_chat_model

    model_dir = tmp_path / "model"
    save_tiny_chat_model(model_dir)
    rows = [{"question": [{"role": "user", "content": f"What is {i}+{i}?"}], "final": 2 * i} for i in range(3)]
    Dataset.from_list(rows).to_parquet(str(tmp_path / "heldout.parquet"))
    command = [sys.executable, str(PROJECT_ROOT / "tools" / "evaluate.py"), "--model-dir", str(model_dir),
               "--benchmarks", str(tmp_path / "heldout.parquet"), "--input-key", "question", "--label-key", "final",
               "--reward-type", "gsm8k", "--apply-chat-template", "--max-new-tokens", "4", "--output-dir",
               str(tmp_path / "eval"), "--reward-workers", "1", "--no-progress"]
    finished = subprocess.run(command, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=300)
    assert finished.returncode == 0, finished.stderr[-3000:]
    (summary,) = json.loads((tmp_path / "eval" / "results.json").read_text())["benchmarks"].values()
    assert [p["reference"] for p in summary["problems"]] == ["0", "2", "4"] and summary["num_problems"] == 3


def test_evaluate_tool_reads_every_benchmark_before_starting_a_server(tmp_path):
    (tmp_path / "heldout.jsonl").write_text('{"prompt": "What is 1+1?"}\n')
    command = [sys.executable, str(PROJECT_ROOT / "tools" / "evaluate.py"), "--urls", "http://127.0.0.1:9",
               "--tokenizer-dir", str(tmp_path), "--benchmarks", str(tmp_path / "heldout.jsonl"), "--output-dir",
               str(tmp_path / "eval")]
    finished = subprocess.run(command, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=120)
    assert finished.returncode == 1
    assert finished.stderr.strip().splitlines()[-1] == (
        f"evaluate.py: error: {tmp_path / 'heldout.jsonl'}: has no field 'label' (its fields: ['prompt']): pass "
        "--label-key with the name of the field that holds it")
