"""The resolved launch plan of a run, printed by `examples/pretrain_dppo.py --dry-run` (nothing is started).

    parsed args + node list + nodes per role + GPUs and trainer processes per node
        ──► build_plan ──► LaunchPlan: node roles, trainer ranks with their (tp, pp, dp) coordinates and GPUs,
                           the torchrun rendezvous, rollout servers with URLs, GPUs, their full command lines and
                           CUDA_VISIBLE_DEVICES, the weight-sync group
        ──► format_plan ──► text;  print_plan: the text, or one line saying why the plan cannot be laid out
    + --hf-checkpoint's config.json ──► memory_plan.dry_run_memory_plan ──► each trainer GPU's memory plan, or one
        line naming the flags that would make it fit (a plan for GPUs that cannot hold it ends the dry run, status 2)
        ──► --rollout-colocate: colocated_sglang.dry_run_colocated_share ──► the server's share of a shared GPU and
            the --mem-fraction-static its command gets (the plan is laid out again with it), or one line refusing it

`plan_from_environment` reads the inputs from what examples/slurm/dppo.sbatch exports (DPPO_NODES,
DPPO_TRAINER_NODES, DPPO_ROLLOUT_NODES, DPPO_GPUS_PER_NODE, DPPO_ROLLOUT_PORT, DPPO_RDZV_PORT), falling back to
Slurm's own variables (SLURM_JOB_NODELIST, SLURM_GPUS_ON_NODE), and torchrun's (WORLD_SIZE, LOCAL_WORLD_SIZE: the
trainer processes per node). An SGLang server's GPUs are --rollout-server-gpus (= --sglang-tp-size; one number).

Invariants:
- trainer ranks follow Megatron's default order "tp-cp-ep-dp-pp" (cp = ep = 1 here): tp varies fastest, then dp,
  then pp; global rank = node index x processes per node + local rank (torchrun's order), on GPU local rank;
- the first `trainer_nodes` nodes train, the next `rollout_nodes` serve; trainer rank 0 sits on the first node and
  hosts both the torchrun rendezvous and the weight-sync group;
- servers rank 0 starts on its node are laid out and their commands built by the launcher's own functions
  (rollout/launcher.py: local_servers, server_gpus), so the plan shows what a run starts: GPUs after the trainer's,
  or the trainer's own with --rollout-colocate;
- weight-sync group: trainer rank 0 is group rank 0, server i joins at 1 + (GPUs of servers before it),
  world size = 1 + all server GPUs (weight_update_protocol.sync_rank_offsets, as WeightSyncer.init_group forms it).
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from dataclasses import dataclass
from urllib.parse import urlsplit

from megatron_dppo.launch.arguments import is_embedded_default
from megatron_dppo.launch.colocated_sglang import dry_run_colocated_share, with_server_flags
from megatron_dppo.launch.memory_plan import dry_run_memory_plan
from megatron_dppo.weight_update_protocol import sync_rank_offsets

MEGATRON_ORDER = "tp-cp-ep-dp-pp"
DEFAULT_ROLLOUT_PORT = 30000
DEFAULT_RDZV_PORT = 29500


@dataclass(frozen=True)
class TrainerRank:
    rank: int
    node: str
    local_rank: int
    tp: int
    pp: int
    dp: int


# The servers' model in their command lines where the plan cannot know its path: --hf-checkpoint not given (the plan
# is printed anyway), or the embedded default's tiny model, written under --cache-dir when the run starts
MODEL_PLACEHOLDER, EMBEDDED_MODEL = "HF_CHECKPOINT", "EMBEDDED_MODEL"


@dataclass(frozen=True)
class RolloutNodeServers:
    """How examples/slurm/rollout_node.sh starts the servers of a rollout node (dppo.sbatch exports these as
    DPPO_SGLANG_PYTHON, DPPO_HF_CHECKPOINT, DPPO_SGLANG_ARGS, DPPO_ROLLOUT_ENGINE); an SGLang server's TP size is
    --rollout-server-gpus; engine "embedded": the embedded CPU engine (one per "GPU" of the node, TP 1)."""
    python: str = "python3"
    model: str = MODEL_PLACEHOLDER
    sglang_args: tuple[str, ...] = ()
    engine: str = "sglang"


@dataclass(frozen=True)
class RolloutServer:
    node: str
    gpus: tuple[int, ...]  # CUDA device indices on `node` (empty: the embedded CPU engine, vLLM's CPU build)
    port: int | None  # None: a free port picked when the server starts
    url: str
    tp: int
    sync_rank_offset: int  # first rank of this server's GPUs in the weight-sync group
    command: tuple[str, ...] = ()  # what rank 0 runs for it (servers it starts; empty otherwise)
    cuda_visible_devices: str | None = None  # that command's CUDA_VISIBLE_DEVICES (None: not set)

    @property
    def sync_ranks(self) -> int:
        return server_sync_ranks(self.gpus)


def server_sync_ranks(gpus: tuple[int, ...]) -> int:
    """A server joins the weight-sync group with one rank per GPU (the embedded CPU engine with one)."""
    return max(len(gpus), 1)


@dataclass(frozen=True)
class WeightSyncGroup:
    master_address: str  # trainer global rank 0's node
    backend: str
    world_size: int


@dataclass(frozen=True)
class LaunchPlan:
    nodes: tuple[str, ...]
    roles: dict[str, str]  # node -> "trainer" | "rollout" | "unused"
    gpus_per_node: int  # 0: a CPU machine
    processes_per_node: int  # trainer processes per trainer node (torchrun --nproc-per-node)
    tp: int
    pp: int
    dp: int
    rendezvous: str  # host:port of torchrun's c10d rendezvous
    ranks: tuple[TrainerRank, ...]
    rollout_backend: str
    servers: tuple[RolloutServer, ...]
    weight_sync: WeightSyncGroup

    @property
    def trainer_nodes(self) -> list[str]:
        return [node for node in self.nodes if self.roles[node] == "trainer"]

    @property
    def rollout_nodes(self) -> list[str]:
        return [node for node in self.nodes if self.roles[node] == "rollout"]

    @property
    def urls(self) -> list[str]:
        return [server.url for server in self.servers]


def expand_nodelist(nodelist: str) -> list[str]:
    """Slurm's compressed host list, e.g. "gpu[01-03,07],login1" → gpu01 gpu02 gpu03 gpu07 login1."""
    names = []
    for item in re.findall(r"[^,\[]+(?:\[[^\]]*\][^,\[]*)*", nodelist):
        match = re.fullmatch(r"([^\[]*)\[([^\]]+)\](.*)", item)
        if match is None:
            names.append(item)
            continue
        prefix, ranges, suffix = match.groups()
        if "[" in suffix:
            raise ValueError(f"node list {nodelist!r}: one bracket group per name is supported; "
                             "expand it with `scontrol show hostnames` and pass DPPO_NODES")
        for part in ranges.split(","):
            low, _, high = part.partition("-")
            if not low.isdigit() or (high and not high.isdigit()):
                raise ValueError(f"node list {nodelist!r}: {part!r} is not a number or a range like 01-04")
            for index in range(int(low), int(high or low) + 1):
                names.append(f"{prefix}{index:0{len(low)}d}{suffix}")
    return names


