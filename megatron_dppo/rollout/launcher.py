"""Start, probe and restart rollout servers: the embedded engine, SGLang servers, vLLM servers (from their own Python
environment), or external URLs.

launch ──► wait on the server's health route (bounded) ──► ServerPool
ServerPool.ensure_alive(url): dead process → restart on the same port → wait healthy
                              → weight syncer re-joins the group with every engine → resync callback

Invariants:
- every wait is bounded (`startup_timeout_s`); a server that exits or never gets healthy raises
  RolloutServerError with the command and the tail of its log;
- servers started here run behind a tether (platform/tether.py) that SIGKILLs their whole process group once the
  process that started them is gone, at any stage of their start-up; they run without torchrun's variables and are
  stopped with that whole group (even when the process that led it has already died); external URLs are only
  probed.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from megatron_dppo.platform import tether
from megatron_dppo.platform.network import free_port
from megatron_dppo.rollout.client import RolloutServerError, control_request

DEFAULT_STARTUP_TIMEOUT_S = 120.0
# The embedded engine's server, run as `python -m` (servers/embedded/; the client side never imports it)
EMBEDDED_ENGINE_MODULE = "megatron_dppo.servers.embedded"
LOG_TAIL_LINES, LOG_LINE_CHARS = 40, 300  # what a start-up failure shows of the server's log
# The interpreter of the vLLM server's environment (tools/install_vllm_cpu.sh prints it), unless --rollout-python
VLLM_PYTHON_VARIABLE = "MEGATRON_DPPO_VLLM_PYTHON"


def wait_healthy(url: str, timeout_s: float, process: subprocess.Popen | None = None,
                 describe: Callable[[], str] = lambda: "", health_path: str = "/health_generate") -> None:
    """Poll GET `health_path` until 200; fail early if `process` exits."""
    deadline = time.monotonic() + timeout_s
    last_error = "no answer yet"
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RolloutServerError(f"rollout server {url} exited with code {process.returncode} while starting."
                                     f"{describe()}")
        try:
            control_request(url, health_path, None, "GET", timeout_s=5.0)
            return
        except RolloutServerError as error:
            last_error = str(error)
        time.sleep(0.2)
    raise RolloutServerError(f"rollout server {url} not healthy after {timeout_s} s ({last_error}).{describe()}")


class ServerHandle:
    """One server process started here (or an external URL when `command` is None)."""

    def __init__(self, url: str, command: list[str] | None = None, env: dict | None = None,
                 startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S, health_path: str = "/health_generate"):
        self.url = url.rstrip("/")
        self.command = command
        self.env = env
        self.startup_timeout_s = startup_timeout_s
        self.health_path = health_path  # SGLang's /health_generate runs a generation; vLLM has /health
        self.process: subprocess.Popen | None = None
        self.log_path: Path | None = None
        self.restarts = 0

    def start(self) -> ServerHandle:
        if self.command is None:
            wait_healthy(self.url, self.startup_timeout_s, health_path=self.health_path)
            return self
        log = tempfile.NamedTemporaryFile("w", prefix="rollout_server_", suffix=".log", delete=False)
        self.log_path = Path(log.name)
        self.process = tether.spawn(self.command, self.env, log)
        log.close()
        try:
            wait_healthy(self.url, self.startup_timeout_s, self.process, self._describe, self.health_path)
        except RolloutServerError:
            self.stop()
            raise
        return self

    def _describe(self) -> str:
        """The command and its log's last lines, each cut short: one huge line (vLLM lists every architecture it
        supports after naming the one it refused) must not push the error itself out of the message."""
        lines = self.log_path.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:] if self.log_path else []
        tail = "\n".join(line if len(line) <= LOG_LINE_CHARS else line[:LOG_LINE_CHARS] + " [...]" for line in lines)
        return f"\ncommand: {' '.join(self.command or [])}\nlog tail:\n{tail}"

    @property
    def managed(self) -> bool:
        return self.command is not None

    def alive(self) -> bool:
        if self.process is not None and self.process.poll() is not None:
            return False
        try:
            control_request(self.url, "/health", None, "GET", timeout_s=5.0)
            return True
        except RolloutServerError:
            return False

    def stop(self) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.terminate()  # the tether hands SIGTERM to the server, which shuts down in its own way
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        # the group outlives a leader that died or ended alone (vLLM's and SGLang's engine processes)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=10)
        self.process = None

    def restart(self) -> None:
        self.stop()
        self.restarts += 1
        self.start()

    def __enter__(self) -> ServerHandle:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


# torchrun's variables describe the trainer's process group; a server started from a trainer rank must not
# believe it is a member of it (torch's rendezvous would, for one, wait on torchelastic's agent store).
TORCHRUN_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                      "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT")


def server_env(environ=None) -> dict[str, str]:
    """`environ` (default: this process's) without torchrun's and torchelastic's variables."""
    environ = os.environ if environ is None else environ
    return {key: value for key, value in environ.items()
            if key not in TORCHRUN_VARIABLES and not key.startswith(("TORCHELASTIC_", "MASTER_"))}


def python_env() -> dict[str, str]:
    """This environment, without torchrun's variables, with the package importable even from a source checkout."""
    repo_root = str(Path(__file__).resolve().parents[2])
    env = server_env()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [repo_root, os.environ.get("PYTHONPATH")]))
    return env


