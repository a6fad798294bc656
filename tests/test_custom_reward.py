"""--custom-reward-function PATH.py:NAME: a bad PATH, NAME or signature stops parsing with one line (slime's
(args, sample) included); ours (response, label, **fields) and verl's compute_score(data_source, solution_str,
ground_truth, extra_info) are told apart by their parameters and called as each expects; a dict with "score" is a
reward whose other keys are kept; a call that raises or returns no finite score stops the batch in one line naming the
function and the row once --custom-reward-max-failures are spent (scoring 0 with a warning line before), a timeout
scores 0 with a warning line; and real runs of the embedded default train on a verl-style reward (its metrics, its
rollout records, its W&B run, continued on resume) or end in one line when the reward raises."""

import json
import logging
import math
import textwrap
import time

import pytest

from megatron_dppo.errors import UserInputError
from megatron_dppo.launch.arguments import parse_args
from megatron_dppo.rewards import RewardRow
from megatron_dppo.rewards.custom import CustomReward
from tests.launch import REPO_ROOT, finish, start_torchrun

REWARDS = textwrap.dedent("""
    import asyncio
    import math
    import time

    def graded(response, label, **fields):
        if response == "raise":
            raise ValueError("cannot grade " + label + "\\nsecond line")
        if response == "sleep":
            time.sleep(30)
        return {"nan": math.nan, "none": None, "text": "1.0", "inf": math.inf,
                "nodict": {"acc": 1.0}, "nandict": {"score": math.nan}}.get(response, len(response) / 10)

    async def graded_async(response, label, level=None):
        if response == "sleep":
            await asyncio.sleep(30)
        return 1.0 if level == "Level 5" else 0.5

    def rows(response, label, **fields):
        return float(len(fields))

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        return {"score": float(solution_str == ground_truth), "source": data_source, "info": extra_info,
                "length": len(solution_str), "correct": solution_str == ground_truth}

    def verl_needs_more(data_source, solution_str, ground_truth, extra_info, tokenizer):
        return 1.0

    def slime_style(args, sample):
        return 1.0

    def positional_only(response):
        return 1.0

    NOT_CALLABLE = 3
""")


@pytest.fixture
def rewards_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(REWARDS)
    return path


def rows_at(count: int, fields: dict | None = None, label: str = "7") -> list[RewardRow]:
    return [RewardRow(label, dict(fields or {}), "my.jsonl", f"my.jsonl, row {number}")
            for number in range(1, count + 1)]


def test_calls_that_fail_score_zero_with_one_warning_line_until_the_bound_then_stop_in_one_line_naming_the_row(
        rewards_file, caplog):
    reward = CustomReward(f"{rewards_file}:graded", timeout_s=0.5, max_failures=7)
    responses = ["abcd", "raise", "nan", "none", "text", "inf", "sleep", "nodict", "ab"]
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="megatron_dppo.rewards.custom"):
        batch = reward(responses, rows_at(len(responses)))
    assert time.monotonic() - start < 5  # the sleeping call is abandoned at its deadline, not waited for
    assert batch.scores == [0.4, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.2]
    assert reward.failures == 6  # the timeout is not a failure
    (line,) = [record.getMessage() for record in caplog.records]
    assert line == (f"--custom-reward-function {rewards_file}:graded: 7 of 9 responses scored 0 (1 raised, 5 no score, "
                    "1 timeout; failed calls so far: 6, --custom-reward-max-failures 7); first: raised ValueError: "
                    "cannot grade 7 second line")
    assert reward(["x", "nandict"], rows_at(2)).scores == [0.1, 0.0]  # the 7th failure: still within the bound
    with pytest.raises(UserInputError) as stopped:
        reward(["x", "y", "raise"], rows_at(3))
    assert str(stopped.value) == (
        f"--custom-reward-function {rewards_file}:graded: graded raised ValueError: cannot grade 7 second line on "
        "my.jsonl, row 3; 8 failed calls so far, more than --custom-reward-max-failures 7: fix graded (it must return "
        "a finite number or a dict with a finite 'score'), or raise --custom-reward-max-failures to score such calls 0")


def test_by_default_the_first_call_that_returns_no_score_stops_the_run_in_one_line(rewards_file):
    with pytest.raises(UserInputError, match=r"graded returned no finite number: None on my.jsonl, row 2; 1 failed "
                                             r"calls so far, more than --custom-reward-max-failures 0"):
        CustomReward(f"{rewards_file}:graded", 0.5)(["ok", "none"], rows_at(2))


