"""Math and GSM8K rewards: right on every reference, wrong on other problems' answers, robust on messy output."""

import logging
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from megatron_dppo.data.datasets import load_dataset
from megatron_dppo.rewards import gsm8k
from megatron_dppo.rewards.math import (
    HARD_DEADLINE_GRACE_S,
    VerifierPool,
    compute_score,
    extract_final_answer,
    normalize_answer,
    score_batch,
    score_with_details,
)

PROJECT_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def pool():
    with VerifierPool(num_workers=2, timeout_s=5.0) as verifier_pool:
        yield verifier_pool


def _fraction_scoring(pool, examples, references, expected_score):
    results = score_batch([e.solution for e in examples], references, pool=pool)
    return sum(r.score == expected_score for r in results) / len(results)


def _answer_of_another_problem(examples):
    """For each problem, the answer of the next problem whose answer differs as a normalised string."""
    others = []
    for index, example in enumerate(examples):
        other = (index + 1) % len(examples)
        while normalize_answer(examples[other].answer) == normalize_answer(example.answer):
            other = (other + 1) % len(examples)
        others.append(examples[other].answer)
    return others


@pytest.mark.shared_data
@pytest.mark.parametrize("name, expected_rows", [("math_test", 5000), ("math500", 500)])
def test_every_math_reference_solution_scores_one_against_its_own_answer(pool, name, expected_rows):
    examples = load_dataset(name)
    assert len(examples) == expected_rows
    assert _fraction_scoring(pool, examples, [e.answer for e in examples], 1.0) >= 0.995


@pytest.mark.shared_data
@pytest.mark.parametrize("name", ["math_test", "math500"])
def test_math_reference_solution_scores_zero_against_another_problems_answer(pool, name):
    examples = load_dataset(name)
    assert _fraction_scoring(pool, examples, _answer_of_another_problem(examples), 0.0) >= 0.995


@pytest.mark.shared_data
@pytest.mark.parametrize("name", ["math_test", "math500"])
def test_math_verify_route_accepts_every_reference_answer_against_itself(pool, name):
    """The pool alone, without the exact-match shortcut: no reference answer is unparsable or self-unequal."""
    answers = [e.answer for e in load_dataset(name)]
    assert pool.verify([(answer, answer) for answer in answers]) == [(True, "math-verify-equal")] * len(answers)


@pytest.mark.shared_data
def test_messy_restatements_of_math500_answers_score_one(pool):
    """The same answers written as a model would: in prose, spaced, with \\dfrac, after ####, in \\fbox."""
    examples = load_dataset("math500")
    styles = [
        lambda a: f"Let me think.\nSo the answer is ${a}$. Done",
        lambda a: f"Working... $x=3$, hence\n\\[\\boxed{{ {a.replace(chr(92) + 'frac', chr(92) + 'dfrac')} }}\\]",
        lambda a: f"steps 1, 2, 3\n#### {a}",
        lambda a: f"We get $\\fbox{{{a}}}$.",
    ]
    for style in styles:
        results = score_batch([style(e.answer) for e in examples], [e.answer for e in examples], pool=pool)
        assert sum(r.score for r in results) / len(results) >= 0.995, style(examples[0].answer)


@pytest.mark.parametrize(
    "response, answer, source",
    [
        ("first \\boxed{1} then \\boxed{\\frac{a}{\\sqrt{b}}}.", "\\frac{a}{\\sqrt{b}}", "boxed"),
        ("so $\\boxed 7$.", "7", "boxed"),
        ("\\fbox{12} and a cut-off \\boxed{\\frac{1", "12", "boxed"),
        ("The answer is: $-3.5$, as shown.", "-3.5", "answer-is"),
        ("Thus the answer is 42. Check: 6*7=42", "42", "answer-is"),
        ("total\n#### 1,234\n", "1,234", "####"),
        ("I get 3 apples, then 17.", "17", "last-number"),
        ("no idea", None, "none"),
    ],
)
def test_final_answer_extraction_order_and_forms(response, answer, source):
    assert extract_final_answer(response) == (answer, source)


