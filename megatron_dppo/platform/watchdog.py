"""The run's watchdog: a rank or a rollout server gone silent (a partitioned host, a frozen process) ends the run
within a bound, with one line naming the host and the phase, instead of leaving the others in a collective for
--distributed-timeout-minutes.

    every rank: `with phase("update"):` around each phase (pipeline/trainer.py) ─► its current phase (main thread)
    rank 0: Hub, one thread, a TCP listener on --heartbeat-port (its port told to the other ranks once, at start)
        ◄─ each other rank's connection: hello, its phase at every change and every interval, bye at the end
        ─► to each rank: a beat every interval and at each of rank 0's phase changes;  to watchers: every change
        ◄─ ServerProbe threads: each rollout server's answer to GET /health, every interval
        ─► every interval: a rank or server unheard for --heartbeat-timeout-s, a rank whose connection closed
           without a bye, or a phase past its deadline ─► end(line): the line to every rank, printed, exit 75
    rank r > 0: Beat, one thread connected to the hub: its phase out, the hub's beats in; the hub unheard past the
        bound (rank 0's host partitioned or frozen) or its connection closed without a bye ─► end(line) here
    python -m megatron_dppo.platform.watchdog watch HOST:PORT ─► one line per phase change of any rank

Invariants:
- a silent peer ends every rank that can still act within --heartbeat-timeout-s + --heartbeat-interval-s: the side
  that hears nothing ends itself, and the hub tells the ranks it can still reach;
- ending is os._exit after one flushed line on stderr: a thread blocked in a collective, a socket or a file write
  cannot hold the process (the trainer's own servers die with it through their tethers);
- only silence counts against a server: one that answers with an error or refuses the connection (restarting) is the
  rollout client's to handle (retries, restarts, its own error);
- the deadlines bound phases whose waits have no timeout of their own (a checkpoint save on a stuck file system);
- a finished side's bye is never lost: a socket closed with bytes unread sends a reset, which can discard the bye
  still unread at the other end (a false "closed without finishing" that fails a finished run), so the side that
  finishes sends its bye, stops writing and reads until the other side closes too (Connection.close_after_peer);
- standard library only (no torch): the processes it watches may be stuck inside torch.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import select
import selectors
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field

from megatron_dppo.errors import UserInputError

EXIT_STATUS = 75  # EX_TEMPFAIL: the run goes on from its last checkpoint
OUTSIDE = "outside"  # the main thread is in none of the trainer's phases (setup, metrics, between steps)
MAX_LINE = 4096  # a message is one JSON line; longer ones are refused (a stray client)
CLOSE_WAIT_S = 3.0  # how long a finished side waits for the other to close after its bye (Connection.close_after_peer)


def this_host() -> str:
    return socket.gethostname()


def this_rank() -> int:
    return int(os.environ.get("RANK", "0"))


# ------------------------------------------------------------------------------------------------ phases
class PhaseClock:
    """The phases the main thread is in (they nest: the innermost is reported), since when, and who hears of each
    change. Phases entered on other threads are not recorded: the main thread's is the rank's."""

    def __init__(self):
        self.stack: list[tuple[str, float]] = []
        self.listeners: list[Callable[[str], None]] = []  # each told the phase entered (or returned to)

    def current(self) -> tuple[str, float]:
        """(phase, seconds in it); OUTSIDE before the first and between phases."""
        stack = list(self.stack)
        return (stack[-1][0], time.monotonic() - stack[-1][1]) if stack else (OUTSIDE, 0.0)

    def enter(self, name: str) -> bool:
        if threading.current_thread() is not threading.main_thread():
            return False
        self.stack.append((name, time.monotonic()))
        self._tell()
        return True

    def leave(self) -> None:
        self.stack.pop()
        self._tell()

    def _tell(self) -> None:
        name = self.current()[0]
        for listener in list(self.listeners):
            listener(name)


CLOCK = PhaseClock()


class phase(contextlib.ContextDecorator):
    """`with phase("sync"):` or `@phase("sync")`: this rank is in that phase meanwhile. An exception leaving the
    innermost phase is said in one line naming the rank, the host and the phase (then propagates); not a
    UserInputError, which every rank finds alike and the entry point says once."""

    def __init__(self, name: str):
        self.name = name
        self.entered: list[bool] = []  # per nesting level: whether the clock took it (main thread only)

    def __enter__(self):
        self.entered.append(CLOCK.enter(self.name))
        return self

    def __exit__(self, kind, error, traceback):
        if self.entered.pop():
            seconds = CLOCK.current()[1]
            CLOCK.leave()
            if (isinstance(error, Exception) and not isinstance(error, UserInputError)  # said once, by the entry
                    and not getattr(error, "phase_said", False)):
                first_line = (str(error).splitlines() or [""])[0][:1000]
                print(f"\nmegatron_dppo: rank {this_rank()} on {this_host()} failed in phase {self.name} after "
                      f"{seconds:.0f} s: {type(error).__name__}: {first_line}", file=sys.stderr, flush=True)
                with contextlib.suppress(AttributeError):
                    error.phase_said = True
        return False


# ------------------------------------------------------------------------------------------------ configuration
@dataclass(frozen=True)
class WatchdogConfig:
    interval_s: float  # a beat (and a server probe) every this many seconds
    timeout_s: float  # a rank or server unheard this long ends the run; 0: no watchdog
    port_first: int = 0  # the hub's port range (0: any free one)
    port_last: int = 0
    deadlines: dict[str, float] = field(default_factory=dict)  # phase -> seconds it may last

    @property
    def enabled(self) -> bool:
        return self.timeout_s > 0


def end_run(line: str) -> None:
    """Say `line` and end this process now (see the module docstring)."""
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    print(f"\n{line}", file=sys.stderr, flush=True)  # a line of its own, also after a progress bar's "\r"
    os._exit(EXIT_STATUS)


def phase_text() -> str:
    name, seconds = CLOCK.current()
    return f"{name} (for {seconds:.0f} s)"


def deadline_passed(config: WatchdogConfig) -> str | None:
    """The line ending the run when this rank's phase has outlasted its deadline, else None."""
    name, seconds = CLOCK.current()
    limit = config.deadlines.get(name)
    if limit is None or seconds <= limit:
        return None
    return (f"watchdog: rank {this_rank()} on {this_host()} has been in phase {name} for {seconds:.0f} s, past its "
            f"bound of {limit:.0f} s; ending the run (exit {EXIT_STATUS}): resume from the last checkpoint")


