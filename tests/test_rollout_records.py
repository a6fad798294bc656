"""A step's rollouts as people read them (pipeline/rollout_records.py, metrics.RolloutRecords): response_clip_ratio is
the share of responses the length limit ended, a custom reward's numeric extra keys are averaged, every rolled-out
response gets one record (trained or not) with its text, and --save-debug-rollout-data writes them one file per step,
a resumed run dropping the files of the steps its checkpoint does not hold."""

import json
import math
from types import SimpleNamespace

import pytest
import torch

from megatron_dppo.algo.dapo_filter import DAPOConfig, DAPOFilter
from megatron_dppo.algo.pruning import PromptDecision, build_pruner
from megatron_dppo.data.tokenizer import CharTokenizer
from megatron_dppo.metrics import MetricsLogger, RolloutRecords
from megatron_dppo.pipeline.experience import Rollouts, select_samples
from megatron_dppo.pipeline.rollout_records import response_statistics, rollout_samples
from megatron_dppo.pipeline.tasks import Prompt


def two_groups():
    """Two prompts, two samples each: a group with varied rewards and one the DAPO filter drops."""
    tokenizer = CharTokenizer.for_text()
    prompts = [Prompt(7, tokenizer.encode("2+2?"), "4", "2+2?", location="f.jsonl, row 8"),
               Prompt(9, tokenizer.encode("3+3?"), "6", "3+3?", location="f.jsonl, row 10")]
    responses = ["4", "5 and more", "7", "8"]
    rewards = torch.tensor([[1.0, 0.0], [0.0, 0.0]], dtype=torch.float64)
    rollouts = Rollouts(prompts=prompts, prompt_decision=PromptDecision.keep_all(2),
                        output_ids=[tokenizer.encode(text) for text in responses],
                        output_logprobs=[[-1.0] * len(tokenizer.encode(text)) for text in responses],
                        rewards=rewards, seconds=1.0, reward_seconds=0.0, num_drawn=2, capacity=2, tokens_generated=9,
                        finish_reasons=["stop", "length", "length", "stop"],
                        reward_extras=[{"acc": True, "pred": "4"}, {"acc": False}, {}, {"acc": False, "x": math.nan}])
    lengths = torch.tensor([len(ids) for ids in rollouts.output_ids]).view(2, 2)
    selection = select_samples(rewards, lengths, rollouts.prompt_decision, build_pruner("none"),
                               DAPOFilter(DAPOConfig()), 2, "grpo", step=1, progress=0.0)
    return rollouts, selection, tokenizer, responses


def test_clip_ratio_is_the_share_ended_by_the_length_limit_and_numeric_extras_are_averaged():
    rollouts, _, _, _ = two_groups()
    stats = response_statistics(rollouts.finish_reasons, rollouts.reward_extras)
    assert stats == {"response_clip_ratio": 0.5, "reward_extra/acc": pytest.approx(1 / 3)}  # no "pred", no NaN
    assert response_statistics([], []) == {"response_clip_ratio": 0.0}


def test_every_rolled_out_response_has_a_record_with_its_text_reward_finish_reason_and_training_weight():
    rollouts, selection, tokenizer, responses = two_groups()
    samples = rollout_samples(rollouts, selection, tokenizer)
    assert [(s["prompt_id"], s["sample_index"]) for s in samples] == [(7, 0), (7, 1), (9, 0), (9, 1)]
    assert [s["response"] for s in samples] == [tokenizer.decode(tokenizer.encode(text)) for text in responses]
    assert [s["finish_reason"] for s in samples] == ["stop", "length", "length", "stop"]
    assert [s["reward"] for s in samples] == [1.0, 0.0, 0.0, 0.0]
    assert [s["weight"] for s in samples] == [1.0, 1.0, 0.0, 0.0]  # the all-zero group is filtered out
    assert [s["advantage"] for s in samples][2:] == [0.0, 0.0] and samples[0]["advantage"] > 0 > samples[1]["advantage"]
    assert samples[0]["row"] == "f.jsonl, row 8" and samples[0]["label"] == "4" and samples[0]["prompt"] == "2+2?"
    assert samples[0]["reward_extras"] == {"acc": True, "pred": "4"} and samples[0]["prompt_keep_prob"] == 1.0
    assert samples[3]["reward_extras"] == {"acc": False, "x": None}
    json.dumps(samples, allow_nan=False)  # every record is strict JSON as it stands


def args(**values):
    defaults = dict(save_debug_rollout_data=None, wandb_project=None, wandb_rollout_table_rows=4,
                    wandb_rollout_table_interval=10)
    return SimpleNamespace(**{**defaults, **values})


def test_records_are_wanted_every_step_for_the_debug_dump_and_every_n_steps_for_a_wandb_table(tmp_path):
    assert not RolloutRecords.from_args(args()).wanted(10)  # neither: nothing is built
    table = RolloutRecords.from_args(args(wandb_project="p"))
    assert [step for step in range(1, 31) if table.wanted(step)] == [10, 20, 30]
    assert not RolloutRecords.from_args(args(wandb_project="p", wandb_rollout_table_rows=0)).wanted(10)
    dump = RolloutRecords.from_args(args(save_debug_rollout_data=str(tmp_path)))
    assert all(dump.wanted(step) for step in range(1, 31)) and not dump.table_due(10)
    samples = [{"step": 3, "prompt_index": p, "sample_index": s, "prompt": f"p{p}", "response": f"r{p}{s}",
                "reward": 0.0, "finish_reason": "stop", "weight": 1.0} for p in range(3) for s in range(2)]
    assert [row[2] for row in table.table_rows_of(samples)] == ["r00", "r10", "r20", "r01"]  # each prompt first


def test_debug_files_hold_one_row_per_response_per_step_and_a_resume_drops_later_steps(tmp_path):
    rollouts, selection, tokenizer, _ = two_groups()
    samples = rollout_samples(rollouts, selection, tokenizer)
    records = RolloutRecords.from_args(args(save_debug_rollout_data=str(tmp_path / "debug")))
    logger = MetricsLogger(tmp_path / "log", True, 3, records=records)
    for step in (1, 2, 3):
        logger.log(step, {"reward_mean": 0.25, "rollout_samples": samples})
    logger.close()
    rows = [json.loads(line) for line in (tmp_path / "debug" / "step_000002.jsonl").read_text().splitlines()]
    assert rows == [{"step": 2, **sample} for sample in samples]
    assert "rollout_samples" not in (tmp_path / "log" / "metrics.jsonl").read_text()
    MetricsLogger(tmp_path / "log", True, 3, start_step=1, records=records).close()  # resumed from step 1
    assert sorted(path.name for path in (tmp_path / "debug").iterdir()) == ["step_000001.jsonl"]
