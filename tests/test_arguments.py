"""Model and prompt-data flags are checked before any process group or model starts, as a new user meets them:
through examples/pretrain_dppo.py and under torchrun, each problem one line naming the flag and the fix."""

import importlib.util
import json
import os
import subprocess
import sys
import time
import uuid

import pytest

from megatron_dppo.launch.arguments import parse_args
from tests.launch import REPO_ROOT, finish, kill_marked, processes_marked, start_torchrun

ENTRY = REPO_ROOT / "examples" / "pretrain_dppo.py"


def run_entry(*flags: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ENTRY), *flags], capture_output=True, text=True, timeout=300,
                          cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT), **(env or {})})


def error_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("pretrain_dppo.py: error:")]


@pytest.fixture
def prompts_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": "What is 2+2?", "label": "4"}) + "\n")
    return path


def test_prompt_file_without_a_model_and_a_missing_model_folder_are_one_line_each(prompts_file):
    # its own held-out file too: without one, a machine lacking the built-in sets would also be told of math500's
    finished = run_entry("--prompt-data", str(prompts_file), "--eval-prompt-data", str(prompts_file))
    assert finished.returncode == 2
    assert finished.stderr.splitlines() == [
        f"pretrain_dppo.py: error: --prompt-data {prompts_file} needs --hf-checkpoint DIR or ORG/NAME, the Hugging "
        "Face model to train and serve (config.json, tokenizer files and *.safetensors); only the embedded default "
        "(--prompt-data synthetic with the embedded engine) runs without one, on its own tiny model",
        "(--help lists every flag)"]
    finished = run_entry("--hf-checkpoint", "/nonexistent")
    assert finished.returncode == 2
    assert error_lines(finished.stderr) == [
        "pretrain_dppo.py: error: --hf-checkpoint /nonexistent: no such directory; pass the local folder of a Hugging "
        "Face model (config.json, tokenizer files and *.safetensors), e.g. one written by save_pretrained, or its Hub "
        "name ORG/NAME"]


def test_under_torchrun_the_flag_error_is_said_once_and_nothing_starts(prompts_file):
    process = start_torchrun(ENTRY, 2, ["--prompt-data", str(prompts_file), "--eval-prompt-data", str(prompts_file)])
    output = finish(process, 300, "torchrun with a bad flag")
    assert process.returncode != 0
    assert len(error_lines(output)) == 1 and "needs --hf-checkpoint DIR" in error_lines(output)[0]


def tracebacks_of_ours(output: str) -> list[str]:
    """The tracebacks in `output` other than torchrun's own failure summary (which ends in its ChildFailedError):
    those of our processes, through megatron_dppo's or torch's frames."""
    blocks = output.split("Traceback (most recent call last):")[1:]
    return [block for block in blocks if "ChildFailedError" not in block.split("\n\n")[0]
            or f"{REPO_ROOT / 'megatron_dppo'}{os.sep}" in block]


def test_out_of_range_flags_under_torchrun_end_within_30_s_with_one_line_no_traceback_and_no_process_left():
    for flag, value, domain in (("--lr", "-1", "a finite number > 0"),
                                ("--rollout-batch-size", "0", "an integer >= 1"),
                                ("--dppo-prompt-prune-rate", "1.5", "auto or a number in [0, 1)")):
        name, marker = "MEGATRON_DPPO_ARGUMENTS_TEST", uuid.uuid4().hex
        process = start_torchrun(ENTRY, 2, [flag, value], env={name: marker})
        try:
            output, _ = process.communicate(timeout=30)
            assert process.returncode != 0
            assert error_lines(output) == [f"pretrain_dppo.py: error: argument {flag}: {value} is out of range; "
                                           f"give {domain}"], output[-3000:]
            assert not tracebacks_of_ours(output), output[-3000:]
            deadline = time.monotonic() + 5
            while processes_marked(f"{name}={marker}"):
                assert time.monotonic() < deadline, f"{flag} {value} left {processes_marked(f'{name}={marker}')}"
                time.sleep(0.1)
        finally:
            kill_marked(f"{name}={marker}")