class Connection:
    """One socket of the hub, non-blocking: lines in, queued bytes out."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.inbox = b""
        self.outbox = b""
        self.rank: int | None = None
        self.watcher = False

    def send(self, message: dict) -> None:
        self.outbox += json.dumps(message).encode() + b"\n"
        self.flush()

    def flush(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            while self.outbox:
                sent = self.sock.send(self.outbox)
                self.outbox = self.outbox[sent:]

    def messages(self) -> list[dict] | None:
        """The complete messages received; None once the peer closed (or sent garbage)."""
        try:
            data = self.sock.recv(65536)
        except BlockingIOError:
            return []
        except OSError:
            return None
        if not data:
            return None
        self.inbox += data
        *lines, self.inbox = self.inbox.split(b"\n")
        if len(self.inbox) > MAX_LINE:
            return None
        try:
            return [json.loads(line) for line in lines if line.strip()]
        except ValueError:
            return None

    def close_after_peer(self, deadline: float) -> None:
        """Close so that what this side sent last (its bye) reaches the peer: stop writing, then read (and drop)
        until the peer closes its side or `deadline` (time.monotonic()) passes. Closing at once with the peer's
        bytes unread would send a reset, and a reset can discard the bye before the peer reads it."""
        self.flush()
        with contextlib.suppress(OSError, ValueError):
            self.sock.shutdown(socket.SHUT_WR)
            while (left := deadline - time.monotonic()) > 0 and select.select([self.sock], [], [], left)[0]:
                with contextlib.suppress(BlockingIOError):
                    if not self.sock.recv(65536):
                        break
        self.sock.close()


@dataclass
class RankState:
    host: str = "?"
    phase: str = OUTSIDE
    phase_s: float = 0.0
    heard: float = 0.0
    done: bool = False


def listen(config: WatchdogConfig) -> socket.socket:
    """The hub's listener on every interface (IPv6 and IPv4 where the host has both), on the first free port of the
    configured range."""
    ports = [0] if config.port_first == 0 else range(config.port_first, config.port_last + 1)
    dual = socket.has_dualstack_ipv6()
    for port in ports:
        try:
            if dual:
                return socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True)
            return socket.create_server(("", port))
        except OSError:
            continue
    from megatron_dppo.platform.network import NetworkChoiceError

    raise NetworkChoiceError(f"every port of --heartbeat-port {config.port_first}-{config.port_last} is taken on "
                             f"{this_host()}: widen the range or free one")


class ServerProbe:
    """GET url/health every interval in a thread of its own; `answered` is when the server last answered anything
    (an error status, or a refused connection from a host that is there, counts: only silence does not)."""

    def __init__(self, url: str, config: WatchdogConfig, stop: threading.Event):
        self.url, self.config, self.stop = url.rstrip("/"), config, stop
        self.answered = time.monotonic()
        self.thread = threading.Thread(target=self._run, name=f"watchdog-probe {url}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            started = time.monotonic()
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=self.config.timeout_s):
                    pass
                self.answered = time.monotonic()
            except urllib.error.HTTPError:
                self.answered = time.monotonic()
            except (urllib.error.URLError, OSError) as error:
                reason = getattr(error, "reason", error)
                if isinstance(reason, (ConnectionRefusedError, ConnectionResetError)):
                    self.answered = time.monotonic()
            self.stop.wait(max(0.0, self.config.interval_s - (time.monotonic() - started)))


class Hub:
    """Rank 0's side (see the module docstring); runs in a daemon thread from construction."""

    def __init__(self, config: WatchdogConfig, world_size: int, listener: socket.socket):
        self.config, self.world_size, self.listener = config, world_size, listener
        self.started = time.monotonic()
        self.ranks: dict[int, RankState] = {}
        self.connections: list[Connection] = []
        self.probes: list[ServerProbe] = []
        self.stopping = threading.Event()
        self.own_phases: collections.deque[str] = collections.deque()  # rank 0's changes, each told to the watchers
        self.wake_read, self.wake_write = socket.socketpair()
        self.selector = selectors.DefaultSelector()
        listener.setblocking(False)
        self.selector.register(listener, selectors.EVENT_READ)
        self.selector.register(self.wake_read, selectors.EVENT_READ)
        CLOCK.listeners.append(self._own_phase)
        self.thread = threading.Thread(target=self._run, name="watchdog-hub", daemon=True)
        self.thread.start()

    def watch_servers(self, urls: list[str]) -> None:
        self.probes.extend(ServerProbe(url, self.config, self.stopping) for url in urls)

    def _own_phase(self, name: str) -> None:
        self.own_phases.append(name)
        with contextlib.suppress(OSError):
            self.wake_write.send(b"!")

    def _run(self) -> None:
        next_beat = time.monotonic()
        while not self.stopping.is_set():
            for key, _ in self.selector.select(timeout=min(0.2, max(0.0, next_beat - time.monotonic()))):
                if key.fileobj is self.listener:
                    self._accept()
                elif key.fileobj is self.wake_read:
                    with contextlib.suppress(OSError):
                        self.wake_read.recv(4096)
                else:
                    self._read(key.data)
            while self.own_phases:  # every change at once: the line a rank says names rank 0's phase as it was
                name = self.own_phases.popleft()
                self._tell_watchers(0, this_host(), name)
                for connection in self.connections:
                    if connection.rank is not None:
                        connection.send({"beat": name})
            if time.monotonic() >= next_beat:
                next_beat = time.monotonic() + self.config.interval_s
                for connection in self.connections:
                    if connection.rank is not None:
                        connection.send({"beat": CLOCK.current()[0]})
                self._check()

    def _accept(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            sock, _ = self.listener.accept()
            sock.setblocking(False)
            connection = Connection(sock)
            self.connections.append(connection)
            self.selector.register(sock, selectors.EVENT_READ, connection)

    def _drop(self, connection: Connection, deadline: float | None = None) -> None:
        """Forget a connection and close it: at once, or (`deadline`) after the peer closes (close_after_peer)."""
        with contextlib.suppress(Exception):
            self.selector.unregister(connection.sock)
        if deadline is None:
            connection.sock.close()
        else:
            connection.close_after_peer(deadline)
        self.connections.remove(connection)

    def _read(self, connection: Connection) -> None:
        messages = connection.messages()
        if messages is None:
            self._drop(connection)
            state = self.ranks.get(connection.rank) if connection.rank is not None else None
            if state is not None and not state.done and not self.stopping.is_set():
                self.end(f"watchdog: rank {connection.rank} on {state.host} closed its heartbeat connection without "
                         f"finishing (its process ended) in phase {state.phase}; rank 0 on {this_host()} is in phase "
                         f"{phase_text()}; ending the run (exit {EXIT_STATUS}): resume from the last checkpoint")
            return
        for message in messages:
            if "watch" in message:
                connection.watcher = True
                for rank, state in sorted(self.ranks.items()):
                    connection.send({"rank": rank, "host": state.host, "phase": state.phase})
                connection.send({"rank": 0, "host": this_host(), "phase": CLOCK.current()[0]})
                continue
            if "hello" in message:
                connection.rank = int(message["hello"])
                self.ranks[connection.rank] = RankState(host=str(message.get("host", "?")))
            if connection.rank is None:
                continue
            state = self.ranks[connection.rank]
            state.heard = time.monotonic()
            if "end" in message:
                self.end(str(message["end"]))
            if message.get("bye"):
                state.done = True
            if "phase" in message:
                changed = message["phase"] != state.phase
                state.phase, state.phase_s = str(message["phase"]), float(message.get("for_s", 0.0))
                if changed:
                    self._tell_watchers(connection.rank, state.host, state.phase)

    def _tell_watchers(self, rank: int, host: str, phase_name: str) -> None:
        for connection in self.connections:
            if connection.watcher:
                connection.send({"rank": rank, "host": host, "phase": phase_name})

    def _check(self) -> None:
        now, bound = time.monotonic(), self.config.timeout_s
        for rank in range(1, self.world_size):
            state = self.ranks.get(rank)
            if state is None and now - self.started > bound:
                self.end(f"watchdog: rank {rank} never reached the heartbeat hub on {this_host()} within {bound:.0f} "
                         f"s; ending the run (exit {EXIT_STATUS})")
            if state is not None and not state.done and now - state.heard > bound:
                self.end(f"watchdog: rank {rank} on {state.host} unheard for {now - state.heard:.0f} s (its last "
                         f"phase: {state.phase}); rank 0 on {this_host()} is in phase {phase_text()}; ending the run "
                         f"(exit {EXIT_STATUS}): resume from the last checkpoint")
        for probe in self.probes:
            if now - probe.answered > bound:
                host = probe.url.split("//", 1)[-1].rsplit(":", 1)[0]
                self.end(f"watchdog: rollout server {probe.url} (host {host}) unanswering for "
                         f"{now - probe.answered:.0f} s; rank 0 on {this_host()} is in phase {phase_text()}; ending "
                         f"the run (exit {EXIT_STATUS}): resume from the last checkpoint once the server is back")
        line = deadline_passed(self.config)
        if line:
            self.end(line)

    def end(self, line: str) -> None:
        for connection in self.connections:
            if connection.rank is not None:
                connection.send({"end": line})
        end_run(line)

    def stop(self) -> None:
        """The run finished: stop the thread, then tell every rank and close (each rank's Beat closes on the bye)."""
        self.stopping.set()
        self.thread.join(timeout=5)
        deadline = time.monotonic() + CLOSE_WAIT_S
        for connection in list(self.connections):
            connection.send({"bye": True})
            self._drop(connection, deadline)
        self.listener.close()
        CLOCK.listeners.remove(self._own_phase)
        self.wake_read.close()
        self.wake_write.close()


class Beat:
    """A rank's side other than 0 (see the module docstring); runs in a daemon thread from construction."""

    def __init__(self, config: WatchdogConfig, hub_host: str, port: int):
        self.config, self.hub_host, self.port = config, hub_host, port
        self.heard = time.monotonic()
        self.hub_phase = OUTSIDE
        self.stopping = threading.Event()
        self.wake_read, self.wake_write = socket.socketpair()
        CLOCK.listeners.append(self._wake)
        self.thread = threading.Thread(target=self._run, name="watchdog-beat", daemon=True)
        self.thread.start()

    def _wake(self, phase_name: str = "") -> None:
        with contextlib.suppress(OSError):
            self.wake_write.send(b"!")

    def _connect(self) -> socket.socket:
        while True:
            with contextlib.suppress(OSError):
                return socket.create_connection((self.hub_host, self.port), timeout=self.config.interval_s)
            self._check_silence(f"cannot connect to rank 0's heartbeat hub at {self.hub_host}:{self.port}")
            self.stopping.wait(min(1.0, self.config.interval_s))
            if self.stopping.is_set():
                raise ConnectionAbortedError

    def _check_silence(self, what: str = "") -> None:
        silent = time.monotonic() - self.heard
        if silent > self.config.timeout_s:
            end_run(f"watchdog: rank 0 on {self.hub_host} unheard for {silent:.0f} s "
                    f"{'(' + what + ') ' if what else ''}(its last phase: {self.hub_phase}); rank {this_rank()} on "
                    f"{this_host()} is in phase {phase_text()}; ending the run (exit {EXIT_STATUS}): resume from "
                    "the last checkpoint")

    def _run(self) -> None:
        try:
            sock = self._connect()
        except ConnectionAbortedError:
            return
        connection = Connection(sock)
        sock.setblocking(False)
        connection.send({"hello": this_rank(), "host": this_host()})
        selector = selectors.DefaultSelector()
        selector.register(sock, selectors.EVENT_READ)
        selector.register(self.wake_read, selectors.EVENT_READ)
        next_beat = time.monotonic()
        while not self.stopping.is_set():
            woken = False
            for key, _ in selector.select(timeout=max(0.0, min(0.5, next_beat - time.monotonic()))):
                if key.fileobj is self.wake_read:
                    with contextlib.suppress(OSError):
                        self.wake_read.recv(4096)
                    woken = True
                elif not self._receive(connection):  # the hub said bye (and stops writing): nothing is lost
                    sock.close()
                    return
            if woken or time.monotonic() >= next_beat:
                name, seconds = CLOCK.current()
                connection.send({"phase": name, "for_s": round(seconds, 1)})
                line = deadline_passed(self.config)
                if line:
                    connection.send({"end": line})
                    end_run(line)
            if time.monotonic() >= next_beat:
                next_beat = time.monotonic() + self.config.interval_s
            connection.flush()
            self._check_silence()
        with contextlib.suppress(OSError):
            connection.send({"bye": True})
        connection.close_after_peer(time.monotonic() + CLOSE_WAIT_S)

    def _receive(self, connection: Connection) -> bool:
        """Take the hub's messages; False once this side is to stop watching (the hub said bye)."""
        messages = connection.messages()
        if messages is None:
            if self.stopping.is_set():
                return False
            end_run(f"watchdog: rank 0 on {self.hub_host} closed the heartbeat connection without finishing (its "
                    f"process ended; its last phase: {self.hub_phase}); rank {this_rank()} on {this_host()} is in "
                    f"phase {phase_text()}; ending the run (exit {EXIT_STATUS})")
        for message in messages:
            self.heard = time.monotonic()
            if "end" in message:
                end_run(str(message["end"]))
            if message.get("bye"):
                self.stopping.set()
                return False
            self.hub_phase = str(message.get("beat", self.hub_phase))
        return True

    def stop(self) -> None:
        self.stopping.set()
        self._wake()
        self.thread.join(timeout=5)
        CLOCK.listeners.remove(self._wake)
        self.wake_read.close()
        self.wake_write.close()


RUNNING: list[Watchdog] = []  # this process's started watchdogs (stop_all)


class Watchdog:
    """This rank's watchdog (a Hub on rank 0, a Beat elsewhere, nothing when disabled); `stop()` at the run's end."""

    def __init__(self, hub: Hub | None = None, beat: Beat | None = None):
        self.hub, self.beat = hub, beat
        if hub is not None or beat is not None:
            RUNNING.append(self)

    def watch_servers(self, urls: list[str]) -> None:
        """Rank 0: probe these rollout servers too."""
        if self.hub is not None:
            self.hub.watch_servers(urls)

    def stop(self) -> None:
        for part in (self.beat, self.hub):
            if part is not None:
                part.stop()
        self.hub = self.beat = None
        if self in RUNNING:
            RUNNING.remove(self)

    def __enter__(self) -> Watchdog:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def stop_all() -> None:
    """Stop this process's watchdogs as a finished run does: an error every rank found alike ends each of them in its
    own way (platform/process.py exit_saying_once), which is no lost peer."""
    for watchdog in list(RUNNING):
        watchdog.stop()


def start(config: WatchdogConfig, rank: int, world_size: int, hub_host: str,
          share: Callable[[int | None], int]) -> Watchdog:
    """Every rank, once the process group exists: rank 0 opens the hub and `share` (a broadcast from rank 0 over the
    process group, called once on every rank) tells the others its port; they connect to `hub_host` (MASTER_ADDR,
    the host of rank 0). Disabled (timeout 0): nothing is started and nothing shared."""
    if not config.enabled:
        return Watchdog()
    if rank != 0:
        return Watchdog(beat=Beat(config, hub_host, share(None)))
    listener = listen(config)
    port = listener.getsockname()[1]
    share(port)
    print(f"watchdog: heartbeats on {this_host()}:{port} every {config.interval_s:g} s; a rank or rollout server "
          f"unheard for {config.timeout_s:g} s ends the run (exit {EXIT_STATUS}); follow the phases with python -m "
          f"megatron_dppo.platform.watchdog watch {this_host()}:{port}", flush=True)
    return Watchdog(hub=Hub(config, world_size, listener))


def watch(address: str, wait_s: float = 600.0) -> int:
    """Print every rank's phase changes, as the hub at `address` (HOST:PORT) sends them, until the run ends; a hub
    not listening yet is waited for, up to `wait_s`."""
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + wait_s
    while True:
        try:
            sock = socket.create_connection((host.strip("[]"), int(port)), timeout=30)
            break
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    with sock:
        sock.settimeout(None)
        sock.sendall(json.dumps({"watch": True}).encode() + b"\n")
        for line in sock.makefile("r"):
            message = json.loads(line)
            if "rank" in message:
                print(f"rank {message['rank']} {message['host']} {message['phase']}", flush=True)
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "watch":
        print("usage: python -m megatron_dppo.platform.watchdog watch HOST:PORT", file=sys.stderr)
        sys.exit(2)
    sys.exit(watch(sys.argv[2]))