def test_async_rewards_and_row_fields_as_keywords(rewards_file, caplog):
    rows = [RewardRow("1", {"level": "Level 5", "type": "Algebra"}), RewardRow("1", {"level": "Level 1",
                                                                                      "label": "shadowed"}),
            RewardRow("1", {})]
    assert CustomReward(f"{rewards_file}:graded_async", 0.5)(["a", "b", "c"], rows).scores == [1.0, 0.5, 0.5]
    # a function that takes **fields gets every field but the positional ones; one that names a field gets that one
    assert CustomReward(f"{rewards_file}:rows", 0.5)(["a", "b", "c"], rows).scores == [2.0, 1.0, 0.0]
    with caplog.at_level(logging.WARNING, logger="megatron_dppo.rewards.custom"):
        assert CustomReward(f"{rewards_file}:graded_async", 0.2)(["sleep", "x"], rows_at(2)).scores == [0.0, 0.5]
    assert "1 of 2 responses scored 0 (1 timeout; failed calls so far: 0" in caplog.text


def test_a_verl_compute_score_gets_its_keywords_and_its_dict_is_a_reward_whose_other_keys_are_kept(rewards_file):
    """verl's names, by keyword: data_source the row's own "data_source" (verl's layout) or the source it came from,
    extra_info the row's "extra_info" dict or else the whole row; the dict's "score" is the reward."""
    reward = CustomReward(f"{rewards_file}:compute_score", 0.5)
    assert reward.convention == "verl"
    verl_row = RewardRow("42", {"data_source": "openai/gsm8k", "extra_info": {"split": "train", "index": 3},
                                "prompt": "q"}, "train.parquet", "train.parquet, row 4")
    our_row = RewardRow("41", {"problem": "p", "level": "Level 2"}, "math", "math, row 9")
    batch = reward(["42", "no"], [verl_row, our_row])
    assert batch.scores == [1.0, 0.0]
    assert batch.extras == [
        {"source": "openai/gsm8k", "info": {"split": "train", "index": 3}, "length": 2, "correct": True},
        {"source": "math", "info": {"problem": "p", "level": "Level 2"}, "length": 2, "correct": False}]


def test_the_example_verl_style_reward_scores_boxed_answers_and_gives_pred_for_majority_voting():
    reward = CustomReward(f"{REPO_ROOT / 'examples' / 'verl_style_reward.py'}:compute_score", 5.0)
    responses = ["so x = \\boxed{\\dfrac{1}{2}}.", "\\boxed{3} then \\boxed{ 4 }", "no box: 4", "\\boxed{5"]
    batch = reward(responses, [RewardRow("\\frac{1}{2}", {}), *rows_at(3, label="4")])
    assert batch.scores == [1.0, 1.0, 0.0, 0.0]
    assert [extras["pred"] for extras in batch.extras] == ["\\dfrac{1}{2}", " 4 ", "", ""]
    assert [extras["boxed"] for extras in batch.extras] == [True, True, False, False]


@pytest.mark.parametrize("spec, message", [
    ("{file}", "{file}: give PATH.py:NAME, the file and the function in it"),
    ("{dir}/absent.py:graded", "{dir}/absent.py:graded: no such file {dir}/absent.py; give PATH.py:NAME"),
    ("{dir}/my_rewards.txt:graded", "{dir}/my_rewards.txt:graded: {dir}/my_rewards.txt is not a .py file"),
    ("{file}:missing", "{file}:missing: missing is not defined there (its functions: compute_score, graded, "
                       "graded_async, positional_only, rows, slime_style, verl_needs_more); give PATH.py:NAME of a "
                       "function NAME(response, label, **fields) or verl's compute_score(data_source, solution_str, "
                       "ground_truth, extra_info=None)"),
    ("{file}:NOT_CALLABLE", "{file}:NOT_CALLABLE: NOT_CALLABLE is not callable"),
    ("{file}:positional_only", "{file}:positional_only: positional_only(response) cannot be called as "
                               "positional_only(response, label): give it the signature NAME(response, label, "
                               "**fields) or verl's compute_score("),
    ("{file}:slime_style", "{file}:slime_style: slime_style(args, sample) is slime's custom reward (args, sample), "
                           "whose Sample object has no counterpart here: write NAME(response, label, **fields) or "
                           "verl's compute_score("),
    ("{file}:verl_needs_more", "{file}:verl_needs_more: verl_needs_more(data_source, solution_str, ground_truth, "
                               "extra_info, tokenizer) takes verl's solution_str and ground_truth, but verl calls it "
                               "with the keywords data_source, solution_str, ground_truth, extra_info only and it also "
                               "requires tokenizer: give the others defaults"),
])
def test_a_bad_path_name_or_signature_is_refused_at_parse_time_in_one_line(rewards_file, spec, message, capsys):
    names = {"file": rewards_file, "dir": rewards_file.parent}
    with pytest.raises(SystemExit) as stopped:
        parse_args(["--custom-reward-function", spec.format(**names)])
    assert stopped.value.code == 2
    first, *rest = capsys.readouterr().err.splitlines()
    assert first.startswith(f"pretrain_dppo.py: error: argument --custom-reward-function: {message.format(**names)}")
    assert rest == ["(--help lists every flag)"]


