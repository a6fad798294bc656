"""--apply-chat-template-kwargs JSON (slime's flag; e.g. Qwen3's '{"enable_thinking": false}'): refused at parse time
in one line unless it is a JSON object of the template's own arguments given with --apply-chat-template; rendered
into every prompt the trainer trains and evaluates on, and every prompt tools/evaluate.py generates from; a key the
template never mentions is named (a template ignores it silently). The tiny chat model's template (tests/tiny_chat.py)
has Qwen3's switch: `enable_thinking is false` writes an empty think block after the assistant's turn, as Qwen3's
does."""

import json
import subprocess
import sys

import pytest

from megatron_dppo.data.datasets import PromptDataError, load_prompt_data
from megatron_dppo.launch.arguments import parse_args
from megatron_dppo.launch.run import build_task, load_tokenizer
from megatron_dppo.pipeline.tasks import dataset_task
from tests.launch import REPO_ROOT

NO_THINKING = '{"enable_thinking": false}'


@pytest.fixture(scope="module")
def thinking_model(tmp_path_factory):
    """The tiny chat model (tests/tiny_chat.py), whose template has Qwen3's thinking switch."""
    from tests.tiny_chat import save_tiny_chat_model

    model_dir = tmp_path_factory.mktemp("thinking") / "model"
    save_tiny_chat_model(model_dir)
    return model_dir


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"What is {i}+{i}?", "label": str(2 * i)}) + "\n" for i in range(4)))
    return path


def test_the_template_kwargs_reach_every_training_and_held_out_prompt(thinking_model, prompts_file):
    args = parse_args(["--hf-checkpoint", str(thinking_model), "--prompt-data", str(prompts_file),
                       "--eval-prompt-data", str(prompts_file), "--apply-chat-template",
                       "--apply-chat-template-kwargs", NO_THINKING])
    assert args.apply_chat_template_kwargs == {"enable_thinking": False}
    tokenizer = load_tokenizer(thinking_model)
    task = build_task(args, tokenizer)
    for prompt in task.prompts + task.heldout(4):
        messages = [{"role": "user", "content": prompt.fields["prompt"]}]
        assert prompt.input_ids == tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                                 enable_thinking=False)["input_ids"]
        assert prompt.text.endswith("<|assistant|><think></think>")
    thinking = build_task(parse_args(["--hf-checkpoint", str(thinking_model), "--prompt-data", str(prompts_file),
                                      "--eval-prompt-data", str(prompts_file), "--apply-chat-template"]), tokenizer)
    assert all(prompt.text.endswith("<|assistant|>") for prompt in thinking.prompts)  # the template's own default


@pytest.mark.parametrize("value, message", [
    ("{enable_thinking: false}", "'{enable_thinking: false}' is not JSON (Expecting property name enclosed in double "
                                 "quotes at character 1): give an object, e.g. '{\"enable_thinking\": false}'"),
    ("[1, 2]", "'[1, 2]' is a JSON list, not an object: give the template's arguments by name"),
    ('{"add_generation_prompt": false}', "'add_generation_prompt' is set by the trainer itself (it sets "
                                         "conversation, tokenize, add_generation_prompt): drop it"),
])
def test_bad_json_a_non_object_or_a_reserved_key_is_refused_at_parse_time_in_one_line(value, message, capsys):
    with pytest.raises(SystemExit) as stopped:
        parse_args(["--apply-chat-template", "--apply-chat-template-kwargs", value])
    assert stopped.value.code == 2
    first, *rest = capsys.readouterr().err.splitlines()
    assert first.startswith(f"pretrain_dppo.py: error: argument --apply-chat-template-kwargs: {message}"), first
    assert rest == ["(--help lists every flag)"]


def test_kwargs_without_the_chat_template_are_refused_in_one_line(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--apply-chat-template-kwargs", NO_THINKING])
    assert capsys.readouterr().err.splitlines()[0] == (
        "pretrain_dppo.py: error: --apply-chat-template-kwargs are arguments of the chat template: add "
        "--apply-chat-template")


def test_a_key_the_template_never_mentions_is_named_before_anything_starts(thinking_model, prompts_file):
    tokenizer = load_tokenizer(thinking_model)
    examples = load_prompt_data(str(prompts_file))
    with pytest.raises(PromptDataError, match=r"--apply-chat-template-kwargs: the chat template of .* never mentions "
                                              r"'enable_thinkng', so it would render every prompt as if the key were "
                                              r"not given: check the key's name against the template, or drop it"):
        dataset_task(examples, examples, tokenizer, 0, "math", True, chat_template_kwargs={"enable_thinkng": False})


VERL_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": 0.5, "pred": "same for all", "row": extra_info["label"]}

def raises(data_source, solution_str, ground_truth, extra_info=None):
    raise RuntimeError("no grader for " + data_source)
"""


def evaluate(tmp_path, model, benchmark, *flags) -> subprocess.CompletedProcess:
    command = [sys.executable, str(REPO_ROOT / "tools" / "evaluate.py"), "--model-dir", str(model), "--benchmarks",
               str(benchmark), "--k", "2", "--temperature", "1.0", "--max-new-tokens", "4", "--output-dir",
               str(tmp_path / "eval"), "--reward-workers", "1", "--no-progress", *flags]
    return subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)


def test_evaluate_tool_renders_with_the_kwargs_and_scores_with_a_verl_style_reward_or_stops_naming_the_row(
        thinking_model, prompts_file, tmp_path):
    reward = tmp_path / "verl_reward.py"
    reward.write_text(VERL_REWARD)
    finished = evaluate(tmp_path, thinking_model, prompts_file, "--apply-chat-template",
                        "--apply-chat-template-kwargs", NO_THINKING, "--custom-reward-function",
                        f"{reward}:compute_score")
    assert finished.returncode == 0, finished.stderr[-3000:]
    (summary,) = json.loads((tmp_path / "eval" / "results.json").read_text())["benchmarks"].values()
    assert all(problem["prompt"].endswith("<|assistant|><think></think>") for problem in summary["problems"])
    assert summary["pass@1"] == 0.5 and summary["maj@k"] == 0.5  # every sample votes "same for all", scoring 0.5
    assert [problem["answers"] for problem in summary["problems"]] == [["same for all"] * 2] * 4

    finished = evaluate(tmp_path, thinking_model, prompts_file, "--custom-reward-function", f"{reward}:raises")
    # the benchmark's 8 samples (4 problems x 2) are scored as one batch, every call raising
    assert finished.returncode == 1 and "Traceback" not in finished.stderr
    assert finished.stderr.strip().splitlines()[-1] == (
        f"evaluate.py: error: --custom-reward-function {reward}:raises: raises raised RuntimeError: no grader for "
        f"{prompts_file} on {prompts_file}, row 1; 8 failed calls so far, more than --custom-reward-max-failures 0: "
        "fix raises (it must return a finite number or a dict with a finite 'score'), or raise "
        "--custom-reward-max-failures to score such calls 0")
