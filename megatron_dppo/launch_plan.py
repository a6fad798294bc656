"""The resolved launch plan of a run, printed by `examples/pretrain_dppo.py --dry-run` (nothing is started).

    parsed args + node list + nodes per role + GPUs per node + SGLang TP
        ──► build_plan ──► LaunchPlan: node roles, trainer ranks with their (tp, pp, dp) coordinates,
                           the torchrun rendezvous, rollout servers with URLs, the weight-sync group
        ──► format_plan ──► text

`plan_from_environment` reads the inputs from what examples/slurm/dppo.sbatch exports (DPPO_NODES,
DPPO_TRAINER_NODES, DPPO_ROLLOUT_NODES, DPPO_GPUS_PER_NODE, DPPO_SGLANG_TP, DPPO_ROLLOUT_PORT, DPPO_RDZV_PORT),
falling back to Slurm's own variables (SLURM_JOB_NODELIST, SLURM_GPUS_ON_NODE).

Invariants:
- trainer ranks follow Megatron's default order "tp-cp-ep-dp-pp" (cp = ep = 1 here): tp varies fastest, then dp,
  then pp; global rank = node index x GPUs per node + local rank (torchrun's order);
- the first `trainer_nodes` nodes train, the next `rollout_nodes` serve; trainer rank 0 sits on the first node and
  hosts both the torchrun rendezvous and the weight-sync group;
- weight-sync group: trainer rank 0 is group rank 0, server i joins at 1 + (GPUs of servers before it),
  world size = 1 + all server GPUs (megatron_dppo.rollout.weight_sync.WeightSyncer.init_group).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from urllib.parse import urlsplit

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


@dataclass(frozen=True)
class RolloutServer:
    node: str
    gpus: tuple[int, ...]  # CUDA device indices on `node` (empty: the embedded CPU engine)
    port: int | None  # None: a free port picked when the server starts
    url: str
    tp: int
    sync_rank_offset: int  # first rank of this server's GPUs in the weight-sync group

    @property
    def sync_ranks(self) -> int:
        return server_sync_ranks(self.gpus)


def server_sync_ranks(gpus: tuple[int, ...]) -> int:
    """A server joins the weight-sync group with one rank per GPU (the embedded CPU engine with one)."""
    return max(len(gpus), 1)


def sync_rank_offsets(engine_ranks: list[int]) -> tuple[list[int], int]:
    """(first rank of each server, world size) of the weight-sync group: the trainer is rank 0, then each server's
    ranks in order. WeightSyncer.init_group forms the group this way; the plan prints it."""
    offsets = [1 + sum(engine_ranks[:i]) for i in range(len(engine_ranks))]
    return offsets, 1 + sum(engine_ranks)


@dataclass(frozen=True)
class WeightSyncGroup:
    master_address: str  # trainer global rank 0's node
    backend: str
    world_size: int


@dataclass(frozen=True)
class LaunchPlan:
    nodes: tuple[str, ...]
    roles: dict[str, str]  # node -> "trainer" | "rollout" | "unused"
    gpus_per_node: int
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


def _rollout_servers(args, nodes: list[str], rollout_nodes: list[str], gpus_per_node: int, sglang_tp: int,
                     rollout_port: int) -> list[tuple[str, tuple[int, ...], int | None, str, int]]:
    """(node, gpus, port, url, tp) per server, before weight-sync offsets are assigned."""
    if rollout_nodes:
        _check(gpus_per_node % sglang_tp == 0,
               f"SGLang TP {sglang_tp} does not divide the {gpus_per_node} GPUs of a rollout node: "
               "pick a TP size that divides GPUs per node")
        servers = [(node, tuple(range(i * sglang_tp, (i + 1) * sglang_tp)), rollout_port + i,
                    f"http://{node}:{rollout_port + i}", sglang_tp)
                   for node in rollout_nodes for i in range(gpus_per_node // sglang_tp)]
        given = [url.rstrip("/") for url in args.rollout_urls]
        _check(not given or given == [server[3] for server in servers],
               f"--rollout-urls {' '.join(given)} differ from the servers started on the rollout nodes "
               f"({' '.join(server[3] for server in servers)}): drop --rollout-urls (the Slurm script passes them)")
        return servers
    head = nodes[0]
    if args.rollout_backend == "embedded":
        return [(head, (), None, "http://127.0.0.1:<free port>", 1) for _ in range(args.rollout_num_servers)]
    if args.rollout_backend == "sglang":
        return [(head, tuple(range(i * sglang_tp, (i + 1) * sglang_tp)), None, "http://127.0.0.1:<free port>",
                 sglang_tp) for i in range(args.rollout_num_servers)]
    if args.rollout_backend == "vllm":  # the launcher starts each vLLM server on one device
        return [(head, (i,), None, "http://127.0.0.1:<free port>", 1) for i in range(args.rollout_num_servers)]
    return [(urlsplit(url).hostname or url, tuple(range(sglang_tp)), urlsplit(url).port, url.rstrip("/"), sglang_tp)
            for url in args.rollout_urls]


def build_plan(args, nodes: list[str], trainer_nodes: int, rollout_nodes: int, gpus_per_node: int,
               sglang_tp: int = 1, rollout_port: int = DEFAULT_ROLLOUT_PORT,
               rdzv_port: int = DEFAULT_RDZV_PORT) -> LaunchPlan:
    """The plan for `nodes` (in Slurm's order): the first `trainer_nodes` train, the next `rollout_nodes` serve."""
    _check(trainer_nodes >= 1, f"trainer nodes = {trainer_nodes}: at least one node must train")
    _check(rollout_nodes >= 0, f"rollout nodes = {rollout_nodes} must be >= 0")
    _check(gpus_per_node >= 1, f"GPUs per node = {gpus_per_node} must be >= 1")
    _check(sglang_tp >= 1, f"SGLang TP = {sglang_tp} must be >= 1")
    _check(len(set(nodes)) == len(nodes), f"node list {nodes} names a node twice")
    _check(trainer_nodes + rollout_nodes <= len(nodes),
           f"{trainer_nodes} trainer + {rollout_nodes} rollout nodes need {trainer_nodes + rollout_nodes} nodes "
           f"but the allocation has {len(nodes)} ({','.join(nodes)}): ask sbatch for more nodes or lower the counts")
    _check(not rollout_nodes or args.rollout_backend == "external",
           f"{rollout_nodes} rollout nodes serve SGLang but --rollout-backend is {args.rollout_backend}: use "
           "--rollout-backend external --rollout-urls ... (examples/slurm/dppo.sbatch passes both)")
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    world = trainer_nodes * gpus_per_node
    _check(world % (tp * pp) == 0,
           f"--tensor-model-parallel-size {tp} x --pipeline-model-parallel-size {pp} = {tp * pp} does not divide "
           f"the {world} trainer GPUs ({trainer_nodes} nodes x {gpus_per_node}): change the sizes or the node count")
    dp = world // (tp * pp)
    roles = {node: "unused" for node in nodes}
    roles.update({node: "trainer" for node in nodes[:trainer_nodes]})
    serving = nodes[trainer_nodes:trainer_nodes + rollout_nodes]
    roles.update({node: "rollout" for node in serving})
    ranks = []
    for rank in range(world):
        rank_tp, rank_pp, rank_dp = megatron_coordinates(rank, tp, pp, dp)
        ranks.append(TrainerRank(rank, nodes[rank // gpus_per_node], rank % gpus_per_node, rank_tp, rank_pp, rank_dp))
    specs = _rollout_servers(args, nodes, serving, gpus_per_node, sglang_tp, rollout_port)
    offsets, sync_world = sync_rank_offsets([server_sync_ranks(gpus) for _, gpus, _, _, _ in specs])
    servers = [RolloutServer(node, gpus, port, url, server_tp, offset)
               for (node, gpus, port, url, server_tp), offset in zip(specs, offsets)]
    backend = "gloo" if args.rollout_backend == "embedded" and not serving else "nccl"
    return LaunchPlan(nodes=tuple(nodes), roles=roles, gpus_per_node=gpus_per_node, tp=tp, pp=pp, dp=dp,
                      rendezvous=f"{nodes[0]}:{rdzv_port}", ranks=tuple(ranks),
                      rollout_backend="external" if serving else args.rollout_backend, servers=tuple(servers),
                      weight_sync=WeightSyncGroup(nodes[0], backend, sync_world))


def _env_int(env, name: str, default: int | None) -> int | None:
    value = env.get(name)
    if value in (None, ""):
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} must be an integer") from None


def plan_from_environment(args, env=None) -> LaunchPlan:
    """build_plan with its inputs read from the Slurm script's DPPO_* variables, then Slurm's own."""
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
    gpus_per_node = _env_int(env, "DPPO_GPUS_PER_NODE", _env_int(env, "SLURM_GPUS_ON_NODE", None))
    if gpus_per_node is None:
        gpus_per_node = world // max(trainer_nodes, 1) if world else 1
    return build_plan(args, nodes, trainer_nodes, rollout_nodes, gpus_per_node,
                      sglang_tp=_env_int(env, "DPPO_SGLANG_TP", 1),
                      rollout_port=_env_int(env, "DPPO_ROLLOUT_PORT", DEFAULT_ROLLOUT_PORT),
                      rdzv_port=_env_int(env, "DPPO_RDZV_PORT", DEFAULT_RDZV_PORT))


def _table(header: list[str], rows: list[list]) -> list[str]:
    cells = [header, *[[str(value) for value in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    return ["  " + "  ".join(value.ljust(width) for value, width in zip(row, widths, strict=True)).rstrip()
            for row in cells]


def format_plan(plan: LaunchPlan) -> str:
    trainers, rollouts = plan.trainer_nodes, plan.rollout_nodes
    lines = [f"launch plan (dry run: nothing started): {len(plan.nodes)} nodes, {len(trainers)} trainer, "
             f"{len(rollouts)} rollout, {plan.gpus_per_node} GPUs per node", "", "node roles:"]
    lines += _table(["node", "role"], [[node, plan.roles[node]] for node in plan.nodes])
    lines += ["", f"trainer: srun torchrun --nnodes {len(trainers)} --nproc-per-node {plan.gpus_per_node} "
              f"--rdzv-backend c10d --rdzv-endpoint {plan.rendezvous}",
              f"parallel layout: world {len(plan.ranks)} = TP {plan.tp} x PP {plan.pp} x DP {plan.dp} "
              f"(Megatron order {MEGATRON_ORDER}: tp fastest, then dp, then pp)"]
    lines += _table(["rank", "node", "local_rank", "tp", "pp", "dp"],
                    [[r.rank, r.node, r.local_rank, r.tp, r.pp, r.dp] for r in plan.ranks])
    lines += ["", f"rollout servers ({plan.rollout_backend}): {len(plan.servers)}"]
    lines += _table(["server", "node", "gpus", "port", "tp", "url", "sync_ranks"],
                    [[i, s.node, ",".join(map(str, s.gpus)) or "cpu", s.port or "free", s.tp, s.url,
                      f"{s.sync_rank_offset}-{s.sync_rank_offset + s.sync_ranks - 1}"]
                     for i, s in enumerate(plan.servers)])
    sync = plan.weight_sync
    lines += ["", f"weight-sync group: backend {sync.backend}, world {sync.world_size} = 1 trainer rank + "
              f"{sync.world_size - 1} server ranks; group rank 0 = trainer global rank 0 on {sync.master_address} "
              "(hosts the group's TCPStore)"]
    return "\n".join(lines)
