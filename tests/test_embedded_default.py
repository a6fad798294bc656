"""The embedded default: --synthetic-task picks the task, its defaults and its reward; the tiny model's context and
the response limit fit the longest problems; the cache key follows every warm-start setting; and the no-argument
command (shortened) runs the worked task end to end to its JSON line."""

import json
import re
import shlex
from pathlib import Path

import pytest

from megatron_dppo.data.synthetic import TASK_CELLS, SyntheticArithmetic, format_target, max_prompt_length
from megatron_dppo.data.tokenizer import SYNTHETIC_ALPHABET, CharTokenizer
from megatron_dppo.launch.arguments import EMBEDDED_TASK_DEFAULTS, parse_args
from megatron_dppo.launch.embedded import cache_key, tiny_model, warm_start_cells
from megatron_dppo.pipeline.tasks import Prompt, synthetic_task
from tests.launch import REPO_ROOT, finish, start_torchrun


def test_synthetic_task_flag_selects_the_task_its_embedded_defaults_and_its_reward(tmp_path):
    worked, answer = parse_args([]), parse_args(["--synthetic-task", "answer"])
    assert worked.synthetic_task == "worked" and answer.synthetic_task == "answer"
    for args in (worked, answer):
        for key, value in EMBEDDED_TASK_DEFAULTS[args.synthetic_task].items():
            assert getattr(args, key) == value, key
    # a flag given on the command line wins over the task's default
    assert parse_args(["--warm-start-steps", "7", "--rollout-max-response-len", "300"]).warm_start_steps == 7
    # outside the embedded default the warm start does not run, and the response limit is the general one
    for name in ("config.json", "tokenizer.json", "model.safetensors"):  # the checkpoint folder's files are checked
        (tmp_path / name).write_text("{}")
    assert parse_args(["--hf-checkpoint", str(tmp_path), "--synthetic-task", "answer"]).rollout_max_response_len == 1024

    tokenizer = CharTokenizer.for_synthetic_task()
    problem = SyntheticArithmetic(seed=0, cells=["3x1"]).sample(1)[0]
    worked_response, answer_response = format_target(problem, "worked"), format_target(problem, "answer")
    for task, scores in (("worked", [1.0, 0.0]), ("answer", [0.0, 1.0])):
        prompts = synthetic_task(tokenizer, seed=0, train_size=8, heldout_size=8, task=task)
        assert prompts.score([worked_response, answer_response], [Prompt(0, [], problem.answer)] * 2).scores == scores
        assert {p.text.count("+") + p.text.count("-") for p in prompts.heldout(8)} <= {
            int(cell.split("x")[0]) for cell in TASK_CELLS[task]}


def test_response_limit_and_model_context_fit_the_longest_problem_of_each_task():
    tokenizer = CharTokenizer.for_synthetic_task()
    for task in ("worked", "answer"):
        args = parse_args(["--synthetic-task", task])
        longest = max(len(tokenizer.encode(format_target(p, task)))
                      for p in SyntheticArithmetic(seed=1, cells=TASK_CELLS[task]).sample(3000))
        assert args.rollout_max_response_len >= longest, (task, longest)
        model = tiny_model(args)
        assert model["max_position_embeddings"] >= max_prompt_length(TASK_CELLS[task]) + args.rollout_max_response_len
        assert model["hidden_size"] == 128 and model["num_heads"] == 4 and model["num_layers"] == 3
    wider = tiny_model(parse_args(["--embedded-hidden-size", "192", "--embedded-num-layers", "4"]))
    assert (wider["hidden_size"], wider["num_heads"], wider["num_layers"], wider["ffn_hidden_size"]) == (192, 6, 4, 768)


def test_cache_key_changes_with_every_warm_start_setting_and_only_with_them():
    base = ["--seed", "3"]
    key = cache_key(parse_args(base), vocab_size=len(SYNTHETIC_ALPHABET) + 4, world_size=2)
    assert key == cache_key(parse_args([*base, "--lr", "1e-5", "--time-budget-s", "9"]), 23, 2)  # RL-only flags
    changed = [["--synthetic-task", "answer"], ["--warm-start-steps", "5"], ["--warm-start-lr", "1e-3"],
               ["--warm-start-batch-size", "3"], ["--warm-start-problems", "10"], ["--warm-start-cells", "2x1"],
               ["--data-synthetic-cells", "2x1"], ["--embedded-hidden-size", "64"], ["--embedded-num-layers", "2"],
               ["--seed", "4"], ["--rollout-max-response-len", "400"]]
    keys = {cache_key(parse_args([*base, *flags]), 23, 2) for flags in changed}
    assert len(keys) == len(changed) and key not in keys
    assert cache_key(parse_args(base), 21, 2) != key and cache_key(parse_args(base), 23, 1) != key
    # the warm start's cells default to the RL cells
    assert warm_start_cells(parse_args(["--data-synthetic-cells", "2x1", "3x1"])) == ("2x1", "3x1")