def megatron_coordinates(rank: int, tp: int, pp: int, dp: int) -> tuple[int, int, int]:
    """(tp, pp, dp) of a global rank in Megatron's "tp-cp-ep-dp-pp" order with cp = ep = 1."""
    return rank % tp, rank // (tp * dp), (rank // tp) % dp


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def weight_sync_backend(args, cpu: bool) -> str:
    """gloo for the embedded engine (its model lives in host memory, on any machine), for servers colocated with the
    trainer (NCCL refuses two ranks on one GPU) and on a CPU machine; else NCCL."""
    return "gloo" if cpu or args.rollout_backend == "embedded" or args.rollout_colocate else "nccl"


def _rollout_servers(args, nodes: list[str], rollout_nodes: list[str], gpus_per_node: int, processes_per_node: int,
                     rollout_port: int, node_servers: RolloutNodeServers) -> list[dict]:
    """The servers' fields (RolloutServer's, without the weight-sync offset)."""
    from megatron_dppo.rollout.launcher import embedded_engine_command, local_servers, sglang_command

    sglang_tp = args.rollout_server_gpus
    if rollout_nodes and node_servers.engine == "embedded":
        _check(sglang_tp == 1, f"--rollout-server-gpus {sglang_tp}: the embedded engine on rollout nodes "
               "(ROLLOUT_ENGINE=embedded) serves on the CPU without TP: SGLANG_TP=1")
        servers = [dict(node=node, gpus=(), port=rollout_port + i, url=f"http://{node}:{rollout_port + i}", tp=1,
                        command=(*embedded_engine_command(node_servers.model, "0.0.0.0", rollout_port + i,
                                                          node_servers.python, enable_deterministic_inference=True),
                                 *node_servers.sglang_args))
                   for node in rollout_nodes for i in range(gpus_per_node)]
    elif rollout_nodes:
        _check(gpus_per_node % sglang_tp == 0,
               f"--rollout-server-gpus {sglang_tp} (SGLang TP) does not divide the {gpus_per_node} GPUs of a rollout "
               "node: pick a TP size that divides GPUs per node")
        flags = ["--tp-size", str(sglang_tp), *node_servers.sglang_args]
        servers = [dict(node=node, gpus=tuple(range(i * sglang_tp, (i + 1) * sglang_tp)), port=rollout_port + i,
                        url=f"http://{node}:{rollout_port + i}", tp=sglang_tp,
                        command=tuple(sglang_command(node_servers.model, "0.0.0.0", rollout_port + i, flags,
                                                     node_servers.python)),
                        cuda_visible_devices=",".join(map(str, range(i * sglang_tp, (i + 1) * sglang_tp))))
                   for node in rollout_nodes for i in range(gpus_per_node // sglang_tp)]
    if rollout_nodes:
        given = [url.rstrip("/") for url in args.rollout_urls]
        _check(not given or given == [server["url"] for server in servers],
               f"--rollout-urls {' '.join(given)} differ from the servers started on the rollout nodes "
               f"({' '.join(server['url'] for server in servers)}): drop --rollout-urls (the Slurm script passes them)")
        return servers
    head = nodes[0]
    if args.rollout_backend == "embedded":
        return [dict(node=head, gpus=(), port=None, url="http://127.0.0.1:<free port>", tp=1)
                for _ in range(args.rollout_num_servers)]
    if args.rollout_backend in ("sglang", "vllm"):
        # the node as rank 0's servers see it: its GPUs, and torchrun's processes on GPUs 0 .. n-1
        node = {"LOCAL_WORLD_SIZE": str(processes_per_node),
                "CUDA_VISIBLE_DEVICES": ",".join(map(str, range(gpus_per_node)))}
        model = args.hf_checkpoint or (EMBEDDED_MODEL if is_embedded_default(args) else MODEL_PLACEHOLDER)
        tp = args.rollout_server_gpus if args.rollout_backend == "sglang" else 1  # a vLLM server: one device
        servers = []
        for handle in local_servers(args, model, cpu=not gpus_per_node, environ=node):
            devices = handle.env.get("CUDA_VISIBLE_DEVICES") if gpus_per_node else None
            port = int(handle.command[handle.command.index("--port") + 1])
            servers.append(dict(node=head, gpus=tuple(int(gpu) for gpu in (devices or "").split(",") if gpu),
                                port=port, url=handle.url, tp=tp, command=tuple(handle.command),
                                cuda_visible_devices=devices))
        return servers
    return [dict(node=urlsplit(url).hostname or url, gpus=tuple(range(sglang_tp)), port=urlsplit(url).port,
                 url=url.rstrip("/"), tp=sglang_tp) for url in args.rollout_urls]


def build_plan(args, nodes: list[str], trainer_nodes: int, rollout_nodes: int, gpus_per_node: int,
               rollout_port: int = DEFAULT_ROLLOUT_PORT, rdzv_port: int = DEFAULT_RDZV_PORT,
               processes_per_node: int | None = None, node_servers: RolloutNodeServers | None = None) -> LaunchPlan:
    """The plan for `nodes` (in Slurm's order): the first `trainer_nodes` train, the next `rollout_nodes` serve.
    gpus_per_node 0: a CPU machine; processes_per_node: trainer processes per node (default: one per GPU);
    node_servers: how the rollout nodes start their servers (default: the --hf-checkpoint model, no extra flags)."""
    node_servers = node_servers or RolloutNodeServers(model=args.hf_checkpoint or MODEL_PLACEHOLDER)
    processes_per_node = processes_per_node or gpus_per_node or 1
    _check(trainer_nodes >= 1, f"trainer nodes = {trainer_nodes}: at least one node must train")
    _check(rollout_nodes >= 0, f"rollout nodes = {rollout_nodes} must be >= 0")
    _check(processes_per_node >= 1, f"trainer processes per node = {processes_per_node} must be >= 1")
    _check(not gpus_per_node or processes_per_node <= gpus_per_node,
           f"{processes_per_node} trainer processes per node need as many GPUs, but a node has {gpus_per_node}: "
           "launch fewer (torchrun --nproc-per-node) or set DPPO_GPUS_PER_NODE to the node's GPU count")
    _check(len(set(nodes)) == len(nodes), f"node list {nodes} names a node twice")
    _check(trainer_nodes + rollout_nodes <= len(nodes),
           f"{trainer_nodes} trainer + {rollout_nodes} rollout nodes need {trainer_nodes + rollout_nodes} nodes "
           f"but the allocation has {len(nodes)} ({','.join(nodes)}): ask sbatch for more nodes or lower the counts")
    _check(not rollout_nodes or args.rollout_backend == "external",
           f"{rollout_nodes} rollout nodes serve SGLang but --rollout-backend is {args.rollout_backend}: use "
           "--rollout-backend external --rollout-urls ... (examples/slurm/dppo.sbatch passes both)")
    _check(not rollout_nodes or gpus_per_node >= 1,
           "rollout nodes serve SGLang on GPUs, but no GPU count is known: set DPPO_GPUS_PER_NODE")
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    world = trainer_nodes * processes_per_node
    _check(world % (tp * pp) == 0,
           f"--tensor-model-parallel-size {tp} x --pipeline-model-parallel-size {pp} = {tp * pp} does not divide "
           f"the {world} trainer processes ({trainer_nodes} nodes x {processes_per_node}): change the sizes or the "
           "process count")
    dp = world // (tp * pp)
    roles = {node: "unused" for node in nodes}
    roles.update({node: "trainer" for node in nodes[:trainer_nodes]})
    serving = nodes[trainer_nodes:trainer_nodes + rollout_nodes]
    roles.update({node: "rollout" for node in serving})
    ranks = []
    for rank in range(world):
        rank_tp, rank_pp, rank_dp = megatron_coordinates(rank, tp, pp, dp)
        ranks.append(TrainerRank(rank, nodes[rank // processes_per_node], rank % processes_per_node, rank_tp, rank_pp,
                                 rank_dp))
    specs = _rollout_servers(args, nodes, serving, gpus_per_node, processes_per_node, rollout_port, node_servers)
    offsets, sync_world = sync_rank_offsets([server_sync_ranks(spec["gpus"]) for spec in specs])
    servers = [RolloutServer(**spec, sync_rank_offset=offset) for spec, offset in zip(specs, offsets)]
    return LaunchPlan(nodes=tuple(nodes), roles=roles, gpus_per_node=gpus_per_node,
                      processes_per_node=processes_per_node, tp=tp, pp=pp, dp=dp,
                      rendezvous=f"{nodes[0]}:{rdzv_port}", ranks=tuple(ranks),
                      rollout_backend="external" if serving else args.rollout_backend, servers=tuple(servers),
                      weight_sync=WeightSyncGroup(nodes[0], weight_sync_backend(
                          args, cpu=not gpus_per_node or bool(serving) and node_servers.engine == "embedded"),
                          sync_world))


def _env_int(env, name: str, default: int | None) -> int | None:
    value = env.get(name)
    if value in (None, ""):
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} must be an integer") from None


def plan_from_environment(args, env=None) -> LaunchPlan:
    """build_plan with its inputs read from the Slurm script's DPPO_* variables, then Slurm's and torchrun's."""
    env = os.environ if env is None else env
    if env.get("DPPO_NODES"):
        nodes = [node for node in env["DPPO_NODES"].replace(" ", ",").split(",") if node]
    elif env.get("SLURM_JOB_NODELIST"):
        nodes = expand_nodelist(env["SLURM_JOB_NODELIST"])
    else:
        nodes = ["localhost"]
    rollout_nodes = _env_int(env, "DPPO_ROLLOUT_NODES", 0)
    trainer_nodes = _env_int(env, "DPPO_TRAINER_NODES", len(nodes) - rollout_nodes)
    world = _env_int(env, "WORLD_SIZE", None)
    processes = _env_int(env, "LOCAL_WORLD_SIZE", world // max(trainer_nodes, 1) if world else None)
    gpus_per_node = _env_int(env, "DPPO_GPUS_PER_NODE", _env_int(env, "SLURM_GPUS_ON_NODE", None))
    if gpus_per_node is None:  # no GPU count given: this node's (rank 0's, which starts local servers)
        from megatron_dppo.rollout.launcher import visible_gpus

        gpus_per_node = len(visible_gpus(env))
    node_servers = RolloutNodeServers(env.get("DPPO_SGLANG_PYTHON") or "python3",
                                      env.get("DPPO_HF_CHECKPOINT") or args.hf_checkpoint or MODEL_PLACEHOLDER,
                                      tuple(shlex.split(env.get("DPPO_SGLANG_ARGS", ""))),
                                      env.get("DPPO_ROLLOUT_ENGINE") or "sglang")
    return build_plan(args, nodes, trainer_nodes, rollout_nodes, gpus_per_node,
                      rollout_port=_env_int(env, "DPPO_ROLLOUT_PORT", DEFAULT_ROLLOUT_PORT),
                      rdzv_port=_env_int(env, "DPPO_RDZV_PORT", DEFAULT_RDZV_PORT), processes_per_node=processes,
                      node_servers=node_servers)


def _table(header: list[str], rows: list[list]) -> list[str]:
    cells = [header, *[[str(value) for value in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    return ["  " + "  ".join(value.ljust(width) for value, width in zip(row, widths, strict=True)).rstrip()
            for row in cells]


def _span(values) -> str:
    """0,1,2,3 → "0-3"; other sets listed."""
    values = list(values)
    if values and values == list(range(values[0], values[-1] + 1)) and len(values) > 2:
        return f"{values[0]}-{values[-1]}"
    return ",".join(map(str, values))


def format_plan(plan: LaunchPlan) -> str:
    trainers, rollouts = plan.trainer_nodes, plan.rollout_nodes
    gpus = f"{plan.gpus_per_node} GPUs per node" if plan.gpus_per_node else "no GPU (CPU)"
    lines = [f"launch plan (dry run: nothing started): {len(plan.nodes)} nodes, {len(trainers)} trainer, "
             f"{len(rollouts)} rollout, {gpus}", "", "node roles:"]
    lines += _table(["node", "role"], [[node, plan.roles[node]] for node in plan.nodes])
    lines += ["", f"trainer: srun torchrun --nnodes {len(trainers)} --nproc-per-node {plan.processes_per_node} "
              f"--rdzv-backend c10d --rdzv-endpoint {plan.rendezvous}"]
    if plan.gpus_per_node:
        lines.append(f"trainer GPUs: {_span(range(plan.processes_per_node))} of each trainer node "
                     "(rank r binds cuda:LOCAL_RANK)")
    lines += [f"parallel layout: world {len(plan.ranks)} = TP {plan.tp} x PP {plan.pp} x DP {plan.dp} "
              f"(Megatron order {MEGATRON_ORDER}: tp fastest, then dp, then pp)"]
    lines += _table(["rank", "node", "local_rank", "tp", "pp", "dp"],
                    [[r.rank, r.node, r.local_rank, r.tp, r.pp, r.dp] for r in plan.ranks])
    lines += ["", f"rollout servers ({plan.rollout_backend}): {len(plan.servers)}"]
    lines += _table(["server", "node", "gpus", "port", "tp", "url", "sync_ranks"],
                    [[i, s.node, ",".join(map(str, s.gpus)) or "cpu", s.port or "free", s.tp, s.url,
                      f"{s.sync_rank_offset}-{s.sync_rank_offset + s.sync_ranks - 1}"]
                     for i, s in enumerate(plan.servers)])
    started = [(i, s) for i, s in enumerate(plan.servers) if s.command]
    if started:
        lines += ["", "commands examples/slurm/rollout_node.sh runs on each rollout node:" if plan.rollout_nodes else
                  "commands rank 0 runs (ports are picked free at start; shown: ports free now):"]
        for i, server in started:
            devices = "not set (no GPU)" if server.cuda_visible_devices is None else server.cuda_visible_devices
            lines += [f"  server {i}: CUDA_VISIBLE_DEVICES={devices} on {server.node}",
                      f"    {shlex.join(server.command)}"]
        if any(MODEL_PLACEHOLDER in server.command for _, server in started):
            lines.append(f"  ({MODEL_PLACEHOLDER}: the --hf-checkpoint a run needs; not given here)")
        if any(EMBEDDED_MODEL in server.command for _, server in started):
            lines.append(f"  ({EMBEDDED_MODEL}: the embedded default's tiny model, written under --cache-dir at start)")
    sync = plan.weight_sync
    lines += ["", f"weight-sync group: backend {sync.backend}, world {sync.world_size} = 1 trainer rank + "
              f"{sync.world_size - 1} server ranks; group rank 0 = trainer global rank 0 on {sync.master_address} "
              "(hosts the group's TCPStore)"]
    return "\n".join(lines)


def print_plan(args, env=None) -> None:
    """--dry-run: print the plan and each trainer GPU's memory plan (launch/memory_plan.py) with a colocated server's
    share (launch/colocated_sglang.py); if it cannot be laid out, or the trainer's GPUs cannot hold it, end with one
    line saying why and exit with status 2."""
    from megatron_dppo.rollout.client import RolloutServerError

    try:
        plan = plan_from_environment(args, env)
        memory, error = dry_run_memory_plan(args, plan.dp, on_gpus=plan.gpus_per_node > 0)
        if not error:
            share, error, server_flags = dry_run_colocated_share(args, plan.dp, on_gpus=plan.gpus_per_node > 0)
            memory += share
            if server_flags is not None:  # the servers' commands as they start: with the fraction passed
                plan = plan_from_environment(with_server_flags(args, server_flags), env)
        text = format_plan(plan)
    except (ValueError, RolloutServerError) as error:
        print(f"pretrain_dppo.py --dry-run: error: {error}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    print("\n".join([text, "", *memory]), flush=True)
    if error:
        print(f"pretrain_dppo.py --dry-run: error: {error}", file=sys.stderr, flush=True)
        raise SystemExit(2)
