"""Flags of a run across hosts (arguments.py adds them to the trainer's parser): the watchdog's bounds and port, and
the weight-sync group's port (docs/multinode.md, "No hang" and "Ports").

    argv ─► add_flags (parse; ports through network.PortRange) ─► errors (one line per bad combination)
         ─► watchdog_config: the platform/watchdog.py configuration, with each phase's deadline

How the bounds relate: --heartbeat-timeout-s bounds silence (a rank or rollout server that says nothing: a
partitioned host, a frozen process), whatever phase the run is in; --distributed-timeout-minutes, Megatron-LM's,
bounds one collective among ranks that are alive (a rank waiting for rank 0's rollouts, or stuck in another
collective), and also a checkpoint save, whose file writes have no timeout of their own. A silent peer is therefore
noticed within minutes while a long rollout phase is still allowed its hours.

Like arguments.py, it imports no torch.
"""

import argparse

from megatron_dppo.flags import NON_NEGATIVE, POSITIVE
from megatron_dppo.platform.network import ANY_PORT, PortRange
from megatron_dppo.platform.watchdog import EXIT_STATUS, WatchdogConfig

HEARTBEAT_INTERVAL_S = 10.0
HEARTBEAT_TIMEOUT_S = 120.0
MIN_BEATS_PER_TIMEOUT = 3  # a bound of fewer beats would end runs over one late beat


def port_range(text: str) -> PortRange:
    """argparse type of the port flags: PORT, FIRST-LAST, or 0 (any free port)."""
    try:
        return PortRange.parse(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def add_flags(parser: argparse.ArgumentParser) -> None:
    cluster = parser.add_argument_group("across hosts: the watchdog and the ports (docs/multinode.md)")
    cluster.add_argument("--heartbeat-timeout-s", type=NON_NEGATIVE, default=HEARTBEAT_TIMEOUT_S,
                         help="a rank or rollout server unheard this long (a partitioned host, a frozen process) ends "
                              f"the run with one line naming its host and the phase, exit status {EXIT_STATUS}; "
                              "resume from the last checkpoint. 0: no watchdog")
    cluster.add_argument("--heartbeat-interval-s", type=POSITIVE, default=HEARTBEAT_INTERVAL_S,
                         help="how often every rank tells rank 0 its phase and rank 0 probes the rollout servers "
                              f"(GET /health); at most 1/{MIN_BEATS_PER_TIMEOUT} of --heartbeat-timeout-s")
    cluster.add_argument("--heartbeat-port", type=port_range, default=ANY_PORT, metavar="PORT[-LAST]",
                         help="the port (or the first free one of a range) rank 0 takes for the heartbeats, on every "
                              "interface; the other ranks dial it at MASTER_ADDR. 0: any free one")
    cluster.add_argument("--weight-sync-port", type=port_range, default=ANY_PORT, metavar="PORT[-LAST]",
                         help="the port (or the first free one of a range) of the weight-sync group's store on "
                              "trainer rank 0, which every rollout server dials (open it on a firewalled cluster). "
                              "0: any free one at each group formation")


def errors(args: argparse.Namespace) -> list[str]:
    problems = []
    if args.heartbeat_timeout_s and args.heartbeat_timeout_s < MIN_BEATS_PER_TIMEOUT * args.heartbeat_interval_s:
        problems.append(f"--heartbeat-timeout-s {args.heartbeat_timeout_s:g} is shorter than {MIN_BEATS_PER_TIMEOUT} "
                        f"beats of --heartbeat-interval-s {args.heartbeat_interval_s:g}: one late beat would end the "
                        "run; raise the timeout or lower the interval")
    return problems


def watchdog_config(args: argparse.Namespace) -> WatchdogConfig:
    """The watchdog of a run: its bounds and port, and the phases with deadlines of their own (see the module
    docstring): a checkpoint save gets --distributed-timeout-minutes."""
    return WatchdogConfig(args.heartbeat_interval_s, args.heartbeat_timeout_s, args.heartbeat_port.first,
                          args.heartbeat_port.last, {"save": args.distributed_timeout_minutes * 60})
