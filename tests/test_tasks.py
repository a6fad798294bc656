"""The trainer's task: prompts from a user's files, encoded with or without the chat template, scored by the reward."""

import json

import pytest

from megatron_dppo.data.datasets import load_prompt_data
from megatron_dppo.data.tokenizer import CharTokenizer
from megatron_dppo.pipeline.tasks import dataset_task, reward_scorer
from megatron_dppo.rewards import RewardBatch, RewardRow


def test_a_jsonl_file_in_gsm8k_layout_trains_with_the_gsm8k_reward_and_stable_ids(tmp_path):
    rows = [{"question": f"What is {i} + {i}?", "answer": f"{i} + {i} = {2 * i}\n#### {2 * i}"} for i in range(8)]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    examples = load_prompt_data(str(path), input_key="question", label_key="answer", reward_type="gsm8k")
    tokenizer = CharTokenizer.for_text()
    task = dataset_task(examples[:5], examples[5:], tokenizer, seed=0, reward_type="gsm8k")
    drawn = task.next_prompts(5)
    assert sorted(p.prompt_id for p in drawn) == [0, 1, 2, 3, 4]
    assert {p.reference for p in drawn} == {rows[i]["answer"] for i in range(5)}  # the reward reads '#### N'
    assert all(p.input_ids == tokenizer.encode(rows[p.prompt_id]["question"]) for p in drawn)  # as written
    assert [p.prompt_id for p in task.heldout(3)] == [-1, -2, -3]
    assert [p.reference for p in task.heldout(3)] == [rows[i]["answer"] for i in (5, 6, 7)]
    assert task.score(["so the answer is #### 4", "#### 5"], drawn[2:4]).scores == [
        float(rows[p.prompt_id]["answer"].endswith("#### 4")) for p in drawn[2:4]]


def test_chat_message_prompts_train_through_the_tokenizers_chat_template(tmp_path):
    from tests.tiny_chat import save_chat_tokenizer

    tokenizer = save_chat_tokenizer(tmp_path / "tokenizer")
    messages = [{"role": "user", "content": "What is 2+2?"}]
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": messages, "label": "4"}) + "\n")
    examples = load_prompt_data(str(path))
    task = dataset_task(examples, examples, tokenizer, seed=0, reward_type="math", apply_chat_template=True)
    (prompt,) = task.next_prompts(1)
    assert prompt.input_ids == tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
    assert prompt.text == "<bos><|user|>What is 2+2?<|end|>\n<|assistant|>"


def test_reward_scorer_names_the_choices_for_an_unknown_reward():
    rows = [RewardRow("12", {})] * 2
    assert reward_scorer("synthetic")(["5+7=12#12$", "12$"], rows) == RewardBatch([1.0, 0.0], [{}, {}])
    assert reward_scorer("synthetic_answer")(["12$", "12"], rows).scores == [1.0, 0.0]
    with pytest.raises(ValueError, match="unknown reward type 'f1'.*gsm8k.*math.*synthetic"):
        reward_scorer("f1")
