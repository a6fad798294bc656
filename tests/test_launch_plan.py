"""The --dry-run launch plan: node roles, Megatron rank coordinates, rollout URLs and the weight-sync group."""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_dppo.launch.arguments import parse_args
from megatron_dppo.launch.launch_plan import build_plan, expand_nodelist, format_plan, plan_from_environment

REPO = Path(__file__).resolve().parents[1]
NODES = ["gpu01", "gpu02", "gpu03", "gpu04"]
SERVER_URLS = [f"http://{node}:{30000 + i}" for node in ("gpu03", "gpu04") for i in range(4)]


def four_node_args(monkeypatch, urls=SERVER_URLS, tp=2, pp=2, sglang_tp=2):
    monkeypatch.setenv("WORLD_SIZE", "16")
    # --dry-run: the plan is printed where the model folder may not be visible, so the folder is not checked
    return parse_args(["--dry-run", "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size",
                       str(pp), "--hf-checkpoint", "Qwen3-4B", "--rollout-backend", "external", "--rollout-urls",
                       *urls, "--rollout-server-gpus", str(sglang_tp)])


def four_node_plan(monkeypatch):
    """2 trainer nodes + 2 rollout nodes, 8 GPUs each, trainer TP=2 PP=2, SGLang TP=2."""
    return build_plan(four_node_args(monkeypatch), NODES, trainer_nodes=2, rollout_nodes=2, gpus_per_node=8)


def test_four_node_plan_assigns_roles_and_rendezvous_to_the_first_trainer_node(monkeypatch):
    plan = four_node_plan(monkeypatch)
    assert plan.roles == {"gpu01": "trainer", "gpu02": "trainer", "gpu03": "rollout", "gpu04": "rollout"}
    assert plan.trainer_nodes == ["gpu01", "gpu02"] and plan.rollout_nodes == ["gpu03", "gpu04"]
    assert plan.rendezvous == "gpu01:29500"
    assert (plan.tp, plan.pp, plan.dp) == (2, 2, 4)


def test_four_node_plan_ranks_follow_megatron_order_tp_then_dp_then_pp(monkeypatch):
    plan = four_node_plan(monkeypatch)
    assert len(plan.ranks) == 16
    by_rank = {r.rank: (r.node, r.local_rank, r.tp, r.pp, r.dp) for r in plan.ranks}
    assert by_rank[0] == ("gpu01", 0, 0, 0, 0)
    assert by_rank[1] == ("gpu01", 1, 1, 0, 0)
    assert by_rank[2] == ("gpu01", 2, 0, 0, 1)
    assert by_rank[7] == ("gpu01", 7, 1, 0, 3)
    assert by_rank[8] == ("gpu02", 0, 0, 1, 0)
    assert by_rank[13] == ("gpu02", 5, 1, 1, 2)
    assert by_rank[15] == ("gpu02", 7, 1, 1, 3)
    # Each pipeline stage fills one node: stage 0 on gpu01, stage 1 on gpu02.
    assert {r.node for r in plan.ranks if r.pp == 0} == {"gpu01"}
    assert {r.node for r in plan.ranks if r.pp == 1} == {"gpu02"}


