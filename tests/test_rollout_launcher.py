"""The commands and environments the launcher builds for rollout servers started from a trainer rank.

Under torchrun the trainer's environment names its process group (RANK, MASTER_ADDR, TORCHELASTIC_USE_AGENT_STORE,
...): a server inheriting it would join torchelastic's agent store and hang in its own rendezvous, and GPUs
0 .. LOCAL_WORLD_SIZE-1 are the trainer ranks'. These tests build the servers exactly as `launch_sglang_servers`
starts them (`sglang_servers`), without starting them, and read what each process would get.
"""

import pytest

from megatron_dppo.rollout.client import RolloutServerError
from megatron_dppo.rollout.launcher import SGLANG_DETERMINISTIC, embedded_engine_command, server_env, sglang_servers

TORCHRUN_ENV = {
    "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0",
    "ROLE_RANK": "0", "ROLE_NAME": "default", "ROLE_WORLD_SIZE": "4", "GROUP_WORLD_SIZE": "2",
    "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "TORCHELASTIC_USE_AGENT_STORE": "True",
    "TORCHELASTIC_RUN_ID": "job", "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
    "PATH": "/usr/bin", "HF_HOME": "/cache", "NCCL_SOCKET_IFNAME": "ib0", "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7",
}


def test_sglang_servers_under_torchrun_get_a_clean_environment_their_own_gpus_and_deterministic_inference():
    servers = sglang_servers(3, "/models/qwen3", ["--tp-size", "2", "--mem-fraction-static=0.8"], ports=[1, 2, 3],
                             gpus_per_server=2, environ=TORCHRUN_ENV)
    assert [server.url for server in servers] == ["http://127.0.0.1:1", "http://127.0.0.1:2", "http://127.0.0.1:3"]
    # trainer ranks hold GPUs 0 and 1 (LOCAL_WORLD_SIZE=2); each server gets the next two, none shared
    assert [server.env["CUDA_VISIBLE_DEVICES"] for server in servers] == ["2,3", "4,5", "6,7"]
    for server in servers:
        leaked = sorted(key for key in server.env if key in TORCHRUN_ENV and key not in
                        ("PATH", "HF_HOME", "NCCL_SOCKET_IFNAME", "CUDA_VISIBLE_DEVICES"))
        assert not leaked, f"torchrun's variables reach the SGLang server: {leaked}"
        assert {key: server.env[key] for key in ("PATH", "HF_HOME", "NCCL_SOCKET_IFNAME")} == {
            "PATH": "/usr/bin", "HF_HOME": "/cache", "NCCL_SOCKET_IFNAME": "ib0"}
        command = server.command
        assert command[1:3] == ["-m", "sglang.launch_server"] and command.count(SGLANG_DETERMINISTIC) == 1
        assert command[-2:] == ["2", "--mem-fraction-static=0.8"]
    # given explicitly, the flag is not repeated
    (explicit,) = sglang_servers(1, "/m", [SGLANG_DETERMINISTIC], ports=[1], environ=TORCHRUN_ENV)
    assert explicit.command.count(SGLANG_DETERMINISTIC) == 1


def test_visible_devices_are_honoured_and_too_few_gpus_is_a_clear_error():
    environ = {**TORCHRUN_ENV, "CUDA_VISIBLE_DEVICES": "4,5,6,7", "LOCAL_WORLD_SIZE": "1"}
    (server,) = sglang_servers(1, "/m", [], ports=[1], gpus_per_server=2, environ=environ)
    assert server.env["CUDA_VISIBLE_DEVICES"] == "5,6"  # physical ids after the trainer's cuda:0 (= GPU 4)
    (shared,) = sglang_servers(1, "/m", [], ports=[1], environ={**environ, "CUDA_VISIBLE_DEVICES": "3"},
                               colocate=True)
    assert shared.env["CUDA_VISIBLE_DEVICES"] == "3"  # --rollout-colocate: the trainer's own GPU
    with pytest.raises(RolloutServerError, match="2 trainer ranks and 2 SGLang servers x 4 GPUs need 10 GPUs.*8 are "
                                                 "visible"):
        sglang_servers(2, "/m", [], ports=[1, 2], gpus_per_server=4, environ=TORCHRUN_ENV)


def test_server_env_and_embedded_engine_command():
    assert server_env(TORCHRUN_ENV) == {"PATH": "/usr/bin", "HF_HOME": "/cache", "NCCL_SOCKET_IFNAME": "ib0",
                                        "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}
    command = embedded_engine_command("/m", "127.0.0.1", 5, threads=2, enable_deterministic_inference=True,
                                      api_key=None)
    assert command[-3:] == ["--threads", "2", "--enable-deterministic-inference"] and "--api-key" not in command


def test_vllm_servers_get_their_own_gpus_after_the_trainers_and_a_clean_environment(monkeypatch, tmp_path):
    """Each vLLM server started by rank 0 gets CUDA_VISIBLE_DEVICES past the trainer's GPUs, or vLLM would take
    cuda:0, trainer rank 0's GPU. Built as `launch_vllm_servers` starts them, without starting them."""
    from megatron_dppo.rollout import launcher

    (tmp_path / "config.json").write_text("{}")
    monkeypatch.setattr(launcher, "start_all", lambda handles: handles)
    for key, value in TORCHRUN_ENV.items():
        monkeypatch.setenv(key, value)
    servers = launcher.launch_vllm_servers(2, str(tmp_path), python="/bin/sh", ports=[1, 2])
    assert [server.env.get("CUDA_VISIBLE_DEVICES") for server in servers] == ["2", "3"]  # trainer: GPUs 0 and 1
    for server in servers:
        assert not {"RANK", "LOCAL_RANK", "MASTER_ADDR", "TORCHELASTIC_USE_AGENT_STORE"} & set(server.env)


def test_too_few_gpus_for_the_servers_fail_the_run_before_the_model_loads(monkeypatch, tmp_path):
    """The layout is checked first: a model folder whose files cannot load shows that nothing was read before."""
    from megatron_dppo.launch import run
    from megatron_dppo.launch.arguments import parse_args

    for name in ("config.json", "tokenizer.json", "model.safetensors"):
        (tmp_path / name).write_text("not a model")
    for key, value in {"RANK": "0", "LOCAL_WORLD_SIZE": "1", "WORLD_SIZE": "1", "CUDA_VISIBLE_DEVICES": "0"}.items():
        monkeypatch.setenv(key, value)
    args = parse_args(["--hf-checkpoint", str(tmp_path), "--rollout-backend", "sglang", "--prompt-data", "gsm8k",
                       "--dry-run"])
    args.dry_run = False  # parsed as --dry-run only so that the prompt files are not looked for
    with pytest.raises(RolloutServerError, match="1 trainer ranks and 1 SGLang servers x 1 GPUs need 2 GPUs on this "
                                                 "node, but 1 are visible"):
        run.run(args)


def test_the_process_group_timeout_is_distributed_timeout_minutes(monkeypatch):
    """Rank 0 generates while the others wait in a collective: their wait is the flag's, 120 minutes by default."""
    from megatron_dppo.launch import run
    from megatron_dppo.launch.arguments import parse_args

    class Started(Exception):
        pass

    def init_parallel(tp, pp, seed, timeout_s):
        raise Started(timeout_s)

    monkeypatch.setattr(run, "init_parallel", init_parallel)
    for flags, seconds in (([], 7200.0), (["--distributed-timeout-minutes", "300"], 18000.0)):
        with pytest.raises(Started) as started:
            run.run(parse_args(flags))
        assert started.value.args == (seconds,)