@pytest.mark.parametrize("flags, message", [
    (["--embedded-hidden-size", "100"], "--embedded-hidden-size 100 must be a multiple of 32"),
    (["--warm-start-problems", "-1"], "argument --warm-start-problems: -1 is out of range; give an integer >= 0"),
    (["--warm-start-batch-size", "0"], "argument --warm-start-batch-size: 0 is out of range; give an integer >= 1"),
    (["--warm-start-cells", "2y1"], "--warm-start-cells: difficulty cell '2y1' must read"),
    (["--synthetic-task", "proof"], "invalid choice: 'proof'"),
    (["--data-synthetic-cells", "16x1", "--rollout-max-response-len", "100"],
     "--rollout-max-response-len 100 cuts the longest worked responses of the cells (175 tokens)"),
])
def test_bad_embedded_flags_are_named(flags, message, capsys):
    with pytest.raises(SystemExit):
        parse_args(flags)
    assert message in capsys.readouterr().err


README_MAIN_COMMAND = ("python3 -m venv .venv && . .venv/bin/activate && pip install -c constraints.txt -e . && "
                       "torchrun --nproc-per-node 2 examples/pretrain_dppo.py")


def readme_main_launch() -> tuple[Path, int, list[str]]:
    """The README's first command, which must be README_MAIN_COMMAND: its launch part as (script, processes, flags)."""
    readme = (REPO_ROOT / "README.md").read_text()
    first_block = re.search(r"```bash\n(.*?)\n```", readme, re.DOTALL).group(1).strip()
    assert first_block == README_MAIN_COMMAND, "the README's first command changed: update this smoke run with it"
    launch = shlex.split(first_block.split("&&")[-1])
    assert launch[:2] == ["torchrun", "--nproc-per-node"], launch
    return REPO_ROOT / launch[3], int(launch[2]), launch[4:]


def test_no_argument_command_runs_the_worked_task_to_its_json_line(tmp_path):
    """The README's command (read from the README) with a shortened budget: the worked task's warm start, RL steps,
    the JSON line last."""
    script, processes, readme_flags = readme_main_launch()
    process = start_torchrun(script, processes, [*readme_flags,
        "--warm-start-steps", "40", "--train-iters", "2", "--eval-size", "16", "--rollout-batch-size", "4",
        "--cache-dir", tmp_path / "cache", "--log-dir", tmp_path / "log"])
    output = finish(process, 600, "the embedded default")
    assert process.returncode == 0, output[-8000:]
    summary = json.loads(output.strip().splitlines()[-1])
    assert set(summary) == {"heldout_accuracy_before", "heldout_accuracy_after", "steps", "prompts_pruned_fraction",
                            "rollouts_saved", "seconds"}
    assert summary["steps"] == 2
    # the prompt level's work, summed over the run's steps (step 1 has no history, step 2 a prior from step 1)
    metrics_lines = [json.loads(line) for line in (tmp_path / "log" / "metrics.jsonl").read_text().splitlines()]
    drawn, pruned = (sum(m[key] for m in metrics_lines) for key in ("prompts_drawn", "prompts_pruned"))
    assert summary["prompts_pruned_fraction"] == pytest.approx(pruned / drawn, abs=1e-4)
    assert summary["rollouts_saved"] == pruned * 8
    init = next((tmp_path / "cache").glob("embedded_*/init"))
    assert CharTokenizer.from_pretrained(init).encode(SYNTHETIC_ALPHABET) == CharTokenizer.for_synthetic_task().encode(
        SYNTHETIC_ALPHABET)
    metrics = [json.loads(line) for line in (tmp_path / "log" / "metrics.jsonl").read_text().splitlines()]
    # worked responses, not 8-token answers: the response limit of the worked task is in force
    assert max(m["response_length_mean"] for m in metrics) > 8