@pytest.mark.parametrize("tp,pp,gpus", [(2, 2, 8), (4, 1, 8), (1, 4, 4), (2, 4, 8)])
def test_plan_groups_match_megatron_rank_generator(monkeypatch, tp, pp, gpus):
    """The TP/PP/DP groups the plan implies are exactly those megatron.core.parallel_state builds."""
    from megatron.core.parallel_state import RankGenerator

    monkeypatch.setenv("WORLD_SIZE", str(2 * gpus))
    args = parse_args(["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)])
    plan = build_plan(args, ["a", "b"], trainer_nodes=2, rollout_nodes=0, gpus_per_node=gpus)
    generator = RankGenerator(tp=tp, ep=1, dp=plan.dp, pp=pp, cp=1, order="tp-cp-ep-dp-pp")

    def groups(varying: str) -> list[list[int]]:
        fixed = [name for name in ("tp", "pp", "dp") if name != varying]
        keyed: dict[tuple, list[int]] = {}
        for r in plan.ranks:
            keyed.setdefault(tuple(getattr(r, name) for name in fixed), []).append(r.rank)
        return sorted(keyed.values())

    for name in ("tp", "pp", "dp"):
        assert groups(name) == sorted(generator.get_ranks(name)), name


def test_four_node_plan_lists_one_sglang_server_per_tp_group_with_urls_and_sync_offsets(monkeypatch):
    plan = four_node_plan(monkeypatch)
    assert plan.urls == SERVER_URLS
    assert [(s.node, s.gpus, s.port, s.tp) for s in plan.servers[:4]] == [
        ("gpu03", (0, 1), 30000, 2), ("gpu03", (2, 3), 30001, 2), ("gpu03", (4, 5), 30002, 2),
        ("gpu03", (6, 7), 30003, 2)]
    assert plan.servers[4].node == "gpu04" and plan.servers[4].gpus == (0, 1)
    assert [s.sync_rank_offset for s in plan.servers] == [1, 3, 5, 7, 9, 11, 13, 15]
    assert plan.weight_sync.world_size == 17  # trainer rank 0 + 16 server GPUs
    assert plan.weight_sync.master_address == "gpu01"
    assert plan.weight_sync.backend == "nccl"


def test_format_plan_prints_every_rank_server_and_the_sync_group(monkeypatch):
    text = format_plan(four_node_plan(monkeypatch))
    assert "world 16 = TP 2 x PP 2 x DP 4" in text
    assert "--rdzv-endpoint gpu01:29500" in text
    rank_rows = [line.split() for line in text.splitlines() if line.split()[:1] and line.split()[0].isdigit()
                 and len(line.split()) == 6]
    assert len(rank_rows) == 16
    assert rank_rows[13] == ["13", "gpu02", "5", "1", "1", "2"]
    for url in SERVER_URLS:
        assert url in text
    assert "http://gpu04:30003  15-16" in text
    assert "world 17 = 1 trainer rank + 16 server ranks" in text and "on gpu01" in text


def test_dry_run_of_the_entry_point_prints_the_plan_and_starts_nothing(tmp_path):
    env = {**os.environ, "WORLD_SIZE": "16", "SLURM_JOB_NODELIST": "gpu[01-04]", "DPPO_ROLLOUT_NODES": "2",
           "DPPO_GPUS_PER_NODE": "8"}
    log_dir = tmp_path / "logs"
    result = subprocess.run(
        [sys.executable, str(REPO / "examples" / "pretrain_dppo.py"), "--dry-run", "--tensor-model-parallel-size",
         "2", "--pipeline-model-parallel-size", "2", "--hf-checkpoint", "Qwen3-4B", "--rollout-backend", "external",
         "--rollout-urls", *SERVER_URLS, "--rollout-server-gpus", "2", "--log-dir", str(log_dir)],
        env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "4 nodes, 2 trainer, 2 rollout, 8 GPUs per node" in result.stdout
    assert "gpu02  trainer" in result.stdout and "gpu04  rollout" in result.stdout
    assert "heldout_accuracy" not in result.stdout  # no run summary: nothing trained
    assert not log_dir.exists()


def test_laying_out_the_plan_with_its_sync_group_stays_torch_free():
    # --dry-run runs before every Slurm launch; the sync group's offsets come from weight_update_protocol, whose
    # tensor functions must import torch only when called
    flags = ["--dry-run", "--hf-checkpoint", "Qwen3-4B", "--rollout-backend", "external", "--rollout-urls",
             *SERVER_URLS, "--rollout-server-gpus", "2"]
    code = ("import sys; from megatron_dppo.launch.arguments import parse_args; "
            "from megatron_dppo.launch.launch_plan import build_plan, format_plan; "
            f"args = parse_args({flags!r}); "
            f"format_plan(build_plan(args, {NODES!r}, trainer_nodes=2, rollout_nodes=2, gpus_per_node=8)); "
            "print(sorted(m for m in ('torch', 'megatron') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                            env={**os.environ, "WORLD_SIZE": "16"}, timeout=60)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "[]", f"laying out the plan imported {result.stdout.strip()}"


def test_expand_nodelist_handles_ranges_lists_and_zero_padding():
    assert expand_nodelist("gpu[01-03,07],login1") == ["gpu01", "gpu02", "gpu03", "gpu07", "login1"]
    assert expand_nodelist("n[8-10]-ib") == ["n8-ib", "n9-ib", "n10-ib"]
    assert expand_nodelist("localhost") == ["localhost"]
    with pytest.raises(ValueError, match="not a number"):
        expand_nodelist("gpu[a-b]")


def test_plan_from_environment_reads_slurm_and_script_variables(monkeypatch):
    args = four_node_args(monkeypatch)
    env = {"SLURM_JOB_NODELIST": "gpu[01-04]", "DPPO_ROLLOUT_NODES": "2", "SLURM_GPUS_ON_NODE": "8",
           "DPPO_RDZV_PORT": "29999"}
    plan = plan_from_environment(args, env)
    assert plan.nodes == tuple(NODES) and plan.rendezvous == "gpu01:29999"
    assert plan.urls == SERVER_URLS
    with pytest.raises(ValueError, match="DPPO_ROLLOUT_NODES='two' must be an integer"):
        plan_from_environment(args, {**env, "DPPO_ROLLOUT_NODES": "two"})


def test_embedded_default_plan_has_one_cpu_engine_on_rank_zero_node(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    plan = build_plan(parse_args([]), ["localhost"], trainer_nodes=1, rollout_nodes=0, gpus_per_node=2)
    assert [(r.rank, r.dp) for r in plan.ranks] == [(0, 0), (1, 1)]
    assert len(plan.servers) == 1 and plan.servers[0].gpus == () and plan.servers[0].port is None
    assert plan.weight_sync.backend == "gloo" and plan.weight_sync.world_size == 2


def test_bad_layouts_raise_errors_naming_the_input_and_the_fix(monkeypatch):
    args = four_node_args(monkeypatch)
    with pytest.raises(ValueError, match="need 5 nodes but the allocation has 4"):
        build_plan(args, NODES, trainer_nodes=3, rollout_nodes=2, gpus_per_node=8)
    with pytest.raises(ValueError, match=r"--rollout-server-gpus 3 \(SGLang TP\) does not divide the 8 GPUs"):
        build_plan(four_node_args(monkeypatch, sglang_tp=3), NODES, trainer_nodes=2, rollout_nodes=2, gpus_per_node=8)
    with pytest.raises(ValueError, match=r"= 4 does not divide the 6 trainer processes"):
        build_plan(four_node_args(monkeypatch, sglang_tp=1), NODES, trainer_nodes=2, rollout_nodes=2, gpus_per_node=3)
    with pytest.raises(ValueError, match="differ from the servers started on the rollout nodes"):
        build_plan(four_node_args(monkeypatch, urls=SERVER_URLS[:-1]), NODES, trainer_nodes=2, rollout_nodes=2,
                   gpus_per_node=8)
    with pytest.raises(ValueError, match="8 trainer processes per node need as many GPUs, but a node has 4"):
        build_plan(args, NODES, trainer_nodes=2, rollout_nodes=0, gpus_per_node=4, processes_per_node=8)
    monkeypatch.setenv("WORLD_SIZE", "16")
    embedded = parse_args(["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"])
    with pytest.raises(ValueError, match="use --rollout-backend external"):
        build_plan(embedded, NODES, trainer_nodes=2, rollout_nodes=2, gpus_per_node=8)


# ------------------------------------------------------------------ servers rank 0 starts: GPUs and command lines
ENTRY = REPO / "examples" / "pretrain_dppo.py"
# torchrun --nproc-per-node 4 on one node of 8 GPUs
NODE_OF_EIGHT = {"DPPO_GPUS_PER_NODE": "8", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4"}
MUST_SHOW = ["--dry-run", "--rollout-backend", "sglang", "--rollout-num-servers", "2", "--sglang-tp-size", "2",
             "--sglang-mem-fraction-static", "0.7"]


def dry_run(flags: list[str], env: dict) -> subprocess.CompletedProcess:
    """The entry point's --dry-run with exactly `env` on top of this environment's (no launcher variables)."""
    clean = {key: value for key, value in os.environ.items()
             if not key.startswith(("DPPO_", "SLURM_", "CUDA_VISIBLE", "LOCAL_WORLD", "WORLD_SIZE"))}
    return subprocess.run([sys.executable, str(ENTRY), *flags], env={**clean, **env}, capture_output=True, text=True,
                          timeout=120)


def printed_servers(stdout: str) -> list[tuple[str, list[str]]]:
    """(CUDA_VISIBLE_DEVICES, command line) of every server the plan prints."""
    lines = stdout.splitlines()
    return [(match.group(1), shlex.split(lines[index + 1])) for index, line in enumerate(lines)
            if (match := re.fullmatch(r"  server \d+: CUDA_VISIBLE_DEVICES=(.*) on \S+", line))]


def test_dry_run_of_4_trainer_ranks_and_2_sglang_servers_on_an_8_gpu_node_shows_their_gpus_and_sglang_commands():
    from tests.test_engine_parsers import sglang_parse

    result = dry_run(MUST_SHOW, NODE_OF_EIGHT)
    assert result.returncode == 0, result.stderr
    assert "--nproc-per-node 4" in result.stdout and "trainer GPUs: 0-3 of each trainer node" in result.stdout
    servers = printed_servers(result.stdout)
    assert [devices for devices, _ in servers] == ["4,5", "6,7"], result.stdout
    commands = [command for _, command in servers]
    for command in commands:
        assert not [token for token in command if token.startswith("--sglang-")], command
        assert "--tp-size 2" in shlex.join(command) and "--mem-fraction-static 0.7" in shlex.join(command)
    for command, parsed in zip(commands, sglang_parse(commands), strict=True):  # SGLang's own parser
        assert parsed["error"] is None, f"SGLang refuses {shlex.join(command)}: {parsed['error']}"
        assert (parsed["values"]["tp_size"], parsed["values"]["mem_fraction_static"]) == (2, 0.7)
    assert "backend nccl, world 5 = 1 trainer rank + 4 server ranks" in result.stdout


def test_dry_run_with_vllm_shows_each_servers_gpu_apart_from_the_trainers_and_its_command():
    result = dry_run(["--dry-run", "--rollout-backend", "vllm", "--rollout-python", "/envs/vllm/bin/python",
                      "--rollout-num-servers", "2", "--bf16"], NODE_OF_EIGHT)
    assert result.returncode == 0, result.stderr
    servers = printed_servers(result.stdout)
    assert [devices for devices, _ in servers] == ["4", "5"], result.stdout
    for _, command in servers:
        assert command[:3] == ["/envs/vllm/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
        assert "--dtype bfloat16" in shlex.join(command) and "--enforce-eager" not in command


def test_dry_run_of_servers_colocated_with_the_trainer_shows_its_gpu_and_a_gloo_sync_group():
    result = dry_run(["--dry-run", "--rollout-backend", "sglang", "--rollout-colocate", "--hf-checkpoint",
                      "/models/qwen3", "--sglang-mem-fraction-static", "0.3"],
                     {"DPPO_GPUS_PER_NODE": "1", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"})
    assert result.returncode == 0, result.stderr
    (devices, command), = printed_servers(result.stdout)
    assert devices == "0" and command[command.index("--model-path") + 1] == "/models/qwen3"
    assert "backend gloo" in result.stdout


@pytest.mark.parametrize("flags,env,message", [
    (["--rollout-backend", "sglang"], {"DPPO_NODES": "a,b", "DPPO_ROLLOUT_NODES": "1", "DPPO_GPUS_PER_NODE": "8",
                                       "WORLD_SIZE": "8"},
     "1 rollout nodes serve SGLang but --rollout-backend is sglang"),
    (["--rollout-backend", "sglang", "--rollout-num-servers", "3", "--sglang-tp-size", "2"], NODE_OF_EIGHT,
     "4 trainer ranks and 3 SGLang servers x 2 GPUs need 10 GPUs on this node, but 8 are visible"),
])
def test_a_plan_that_cannot_be_laid_out_ends_in_one_line(flags, env, message):
    result = dry_run(["--dry-run", *flags], env)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and message in result.stderr, result.stderr


def test_plan_prints_the_commands_rollout_node_sh_runs_on_a_rollout_node(monkeypatch, tmp_path):
    """examples/slurm/rollout_node.sh builds its servers' commands in shell; run with a stand-in interpreter that
    records what it was started with, they equal what the plan prints for that node."""
    from megatron_dppo.launch.launch_plan import RolloutNodeServers

    record = tmp_path / "started"
    python = tmp_path / "python"
    # each stand-in server records itself, then lives a moment: the script stops all once one has exited
    python.write_text(f'#!/usr/bin/env bash\necho "$CUDA_VISIBLE_DEVICES $0 $*" >> {record}\nsleep 3\n')
    python.chmod(0o755)
    extra = ("--mem-fraction-static", "0.8", "--context-length", "4096")
    subprocess.run(["bash", str(REPO / "examples" / "slurm" / "rollout_node.sh"), "/models/qwen3", "8", "2", "30000",
                    str(tmp_path / "logs"), str(python), *extra], env={**os.environ, "SLURMD_NODENAME": "gpu03"},
                   capture_output=True, text=True, timeout=60)
    started = sorted(record.read_text().splitlines())
    plan = build_plan(four_node_args(monkeypatch), NODES, trainer_nodes=2, rollout_nodes=2, gpus_per_node=8,
                      node_servers=RolloutNodeServers(str(python), "/models/qwen3", extra))
    printed = sorted(f"{server.cuda_visible_devices} {shlex.join(server.command)}" for server in plan.servers
                     if server.node == "gpu03")
    assert len(started) == 4 and started == printed
    text = format_plan(plan)
    assert "commands examples/slurm/rollout_node.sh runs on each rollout node:" in text
    assert "server 7: CUDA_VISIBLE_DEVICES=6,7 on gpu04" in text


def test_plan_prints_the_embedded_engines_rollout_node_sh_runs_with_rollout_engine_embedded(monkeypatch, tmp_path):
    """ROLLOUT_ENGINE=embedded: rollout_node.sh starts one embedded CPU engine per "GPU" of the node (TP 1) with the
    command the plan prints, and the weight-sync group is gloo; any other TP is refused by both."""
    from megatron_dppo.launch.launch_plan import RolloutNodeServers

    record = tmp_path / "started"
    python = tmp_path / "python"
    python.write_text(f'#!/usr/bin/env bash\necho "$0 $*" >> {record}\nsleep 3\n')
    python.chmod(0o755)
    extra = ("--threads", "1")
    env = {**os.environ, "SLURMD_NODENAME": "gpu03", "ROLLOUT_ENGINE": "embedded"}
    subprocess.run(["bash", str(REPO / "examples" / "slurm" / "rollout_node.sh"), "/models/tiny", "2", "1", "30000",
                    str(tmp_path / "logs"), str(python), *extra], env=env, capture_output=True, text=True, timeout=60)
    urls = [f"http://{node}:{30000 + i}" for node in ("gpu03", "gpu04") for i in range(2)]
    args = four_node_args(monkeypatch, urls=urls, sglang_tp=1)
    servers = RolloutNodeServers(str(python), "/models/tiny", extra, engine="embedded")
    plan = build_plan(args, NODES, trainer_nodes=2, rollout_nodes=2, gpus_per_node=2, node_servers=servers)
    printed = sorted(shlex.join(server.command) for server in plan.servers if server.node == "gpu03")
    assert sorted(record.read_text().splitlines()) == printed and len(printed) == 2
    assert all(server.gpus == () and server.sync_ranks == 1 for server in plan.servers)
    assert plan.weight_sync.backend == "gloo"
    refused = subprocess.run(["bash", str(REPO / "examples" / "slurm" / "rollout_node.sh"), "/models/tiny", "2", "2",
                              "30000", str(tmp_path / "logs"), str(python)], env=env, capture_output=True, text=True,
                             timeout=60)
    assert refused.returncode == 2 and "SGLANG_TP=1" in refused.stderr
    with pytest.raises(ValueError, match="SGLANG_TP=1"):
        build_plan(four_node_args(monkeypatch, urls=urls[:1], sglang_tp=2), NODES, trainer_nodes=2, rollout_nodes=2,
                   gpus_per_node=2, node_servers=servers)
