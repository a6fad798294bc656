"""The trainer's task: prompts from a data set or a user's JSONL file, scored by the matching reward."""

import json

import pytest

from megatron_dppo.data.tokenizer import CharTokenizer
from megatron_dppo.tasks import dataset_task, reward_scorer


def test_a_jsonl_file_in_gsm8k_layout_trains_with_the_gsm8k_reward_and_stable_ids(tmp_path):
    rows = [{"question": f"What is {i} + {i}?", "answer": f"{i} + {i} = {2 * i}\n#### {2 * i}"} for i in range(5)]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    task = dataset_task(str(path), CharTokenizer.for_text(), seed=0, heldout_name="gsm8k_test", heldout_size=3,
                        skip_bad_rows=False, reward_fn="gsm8k", template="plain")
    drawn = task.next_prompts(5)
    assert sorted(p.prompt_id for p in drawn) == [0, 1, 2, 3, 4]
    assert {p.reference for p in drawn} == {str(2 * i) for i in range(5)}
    assert [p.prompt_id for p in task.heldout(3)] == [-1, -2, -3]
    assert task.score(["so the answer is #### 4", "#### 5"], ["4", "4"]) == [1.0, 0.0]


def test_reward_scorer_names_the_choices_for_an_unknown_reward():
    assert reward_scorer("synthetic")(["5+7=12#12$", "12$"], [12, 12]) == [1.0, 0.0]
    assert reward_scorer("synthetic_answer")(["12$", "12"], [12, 12]) == [1.0, 0.0]
    with pytest.raises(ValueError, match="unknown reward function 'f1'.*gsm8k.*math.*synthetic"):
        reward_scorer("f1")