def test_python_without_torchrun_says_the_flag_error_or_how_to_launch_in_one_line_without_a_traceback(tmp_path):
    finished = run_entry("--lr", "-1")
    assert finished.returncode == 2
    assert finished.stderr.splitlines() == ["pretrain_dppo.py: error: argument --lr: -1 is out of range; give a "
                                            "finite number > 0", "(--help lists every flag)"]
    finished = run_entry()
    assert finished.returncode == 2
    assert finished.stderr.splitlines() == [
        f"pretrain_dppo.py: error: {ENTRY} runs under torchrun, which gives each process RANK, WORLD_SIZE and "
        f"MASTER_ADDR, and this python was started without it: launch with torchrun --nproc-per-node N {ENTRY} "
        "[FLAGS]"]
    from tests.tiny_chat import save_tiny_chat_model

    save_tiny_chat_model(tmp_path / "model")  # a built-in set whose ../shared data is missing: one line per file
    finished = run_entry("--hf-checkpoint", str(tmp_path / "model"), "--prompt-data", "gsm8k",
                         env={"DPPO_DATA_DIR": str(tmp_path / "nowhere")})
    assert finished.returncode == 2 and "Traceback" not in finished.stderr
    lines = finished.stderr.splitlines()
    assert lines[0] == "pretrain_dppo.py: error: invalid arguments:" and lines[-1] == "(--help lists every flag)"
    assert lines[1].startswith(f"  --prompt-data gsm8k: the built-in set is read from {tmp_path / 'nowhere'}")


def test_a_bad_prompt_row_stops_the_run_with_its_file_row_and_fix(tmp_path):
    from tests.tiny_chat import save_tiny_chat_model

    model = tmp_path / "model"
    save_tiny_chat_model(model)
    bad = tmp_path / "prompts.jsonl"
    bad.write_text(json.dumps({"prompt": "What is 2+2?", "label": "4"}) + "\n" + json.dumps({"prompt": "x"}) + "\n")
    process = start_torchrun(ENTRY, 2, ["--hf-checkpoint", model, "--prompt-data", bad, "--eval-prompt-data", bad])
    output = finish(process, 300, "torchrun with a bad prompt file")
    assert process.returncode != 0
    assert error_lines(output) == [f"pretrain_dppo.py: error: {bad}, row 2: field 'label' is missing or null (fix the "
                                   "row, or leave bad rows out with --skip-bad-rows)"]
    # no traceback through our code (torchrun still prints its own failure summary)
    assert f"{REPO_ROOT / 'megatron_dppo'}{os.sep}" not in output


def test_renamed_flags_say_their_new_names():
    finished = run_entry("--data-prompts", "math", "--reward-fn", "math")
    assert finished.returncode == 2
    assert ("unrecognized arguments: --data-prompts math --reward-fn math (--data-prompts is now --prompt-data; "
            "--reward-fn is now --reward-type)") in finished.stderr


def parse_errors(capsys, flags: list[str]) -> str:
    with pytest.raises(SystemExit):
        parse_args(flags)
    return capsys.readouterr().err


def test_flags_that_do_not_apply_to_the_chosen_prompts_are_named(capsys, tmp_path, prompts_file, monkeypatch):
    from tests.tiny_chat import save_tiny_chat_model

    save_tiny_chat_model(tmp_path / "model")
    model = ["--hf-checkpoint", str(tmp_path / "model")]
    assert "--apply-chat-template does not apply to --prompt-data synthetic" in parse_errors(
        capsys, ["--apply-chat-template"])
    assert "--input-key applies to your own prompt files; the built-in set math has its own fields" in parse_errors(
        capsys, [*model, "--prompt-data", "math", "--input-key", "question"])
    assert "--reward-type synthetic has no built-in held-out set: pass --eval-prompt-data SOURCE" in parse_errors(
        capsys, [*model, "--prompt-data", str(prompts_file), "--reward-type", "synthetic"])
    assert f"--prompt-data-split validation applies to Hugging Face data sets; {prompts_file} is read whole" in \
        parse_errors(capsys, [*model, "--prompt-data", str(prompts_file), "--prompt-data-split", "validation"])
    monkeypatch.setenv("DPPO_DATA_DIR", str(tmp_path / "nowhere"))
    message = parse_errors(capsys, [*model, "--prompt-data", str(prompts_file)])
    assert "held-out prompts (--eval-prompt-data defaults to math500 for --reward-type math; pass your own " in message
    args = parse_args([*model, "--prompt-data", str(prompts_file), "--eval-prompt-data", str(prompts_file)])
    assert (args.reward_type, args.eval_sets) == ("math", [("", str(prompts_file))])