def test_equivalent_forms_score_one_and_different_values_zero(pool):
    cases = [
        ("The answer is $\\boxed{0.5}$", "\\frac{1}{2}", 1.0),
        ("$\\boxed{\\dfrac{\\sqrt{3}}{2}}$", "\\frac{\\sqrt3}{2}", 1.0),
        ("\\boxed{(3, \\frac{\\pi}{2})}", "\\left( 3, \\frac{\\pi}{2} \\right)", 1.0),
        ("\\boxed{30^\\circ}", "30", 1.0),
        ("\\boxed{\\frac{1}{3}}", "\\frac{1}{2}", 0.0),
        ("\\boxed{x^2+1}", "x^2-1", 0.0),
    ]
    results = score_batch([c[0] for c in cases], [c[1] for c in cases], pool=pool)
    assert [r.score for r in results] == [c[2] for c in cases], results


@pytest.mark.parametrize(
    "first, second, equal",
    [
        ("\\left( 3, \\dfrac{\\pi}{2} \\right)", "(3,\\frac{\\pi}{2})", True),
        ("\\text{(C)}", "(C)", True),
        ("30^\\circ", "30", True),
        ("\\$1,\\!000.", "1,000", True),
        ("A \\leftarrow B", "A \\rightarrow B", False),  # \left/\right are dropped only as delimiter sizes
        ("\\frac{1}{2}", "\\frac{1}{3}", False),
    ],
)
def test_normalisation_for_exact_match_and_votes_is_mild(first, second, equal):
    assert (normalize_answer(first) == normalize_answer(second)) is equal


def test_format_reward_goes_only_to_wrong_answers_written_in_a_box(pool):
    assert compute_score("\\boxed{3}", "4", pool=pool, format_reward=0.1) == 0.1
    assert compute_score("the answer is 3", "4", pool=pool, format_reward=0.1) == 0.0
    assert compute_score("\\boxed{4}", "4", pool=pool, format_reward=0.1) == 1.0


def test_latex_bomb_scores_zero_with_a_logged_timeout_within_the_deadline_even_from_a_thread(caplog):
    bomb = "Clearly the value is $\\boxed{10^{10^{10^{10^{10}}}} - 9^{9^{9^{9}}}}$."
    with VerifierPool(num_workers=1, timeout_s=1.0) as bomb_pool:
        start = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="megatron_dppo.rewards.math"):
            with ThreadPoolExecutor(max_workers=1) as thread:  # no signals in the caller: works off the main thread
                result = thread.submit(score_with_details, bomb, "5", pool=bomb_pool).result()
        elapsed = time.monotonic() - start
    assert result.score == 0.0
    assert result.reason == "timeout"
    assert any("timed out" in record.getMessage() for record in caplog.records)
    assert elapsed < 1.0 + HARD_DEADLINE_GRACE_S + 1.0


def _wait_until_dead(pid: int) -> None:
    """Until the process is a zombie (Linux /proc), so the pool sees it dead however the scheduler runs."""
    for _ in range(1000):
        stat = Path(f"/proc/{pid}/stat")
        if not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z":
            return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} did not die after SIGKILL")


def test_pool_kills_a_stalled_worker_reports_a_timeout_and_keeps_serving():
    """A worker that stops responding (SIGSTOP: no in-process timeout can end it) or dies is replaced."""
    with VerifierPool(num_workers=1, timeout_s=1.0) as stalled_pool:
        (stalled_pid,) = stalled_pool.worker_pids()
        os.kill(stalled_pid, signal.SIGSTOP)
        assert stalled_pool.verify([("2", "3")]) == [(None, "timeout")]
        assert stalled_pool.worker_pids() != [stalled_pid]
        assert stalled_pool.verify([("\\frac{1}{2}", "0.5")]) == [(True, "math-verify-equal")]
        (replacement_pid,) = stalled_pool.worker_pids()
        os.kill(replacement_pid, signal.SIGKILL)  # a worker that died while idle is replaced before use
        _wait_until_dead(replacement_pid)
        assert stalled_pool.verify([("3", "3.0")]) == [(True, "math-verify-equal")]


def test_scoring_works_from_worker_threads(pool):
    responses = [f"so \\boxed{{\\frac{{{n}}}{{2}}}}" for n in range(8)]
    references = [str(n / 2) for n in range(8)]
    with ThreadPoolExecutor(max_workers=4) as threads:
        scores = list(threads.map(lambda pair: compute_score(*pair, pool=pool), zip(responses, references)))
    assert scores == [1.0] * 8


@pytest.mark.shared_data
@pytest.mark.parametrize("name", ["gsm8k_test", "gsm8k"])
def test_every_gsm8k_test_reference_scores_one_with_the_gsm8k_scorer(name):
    examples = load_dataset(name)
    assert len(examples) == 1319
    assert all(gsm8k.compute_score(e.solution, e.answer) == 1.0 for e in examples)
    assert all(gsm8k.compute_score(e.solution, e.solution) == 1.0 for e in examples)  # full '#### N' text


