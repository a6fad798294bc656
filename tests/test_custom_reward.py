"""--custom-reward-function PATH.py:NAME: a bad PATH or NAME stops parsing with one line; a call that raises, returns
no finite number or runs past --reward-timeout-s scores 0 with one warning line per batch and nothing else is lost;
the row's fields reach NAME as keywords; and a real run of the embedded default trains on that reward."""

import json
import logging
import math
import textwrap
import time

import pytest

from megatron_dppo.launch.arguments import parse_args
from megatron_dppo.rewards.custom import CustomReward
from tests.launch import REPO_ROOT, finish, start_torchrun

REWARDS = textwrap.dedent("""
    import asyncio
    import math
    import time

    def graded(response, label, **fields):
        if response == "raise":
            raise ValueError("cannot grade " + label)
        if response == "sleep":
            time.sleep(30)
        return {"nan": math.nan, "none": None, "text": "1.0", "inf": math.inf}.get(response, len(response) / 10)

    async def graded_async(response, label, level=None):
        if response == "sleep":
            await asyncio.sleep(30)
        return 1.0 if level == "Level 5" else 0.5

    def rows(response, label, **fields):
        return float(len(fields))

    def positional_only(response):
        return 1.0

    NOT_CALLABLE = 3
""")


@pytest.fixture
def rewards_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(REWARDS)
    return path


def test_bad_returns_score_zero_with_one_warning_line_and_every_response_keeps_its_place(rewards_file, caplog):
    reward = CustomReward(f"{rewards_file}:graded", timeout_s=0.5)
    responses = ["abcd", "raise", "nan", "none", "text", "inf", "sleep", "ab"]
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="megatron_dppo.rewards.custom"):
        scores = reward(responses, ["7"] * len(responses), [{}] * len(responses))
    assert time.monotonic() - start < 5  # the sleeping call is abandoned at its deadline, not waited for
    assert scores == [0.4, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.2]
    assert reward.failures == 6
    (line,) = [record.getMessage() for record in caplog.records]
    assert line == (f"--custom-reward-function {rewards_file}:graded: 6 of 8 responses scored 0 (1 raised, 4 returned "
                    "no finite number, 1 timeout); first: raised: ValueError: cannot grade 7")


def test_async_rewards_and_row_fields_as_keywords(rewards_file, caplog):
    rows = [{"level": "Level 5", "type": "Algebra"}, {"level": "Level 1", "label": "shadowed"}, {}]
    assert CustomReward(f"{rewards_file}:graded_async", 0.5)(["a", "b", "c"], ["1"] * 3, rows) == [1.0, 0.5, 0.5]
    # a function that takes **fields gets every field but the positional ones; one that names a field gets that one
    assert CustomReward(f"{rewards_file}:rows", 0.5)(["a", "b", "c"], ["1"] * 3, rows) == [2.0, 1.0, 0.0]
    with caplog.at_level(logging.WARNING, logger="megatron_dppo.rewards.custom"):
        assert CustomReward(f"{rewards_file}:graded_async", 0.2)(["sleep", "x"], ["1", "1"], [{}, {}]) == [0.0, 0.5]
    assert "1 of 2 responses scored 0 (1 timeout)" in caplog.text


@pytest.mark.parametrize("spec, message", [
    ("{file}", "{file}: give PATH.py:NAME, the file and the function in it"),
    ("{dir}/absent.py:graded", "{dir}/absent.py:graded: no such file {dir}/absent.py; give PATH.py:NAME"),
    ("{dir}/my_rewards.txt:graded", "{dir}/my_rewards.txt:graded: {dir}/my_rewards.txt is not a .py file"),
    ("{file}:missing", "{file}:missing: missing is not defined there (its functions: graded, graded_async, "
                       "positional_only, rows); give PATH.py:NAME of a function NAME(response, label, **fields)"),
    ("{file}:NOT_CALLABLE", "{file}:NOT_CALLABLE: NOT_CALLABLE is not callable"),
    ("{file}:positional_only", "{file}:positional_only: positional_only(response) cannot be called as "
                               "positional_only(response, label): give it the signature (response, label, **fields)"),
])
def test_a_bad_path_or_name_is_refused_at_parse_time_in_one_line(rewards_file, spec, message, capsys):
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
    CALLS = []

    def quarter_or_three_quarters(response, label, prompt, cell):
        # the synthetic task's row: its prompt and difficulty cell; 0.75 where the response holds the answer
        CALLS.append(1)
        if len(CALLS) == 1:
            raise ValueError("the first call fails, to show the run goes on")
        assert prompt.startswith("Q:") and "x" in cell
        return 0.75 if label in response else 0.25
""")


def test_embedded_default_trains_on_a_custom_reward_its_metrics_and_wandb_run_show(tmp_path):
    """The README's embedded default, shrunk (no warm start, 2 steps, 4 held-out problems), with a custom reward and
    a W&B run (offline): every reward it logs is one the custom function gives (the built-in synthetic reward gives
    only 0 and 1), the failing first call is one warning line, the run ends with its JSON line, and the W&B run read
    back holds every step's numeric metrics as metrics.jsonl has them."""
    from tests.test_wandb_log import wandb_history, wandb_run_names

    reward_file = tmp_path / "embedded_reward.py"
    reward_file.write_text(EMBEDDED_REWARD)
    process = start_torchrun(REPO_ROOT / "examples" / "pretrain_dppo.py", 2, [
        "--custom-reward-function", f"{reward_file}:quarter_or_three_quarters", "--warm-start-steps", "0",
        "--train-iters", "2", "--eval-size", "4", "--rollout-batch-size", "4", "--rollout-max-response-len", "176",
        "--cache-dir", tmp_path / "cache", "--log-dir", tmp_path / "log", "--wandb-project", "dppo-tests",
        "--wandb-exp-name", "custom-reward", "--wandb-save-dir", tmp_path / "wandb"],
        env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"})
    output = finish(process, 600, "the embedded default with a custom reward")
    assert process.returncode == 0, output[-8000:]
    summary = json.loads(output.strip().splitlines()[-1])
    assert summary["steps"] == 2
    warnings = [line for line in output.splitlines() if "--custom-reward-function" in line]
    assert len(warnings) == 1 and "1 of 4 responses scored 0 (1 raised); first: raised: ValueError: the first " \
                                  "call fails" in warnings[0], warnings
    outcomes = [json.loads(line) for line in (tmp_path / "log" / "prompt_outcomes.jsonl").read_text().splitlines()]
    rewards = {reward for outcome in outcomes for reward in outcome["rewards"]}
    assert rewards and rewards <= {0.25, 0.75}, rewards
    metrics = [json.loads(line) for line in (tmp_path / "log" / "metrics.jsonl").read_text().splitlines()]
    assert all(0.25 <= m["reward_mean"] <= 0.75 for m in metrics), [m["reward_mean"] for m in metrics]

    assert wandb_run_names(tmp_path / "wandb") == [("dppo-tests", "custom-reward")]
    history = wandb_history(tmp_path / "wandb")
    assert sorted(history) == [1, 2]
    for record in metrics:
        numeric = {key: value for key, value in record.items() if key != "step"
                   and isinstance(value, (int, float)) and math.isfinite(value)}
        assert history[record["step"]] == pytest.approx(numeric), record["step"]