def embedded_engine_command(model_dir: str, host: str, port: int, python: str = sys.executable,
                            **engine_options) -> list[str]:
    """`python -m megatron_dppo.servers.embedded` with `engine_options` as flags (True: a switch), in the order
    examples/slurm/rollout_node.sh writes its embedded engines' commands (tests/test_launch_plan.py holds the two
    equal)."""
    command = [python, "-m", EMBEDDED_ENGINE_MODULE, "--model-dir", str(model_dir),
               "--host", host, "--port", str(port)]
    for key, value in engine_options.items():
        flag = f"--{key.replace('_', '-')}"
        if value is True:
            command.append(flag)
        elif value is not None and value is not False:
            command += [flag, str(value)]
    return command


def launch_embedded_engine(model_dir: str, host: str = "127.0.0.1", port: int | None = None,
                           startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S, **engine_options) -> ServerHandle:
    """Start `python -m megatron_dppo.servers.embedded` and wait until /health_generate answers."""
    if not Path(model_dir, "config.json").is_file():
        raise FileNotFoundError(f"model_dir {model_dir} has no config.json; save an HF model there first")
    port = port or free_port()
    handle = ServerHandle(f"http://{host}:{port}", embedded_engine_command(model_dir, host, port, **engine_options),
                          env=python_env(), startup_timeout_s=startup_timeout_s)
    return handle.start()


def start_all(handles: list[ServerHandle]) -> list[ServerHandle]:
    """Start the servers in order; if one fails, stop those already started and raise its error."""
    started = []
    try:
        for handle in handles:
            started.append(handle.start())
    except BaseException:
        for handle in started:
            handle.stop()
        raise
    return started


# --help's section on the --sglang-* pass-through (forward_sglang_args, sglang_command)
SGLANG_PASSTHROUGH_HELP = (
    "--sglang-FLAG [VALUE]: any flag of `python -m sglang.launch_server` (SGLang 0.5.23), given to the servers that "
    "--rollout-backend sglang starts without the prefix: --sglang-mem-fraction-static 0.7 → --mem-fraction-static "
    "0.7, --sglang-context-length 8192, --sglang-tp-size 2 (= --rollout-server-gpus 2), --sglang-attention-backend "
    "fa3. The launcher sets --model-path, --host and --port itself, and adds --enable-deterministic-inference and "
    "--tp-size (--rollout-server-gpus) where they are not given; --dry-run prints each server's command line.")


def forward_sglang_args(argv: list[str]) -> list[str]:
    """Pick the --sglang-* flags (and their values) out of a command line, without the prefix:
    `--sglang-tp-size 2 --lr 1e-6 --sglang-mem-fraction-static=0.8` → `--tp-size 2 --mem-fraction-static=0.8`."""
    forwarded, taking = [], False
    for item in argv:
        if item.startswith("--"):
            taking = item.startswith("--sglang-")
            if taking:
                forwarded.append("--" + item.removeprefix("--sglang-"))
        elif taking:
            forwarded.append(item)
    return forwarded