def test_a_module_that_fails_to_import_is_named(tmp_path, capsys):
    broken = tmp_path / "broken.py"
    broken.write_text("import not_a_module_anywhere\n")
    with pytest.raises(SystemExit):
        parse_args(["--custom-reward-function", f"{broken}:graded"])
    assert (f"{broken}:graded: importing {broken} raised ModuleNotFoundError: No module named "
            "'not_a_module_anywhere'") in capsys.readouterr().err


EMBEDDED_REWARD = textwrap.dedent("""
    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        # verl's signature on the synthetic task: its row is the prompt and the difficulty cell
        assert data_source == "synthetic" and extra_info["prompt"].startswith("Q:") and "x" in extra_info["cell"]
        right = ground_truth in solution_str
        return {"score": 0.75 if right else 0.25, "holds_answer": right, "cell": extra_info["cell"]}

    CALLS = []

    def raises_in_step_2(data_source, solution_str, ground_truth, extra_info=None):
        # the held-out evaluation before RL (4 problems) and step 1 (4 prompts x 4 samples) score; step 2 raises
        CALLS.append(1)
        if len(CALLS) > 4 + 16:
            raise KeyError("answer")
        return 0.5
""")
SHRUNK = ["--warm-start-steps", "0", "--eval-size", "4", "--rollout-batch-size", "4", "--rollout-max-response-len",
          "176", "--n-samples-per-prompt", "4"]