def test_named_held_out_sets_parse_in_slimes_form_and_a_bad_count_name_or_configuration_is_one_line(
        capsys, tmp_path, prompts_file):
    from tests.tiny_chat import save_tiny_chat_model

    save_tiny_chat_model(tmp_path / "model")
    flags = ["--hf-checkpoint", str(tmp_path / "model"), "--prompt-data", str(prompts_file)]
    args = parse_args([*flags, "--eval-prompt-data", "easy", str(prompts_file), "hard", str(prompts_file)])
    assert args.eval_sets == [("easy", str(prompts_file)), ("hard", str(prompts_file))]
    assert "--eval-prompt-data takes one SOURCE, or NAME SOURCE pairs (slime's form), but got 3 values" in \
        parse_errors(capsys, [*flags, "--eval-prompt-data", "easy", str(prompts_file), "hard"])
    assert "--eval-prompt-data: the set name 'easy' is given twice" in parse_errors(
        capsys, [*flags, "--eval-prompt-data", "easy", str(prompts_file), "easy", str(prompts_file)])
    assert f"held-out set hard: --eval-prompt-data {tmp_path / 'missing.jsonl'}: no such file" in parse_errors(
        capsys, [*flags, "--eval-prompt-data", "easy", str(prompts_file), "hard", str(tmp_path / "missing.jsonl")])
    assert f"--prompt-data-config main names a configuration of a Hugging Face data set; {prompts_file} is a local " \
           "source read whole: drop it" in parse_errors(capsys, [*flags, "--eval-prompt-data", str(prompts_file),
                                                                "--prompt-data-config", "main"])


@pytest.mark.shared_data
def test_built_in_prompt_data_brings_its_reward_and_held_out_set(tmp_path):
    from tests.tiny_chat import save_tiny_chat_model

    save_tiny_chat_model(tmp_path / "model")
    args = parse_args(["--hf-checkpoint", str(tmp_path / "model"), "--prompt-data", "gsm8k"])
    assert (args.reward_type, args.eval_sets) == ("gsm8k", [("", "gsm8k_test")])


def test_transformer_impl_is_megatron_lms_flag_local_by_default_on_the_cpu_and_te_there_is_one_line(capsys,
                                                                                                      monkeypatch):
    from megatron_dppo.platform import default_transformer_impl, transformer_impl_error

    help_text = run_entry("--help").stdout
    assert "--transformer-impl {transformer_engine,local}" in help_text
    assert parse_args([]).transformer_impl is None and default_transformer_impl() == "local"  # resolved at the build
    assert parse_args(["--transformer-impl", "local"]).transformer_impl == "local"
    message = parse_errors(capsys, ["--transformer-impl", "transformer_engine"])  # TE is not installed here
    assert "--transformer-impl transformer_engine (the default on a GPU) needs Transformer Engine" in message
    assert "pass --transformer-impl local" in message and "Traceback" not in message
    # where TE is installed but no GPU is visible, it is refused as well (here at the model's build), in one line
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *rest: object() if name == "transformer_engine" else real_find_spec(name, *rest))
    assert transformer_impl_error("transformer_engine").startswith("--transformer-impl transformer_engine needs a CUDA "
                                                                   "GPU")
    assert transformer_impl_error("local") is None


def test_rollout_server_gpus_above_1_is_refused_for_servers_that_join_the_sync_group_as_one_rank(capsys):
    for backend, flags in (("embedded", []), ("vllm", ["--rollout-python", sys.executable])):
        message = parse_errors(capsys, ["--rollout-backend", backend, *flags, "--rollout-server-gpus", "2"])
        assert f"--rollout-server-gpus 2: a --rollout-backend {backend} server joins the weight-sync group as one " \
               "rank" in message, message
    assert parse_args(["--rollout-backend", "embedded", "--rollout-server-gpus", "1"]).rollout_server_gpus == 1