def sglang_flag_value(sglang_args: list[str], names: tuple[str, ...]) -> str | None:
    """The value SGLang reads for a flag with these `names` (its aliases) in `sglang_args`, forwarded flags without
    the prefix: the last `--name value` or `--name=value` wins, as in argparse. None when the flag is not there."""
    value = None
    for index, item in enumerate(sglang_args):
        name, equals, inline = item.partition("=")
        if name in names:
            value = inline if equals else (sglang_args[index + 1] if index + 1 < len(sglang_args) else None)
    return value


# Every seeded request (the trainer seeds each sample) is reproducible only on an SGLang server started with this
# flag: without it SGLang ignores sampling_seed (sampling/sampling_batch_info.py). With it SGLang also picks a
# deterministic attention backend itself (fa3 on Hopper) and refuses a non-deterministic one given explicitly.
SGLANG_DETERMINISTIC = "--enable-deterministic-inference"


def sglang_command(model_path: str, host: str, port: int, sglang_args: list[str],
                   python: str = sys.executable) -> list[str]:
    """`python -m sglang.launch_server`, deterministic, with `sglang_args` last (examples/slurm/rollout_node.sh writes
    its servers' commands in the same order; tests/test_launch_plan.py holds the two equal)."""
    reserved = {"--host", "--port", "--model-path"} & {arg.split("=")[0] for arg in sglang_args}
    if reserved:
        raise ValueError(f"{sorted(reserved)} are set by the launcher; drop them from the --sglang-* flags")
    deterministic = [] if SGLANG_DETERMINISTIC in sglang_args else [SGLANG_DETERMINISTIC]
    return [python, "-m", "sglang.launch_server", "--model-path", str(model_path), "--host", host,
            "--port", str(port), *deterministic, *sglang_args]


def visible_gpus(environ=None) -> list[str]:
    """This node's GPUs as CUDA_VISIBLE_DEVICES names them (else every device torch sees)."""
    environ = os.environ if environ is None else environ
    if "CUDA_VISIBLE_DEVICES" in environ:
        return [gpu.strip() for gpu in environ["CUDA_VISIBLE_DEVICES"].split(",") if gpu.strip()]
    import torch

    return [str(index) for index in range(torch.cuda.device_count())]


def server_gpus(n: int, gpus_per_server: int, environ=None, colocate: bool = False,
                engine: str = "SGLang") -> list[str]:
    """CUDA_VISIBLE_DEVICES of each of n servers: the node's GPUs (`visible_gpus(environ)`) after the trainer's,
    which torchrun's local ranks 0 .. LOCAL_WORLD_SIZE-1 hold (each rank binds cuda:LOCAL_RANK), so trainer and
    servers never share a GPU; `colocate`: from the first GPU on, shared with the trainer (a one-GPU machine). The
    launcher and the --dry-run plan (with the node's variables as `environ`) both lay servers out here."""
    environ = os.environ if environ is None else environ
    visible = visible_gpus(environ)
    trainer_gpus = 0 if colocate else int(environ.get("LOCAL_WORLD_SIZE", "1"))
    needed = trainer_gpus + n * gpus_per_server
    if needed > len(visible):
        raise RolloutServerError(
            f"{trainer_gpus} trainer ranks and {n} {engine} servers x {gpus_per_server} GPUs need {needed} GPUs on "
            f"this node, but {len(visible)} are visible ({','.join(visible) or 'none'}): run fewer trainer ranks "
            "(--nproc-per-node) or servers (--rollout-num-servers), or start the servers elsewhere "
            "(--rollout-backend external)")
    free = visible[trainer_gpus:]
    return [",".join(free[index * gpus_per_server:(index + 1) * gpus_per_server]) for index in range(n)]


def sglang_servers(n: int, model_path: str, sglang_args: list[str], host: str = "127.0.0.1",
                   ports: list[int] | None = None, gpus_per_server: int = 1, startup_timeout_s: float = 600.0,
                   environ=None, colocate: bool = False) -> list[ServerHandle]:
    """The n SGLang servers `launch_sglang_servers` starts, not started yet: each command is deterministic
    (SGLANG_DETERMINISTIC), each environment is `environ` without torchrun's variables, on its own GPUs (see
    `server_gpus`)."""
    ports = ports or [free_port() for _ in range(n)]
    if len(ports) != n:
        raise ValueError(f"{len(ports)} ports given for {n} SGLang servers")
    env = server_env(environ)
    return [ServerHandle(f"http://{host}:{port}", sglang_command(model_path, host, port, sglang_args),
                         env={**env, "CUDA_VISIBLE_DEVICES": gpus}, startup_timeout_s=startup_timeout_s)
            for port, gpus in zip(ports, server_gpus(n, gpus_per_server, environ, colocate))]