def embedded_run(tmp_path, steps: int, *flags) -> tuple[int, str]:
    process = start_torchrun(REPO_ROOT / "examples" / "pretrain_dppo.py", 2, [
        *SHRUNK, "--train-iters", steps, "--cache-dir", tmp_path / "cache", "--log-dir", tmp_path / "log", *flags],
        env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"})
    output = finish(process, 900, "the embedded default with a custom reward")
    return process.returncode, output


def test_embedded_default_trains_on_a_verl_style_dict_reward_its_records_show_and_its_wandb_run_resumes(tmp_path):
    """The README's embedded default, shrunk (no warm start, 2 steps, then 1 more resumed from its checkpoint), with
    verl's compute_score returning a dict and a W&B run (offline): the rewards it logs are the function's (the
    built-in synthetic reward gives only 0 and 1), its other numeric keys are metrics, every step has its
    response_clip_ratio and a JSONL file of its rollouts with their text, the W&B run holds every step's numeric
    metrics as metrics.jsonl has them and a table of sample rollouts, and the resumed run continues that W&B run."""
    from tests.test_wandb_log import wandb_history, wandb_runs, wandb_tables

    reward_file = tmp_path / "verl_reward.py"
    reward_file.write_text(EMBEDDED_REWARD)
    debug, wandb_dir = tmp_path / "rollouts", tmp_path / "wandb"
    common = ["--custom-reward-function", f"{reward_file}:compute_score", "--save-debug-rollout-data", debug,
              "--wandb-project", "dppo-tests", "--wandb-exp-name", "verl-reward", "--wandb-group", "rewards",
              "--wandb-save-dir", wandb_dir, "--wandb-rollout-table-interval", "2", "--save", tmp_path / "ckpt"]
    returncode, output = embedded_run(tmp_path, 2, *common)
    assert returncode == 0, output[-8000:]
    assert json.loads(output.strip().splitlines()[-1])["steps"] == 2
    outcomes = [json.loads(line) for line in (tmp_path / "log" / "prompt_outcomes.jsonl").read_text().splitlines()]
    rewards = {reward for outcome in outcomes for reward in outcome["rewards"]}
    assert rewards and rewards <= {0.25, 0.75}, rewards
    metrics = [json.loads(line) for line in (tmp_path / "log" / "metrics.jsonl").read_text().splitlines()]
    for record in metrics:
        assert 0.25 <= record["reward_mean"] <= 0.75, record
        assert record["reward_extra/holds_answer"] == pytest.approx((record["reward_mean"] - 0.25) / 0.5)
        assert 0.0 <= record["response_clip_ratio"] <= 1.0 and "reward_extra/cell" not in record
    for step, record in zip((1, 2), metrics, strict=True):
        rows = [json.loads(line) for line in (debug / f"step_{step:06d}.jsonl").read_text().splitlines()]
        rolled_out = 4 * int(record["groups_rolled_out"])  # DPPO's prompt level may prune prompts before rollout
        assert rolled_out and len(rows) == rolled_out and {row["step"] for row in rows} == {step}
        assert sum(row["reward"] for row in rows) / rolled_out == pytest.approx(record["reward_mean"])
        assert all(row["response"] and row["prompt"].startswith("Q:") and row["finish_reason"] in ("stop", "length")
                   and row["reward_extras"]["holds_answer"] == (row["reward"] == 0.75) for row in rows)
        clipped = sum(row["finish_reason"] == "length" for row in rows) / rolled_out
        assert record["response_clip_ratio"] == pytest.approx(clipped)

    (first,) = wandb_runs(wandb_dir)
    assert (first.project, first.display_name, first.run_group) == ("dppo-tests", "verl-reward", "rewards")
    history = wandb_history(wandb_dir, first.run_id)
    assert sorted(history) == [1, 2]
    for record in metrics:
        numeric = {key: value for key, value in record.items() if key != "step"
                   and isinstance(value, (int, float)) and math.isfinite(value)}
        assert history[record["step"]] == pytest.approx(numeric), record["step"]
    (table,) = wandb_tables(wandb_dir, first.run_id, "rollouts")  # --wandb-rollout-table-interval 2: step 2 only
    assert table["step"] == 2 and table["columns"] == ["step", "prompt", "response", "reward", "finish_reason",
                                                       "weight"]
    assert [row[0] for row in table["data"]] == [2] * 4 and all(row[2] for row in table["data"])

    returncode, output = embedded_run(tmp_path, 3, *common, "--load", tmp_path / "ckpt")
    assert returncode == 0, output[-8000:]
    runs = wandb_runs(wandb_dir)
    assert len(runs) == 2 and {run.run_id for run in runs} == {first.run_id}, runs  # the same W&B run, continued
    assert sorted(wandb_history(wandb_dir, first.run_id, resumed=True)) == [3]
    assert sorted(path.name for path in debug.iterdir()) == [f"step_{step:06d}.jsonl" for step in (1, 2, 3)]


def test_a_reward_that_raises_mid_run_ends_it_in_one_line_naming_the_function_and_the_row(tmp_path):
    """Under --async, step 2's rollouts are generated and scored in rank 0's thread while step 1 trains: the failure
    is raised where step 2 takes them, on every rank alike (trainer.from_rank0), so rank 0 alone says it and no other
    rank dies with a traceback in a collective rank 0 left."""
    reward_file = tmp_path / "verl_reward.py"
    reward_file.write_text(EMBEDDED_REWARD)
    returncode, output = embedded_run(tmp_path, 3, "--custom-reward-function", f"{reward_file}:raises_in_step_2",
                                      "--async", "--algorithm", "grpo", "--no-dapo-filter")
    assert returncode != 0, output[-8000:]  # rank 0 exits with 2, and torchrun with 1
    errors = [line for line in output.splitlines() if "pretrain_dppo.py: error:" in line]
    assert len(errors) == 1 and "]: Traceback" not in output, output[-6000:]
    assert (f"--custom-reward-function {reward_file}:raises_in_step_2: raises_in_step_2 raised KeyError: 'answer' on "
            "synthetic training problem ") in errors[0], errors[0]
    assert [json.loads(line)["step"] for line in (tmp_path / "log" / "metrics.jsonl").read_text().splitlines()] == [1]