@pytest.mark.parametrize(
    "response, score",
    [
        ("She pays \\boxed{\\$1,250.00} in total.", 1.0),
        ("The answer is 1250 dollars.", 1.0),
        ("5 * 250 = 1250\n#### 1250", 1.0),
        ("The answer is 1250.5", 0.0),
        ("The answer is 125", 0.0),
        ("I cannot tell.", 0.0),
    ],
)
def test_gsm8k_scorer_on_messy_outputs(response, score):
    assert gsm8k.compute_score(response, "1250") == score


def test_gsm8k_reference_without_a_number_is_a_clear_error():
    with pytest.raises(ValueError, match="holds no number"):
        gsm8k.compute_score("#### 3", "#### none")


# ------------------------------------------------------------------ compute_score wherever a user calls it
# Each pair needs math-verify (no exact string match), so the batch really goes through the worker processes.
_BATCH = [("so \\boxed{0.5}", "\\frac{1}{2}", 1.0), ("\\boxed{\\frac{1}{3}}", "\\frac{1}{2}", 0.0),
          ("the answer is $\\dfrac{6}{4}$.", "1.5", 1.0), ("\\boxed{x^2+1}", "x^2-1", 0.0)]
_USER_SCRIPT = f"""
print("user script body ran")
from megatron_dppo.rewards.math import compute_score
print("scores", [compute_score(response, reference) for response, reference, _ in {_BATCH!r}])
"""
_EXPECTED_SCORES = f"scores {[score for _, _, score in _BATCH]}"


def _run_user_python(arguments: list[str], script: str | None = None) -> subprocess.CompletedProcess:
    """python ARGS in a fresh interpreter, the project importable through PYTHONPATH as a user's checkout is."""
    environment = {**os.environ, "PYTHONPATH": str(PROJECT_ROOT)}
    return subprocess.run([sys.executable, *arguments], input=script, capture_output=True, text=True, timeout=300,
                          env=environment, cwd=PROJECT_ROOT)


def test_compute_score_works_from_a_script_read_on_standard_input():
    finished = _run_user_python(["-"], _USER_SCRIPT)  # python - <<EOF: the main module has no file to re-import
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert finished.stdout.splitlines() == ["user script body ran", _EXPECTED_SCORES]


def test_compute_score_from_a_script_without_a_main_guard_runs_the_script_once(tmp_path):
    script = tmp_path / "score_my_answers.py"
    script.write_text(_USER_SCRIPT)
    finished = _run_user_python([str(script)])
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert finished.stdout.splitlines() == ["user script body ran", _EXPECTED_SCORES]  # workers never re-ran it


def test_compute_score_works_from_a_thread_with_the_default_pool():
    threaded = _USER_SCRIPT.split("print(\"scores\"")[0] + (
        "import threading\n"
        "scores = []\n"
        f"work = lambda: scores.extend(compute_score(response, reference) for response, reference, _ in {_BATCH!r})\n"
        "thread = threading.Thread(target=work)\n"
        "thread.start()\n"
        "thread.join()\n"
        "print('scores', scores)\n")
    finished = _run_user_python(["-"], threaded)
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert finished.stdout.splitlines() == ["user script body ran", _EXPECTED_SCORES]


def test_a_worker_that_dies_at_start_is_reported_with_its_own_error(tmp_path):
    broken = tmp_path / "math_verify"  # shadows the real math_verify in the worker, which then fails to import
    broken.mkdir()
    (broken / "__init__.py").write_text("raise ImportError('math_verify is broken on this machine')\n")
    script = "from megatron_dppo.rewards.math import VerifierPool\nVerifierPool(num_workers=1)\n"
    environment = {**os.environ, "PYTHONPATH": f"{PROJECT_ROOT}{os.pathsep}{tmp_path}"}
    start = time.monotonic()
    finished = subprocess.run([sys.executable, "-"], input=script, capture_output=True, text=True, timeout=300,
                              env=environment, cwd=PROJECT_ROOT)
    assert finished.returncode != 0
    assert "math_verify is broken on this machine" in finished.stderr, finished.stderr[-3000:]
    assert "did not start within" not in finished.stderr
    assert time.monotonic() - start < 60  # reported when the worker died, not after the start-up timeout