def require_sglang() -> None:
    spec = importlib.util.find_spec("sglang")  # top-level only: importing sglang's server needs CUDA
    if spec is None or not any(Path(p, "launch_server.py").is_file() for p in spec.submodule_search_locations):
        raise RolloutServerError("sglang is not installed in this environment (pip install 'sglang[all]' on a "
                                 "GPU machine), or give --rollout-urls of servers started elsewhere")


def launch_sglang_servers(n: int, model_path: str, sglang_args: list[str], host: str = "127.0.0.1",
                          ports: list[int] | None = None, gpus_per_server: int = 1,
                          startup_timeout_s: float = 600.0, colocate: bool = False) -> list[ServerHandle]:
    """Start the n `python -m sglang.launch_server` processes of `sglang_servers` and wait until they are healthy."""
    require_sglang()
    return start_all(sglang_servers(n, model_path, sglang_args, host, ports, gpus_per_server, startup_timeout_s,
                                    colocate=colocate))


def vllm_python(python: str | None = None) -> str:
    """The vLLM environment's interpreter: `python`, else $MEGATRON_DPPO_VLLM_PYTHON; it must exist."""
    python = python or os.environ.get(VLLM_PYTHON_VARIABLE)
    if not python:
        raise RolloutServerError(f"--rollout-backend vllm needs the interpreter of a Python environment with vLLM: "
                                 f"--rollout-python PATH or {VLLM_PYTHON_VARIABLE}=PATH (tools/install_vllm_cpu.sh "
                                 "builds one on CPU and prints its path)")
    if not os.access(python, os.X_OK):
        raise RolloutServerError(f"vLLM interpreter {python} (--rollout-python or {VLLM_PYTHON_VARIABLE}) is not an "
                                 "executable file; run tools/install_vllm_cpu.sh, or point it at your vLLM "
                                 "environment's bin/python")
    return python


def vllm_env(environ=None) -> dict[str, str]:
    """A clean server environment: no torchrun variables, only this package on PYTHONPATH (whatever the trainer's
    PYTHONPATH holds would shadow vLLM's own packages), the dev routes on (/collective_rpc, /pause, ...)."""
    env = server_env(environ)
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    env["VLLM_SERVER_DEV_MODE"] = "1"
    # vLLM on CPU reserves this many GiB of KV cache (GPU builds ignore it); sized for the CPU test models
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    return env


def vllm_servers(n: int, model_dir: str, python: str, host: str = "127.0.0.1", ports: list[int] | None = None,
                 dtype: str = "float32", max_model_len: int | None = None, enforce_eager: bool = False,
                 startup_timeout_s: float = 600.0, gpus_per_server: int = 1, environ=None) -> list[ServerHandle]:
    """The n vLLM servers `launch_vllm_servers` starts, not started yet: each on its own GPUs (see `server_gpus`),
    or, with gpus_per_server=0, vLLM's CPU build, which uses none."""
    from megatron_dppo.rollout.vllm import vllm_server_command

    ports = ports or [free_port() for _ in range(n)]
    if len(ports) != n:
        raise ValueError(f"{len(ports)} ports given for {n} vLLM servers")
    env = vllm_env(environ)
    devices = server_gpus(n, gpus_per_server, environ, engine="vLLM") if gpus_per_server else [None] * n
    return [ServerHandle(f"http://{host}:{port}",
                         vllm_server_command(python, model_dir, host, port, dtype, max_model_len, enforce_eager),
                         env=env if gpus is None else {**env, "CUDA_VISIBLE_DEVICES": gpus},
                         startup_timeout_s=startup_timeout_s, health_path="/health")
            for port, gpus in zip(ports, devices)]


