"""A rollout server with faults: a reverse proxy in front of real servers that answers /generate slowly, with errors
or with malformed bodies, as its mode file says at each request (tests/test_cluster_faults.py).

    python tests/cluster/fault_proxy.py MODE_FILE LISTEN_PORT:TARGET_PORT [...]
    client ─► http://HOST:LISTEN_PORT/any/route ─► http://127.0.0.1:TARGET_PORT (the real server) ─► client
    the mode file, read at every request: one line of these words, combined at will (a change of the line restarts
    its count; an empty line or "pass": every request forwarded, every answer returned as it came):
        delay S                       every answer (every route) S seconds late
        faults F1,F2,...              the next /generate answers spoilt in turn by F1, F2, ... (then as they came);
                                      F is one of 500 (HTTP 500, the request never forwarded), truncated (the real
                                      body cut in half), layout (the real body without its meta_info)
        malformed                     every /generate answer truncated
        after N                       faults and malformed spare the first N /generate answers

Each spoilt answer is logged on stdout as "fault F on /generate" (the test counts them).
"""

import asyncio
import json
import sys
from pathlib import Path

from aiohttp import ClientConnectorError, ClientSession, ClientTimeout, web

HOP_HEADERS = {"host", "content-length", "transfer-encoding", "connection"}


class Mode:
    """The mode file's current line, and how many /generate answers it has seen."""

    def __init__(self, path: Path):
        self.path, self.line, self.seen = path, "", 0

    def current(self) -> dict[str, str]:
        """{word: its value} of the mode line ("malformed" and "pass" take none)."""
        line = self.path.read_text().strip() if self.path.exists() else ""
        if line != self.line:
            self.line, self.seen = line, 0
        words, settings = line.split(), {}
        while words:
            word = words.pop(0)
            settings[word] = "" if word in ("malformed", "pass") else words.pop(0)
        return settings

    def generate_fault(self) -> str | None:
        """The fault for this /generate answer (counted), or None."""
        settings = self.current()
        index = self.seen - int(settings.get("after", 0))
        self.seen += 1
        if index < 0:
            return None
        if "malformed" in settings:
            return "truncated"
        faults = settings["faults"].split(",") if "faults" in settings else []
        return faults[index] if index < len(faults) else None

    def delay_s(self) -> float:
        return float(self.current().get("delay", 0.0))


def spoil(fault: str, body: bytes) -> bytes:
    if fault == "truncated":
        return body[: len(body) // 2]
    outputs = json.loads(body)
    for output in outputs if isinstance(outputs, list) else [outputs]:
        output.pop("meta_info", None)
    return json.dumps(outputs).encode()


def proxy_app(target_port: int, mode: Mode, session: ClientSession) -> web.Application:
    async def forward(request: web.Request) -> web.StreamResponse:
        fault = mode.generate_fault() if request.path == "/generate" else None
        delay = mode.delay_s()
        if fault == "500":
            print(f"fault {fault} on {request.path}", flush=True)
            return web.Response(status=500, text="injected error")
        headers = {key: value for key, value in request.headers.items() if key.lower() not in HOP_HEADERS}
        try:
            async with session.request(request.method, f"http://127.0.0.1:{target_port}{request.path_qs}",
                                       data=await request.read(), headers=headers) as answer:
                body, status = await answer.read(), answer.status
                content_type = answer.headers.get("Content-Type", "application/json").split(";")[0]
        except ClientConnectorError:  # the server is not up (yet): a gateway's answer, as a real proxy gives
            return web.Response(status=502, text=f"no server on port {target_port}")
        if fault is not None:
            print(f"fault {fault} on {request.path}", flush=True)
            body = spoil(fault, body)
        if delay:
            await asyncio.sleep(delay)
        return web.Response(status=status, body=body, content_type=content_type)

    app = web.Application(client_max_size=2**31)
    app.router.add_route("*", "/{tail:.*}", forward)
    return app


async def main(mode_file: str, pairs: list[str]) -> None:
    mode = Mode(Path(mode_file))
    async with ClientSession(timeout=ClientTimeout(total=None)) as session:
        runners = []
        for pair in pairs:
            listen_port, target_port = map(int, pair.split(":"))
            runner = web.AppRunner(proxy_app(target_port, mode, session), access_log=None)
            await runner.setup()
            await web.TCPSite(runner, "0.0.0.0", listen_port).start()
            runners.append(runner)
        print(f"fault proxy: {' '.join(pairs)} (mode file {mode_file})", flush=True)
        await asyncio.Event().wait()


if __name__ == "__main__":
    if len(sys.argv) < 3:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        sys.exit(2)
    asyncio.run(main(sys.argv[1], sys.argv[2:]))