def launch_vllm_servers(n: int, model_dir: str, python: str | None = None, host: str = "127.0.0.1",
                        ports: list[int] | None = None, dtype: str = "float32", max_model_len: int | None = None,
                        enforce_eager: bool = False, startup_timeout_s: float = 600.0,
                        gpus_per_server: int = 1) -> list[ServerHandle]:
    """Start the n vLLM OpenAI-compatible servers of `vllm_servers` from vLLM's own environment (rollout/vllm.py) and
    wait for /health. A server that dies while starting raises with its command and log tail; the others are then
    stopped."""
    python = vllm_python(python)
    require_model_dir(model_dir)
    return start_all(vllm_servers(n, model_dir, python, host, ports, dtype, max_model_len, enforce_eager,
                                  startup_timeout_s, gpus_per_server))


def require_model_dir(model_dir: str) -> None:
    if not Path(model_dir, "config.json").is_file():
        raise FileNotFoundError(f"model_dir {model_dir} has no config.json; vLLM starts from an HF model directory")


SERVER_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def local_servers(args, model_dir: str, cpu: bool, environ=None) -> list[ServerHandle]:
    """The SGLang or vLLM servers rank 0 starts on its node for the parsed flags `args`, not started yet:
    `start_local_servers` starts them and --dry-run prints them (launch_plan), so both show one layout. `cpu`: the
    machine has no GPU (vLLM's CPU build then uses none, in eager mode: its compile warm-up takes minutes there)."""
    if args.rollout_backend == "sglang":
        return sglang_servers(args.rollout_num_servers, str(model_dir), args.sglang_args,
                              gpus_per_server=args.rollout_server_gpus, environ=environ, colocate=args.rollout_colocate)
    if args.rollout_backend == "vllm":
        dtype = SERVER_DTYPES["bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"]
        return vllm_servers(args.rollout_num_servers, str(model_dir),
                            args.rollout_python or os.environ.get(VLLM_PYTHON_VARIABLE, "python"), dtype=dtype,
                            enforce_eager=cpu, gpus_per_server=0 if cpu else 1, environ=environ)
    raise ValueError(f"--rollout-backend {args.rollout_backend} starts no SGLang or vLLM server")


def start_local_servers(args, model_dir: str, cpu: bool) -> list[ServerHandle]:
    """Start the servers of `local_servers` and wait until they are healthy."""
    if args.rollout_backend == "sglang":
        require_sglang()
    else:
        vllm_python(args.rollout_python)
        require_model_dir(model_dir)
    return start_all(local_servers(args, model_dir, cpu))


def external_servers(urls: list[str], startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S) -> list[ServerHandle]:
    """Servers started elsewhere (e.g. by Slurm): probe them; they cannot be restarted from here."""
    return [ServerHandle(url, startup_timeout_s=startup_timeout_s).start() for url in urls]


class ServerPool:
    """Servers plus what a restart needs: the weight syncer (to rebuild the group) and a resync callback."""

    def __init__(self, handles: list[ServerHandle], weight_syncer=None,
                 resync: Callable[[], object] | None = None):
        self.handles = {handle.url: handle for handle in handles}
        self.weight_syncer = weight_syncer
        self.resync = resync
        self._lock = threading.Lock()

    @property
    def urls(self) -> list[str]:
        return list(self.handles)

    def ensure_alive(self, url: str) -> None:
        """Restart `url` if it is dead, then re-join the weight group and re-send the current weights."""
        handle = self.handles.get(url.rstrip("/"))
        if handle is None:
            raise RolloutServerError(f"{url} is not a server of this pool ({self.urls})")
        with self._lock:  # concurrent failing requests restart a server once
            if handle.alive():
                return
            if not handle.managed:
                raise RolloutServerError(f"external rollout server {url} is down and cannot be restarted from "
                                         "here; restart it (e.g. its Slurm job) and retry")
            handle.restart()
            if self.weight_syncer is not None and self.weight_syncer.group is not None:
                self.weight_syncer.init_group()  # the old group lost a member
            if self.resync is not None:
                self.resync()

    def check_all(self) -> list[str]:
        """Restart every dead server; return the URLs that were restarted."""
        dead = [url for url, handle in self.handles.items() if not handle.alive()]
        for url in dead:
            self.ensure_alive(url)
        return dead

    def stop(self) -> None:
        for handle in self.handles.values():
            handle.stop()

    def __enter__(self) -> ServerPool:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
