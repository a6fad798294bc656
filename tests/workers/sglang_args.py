"""SGLang's own server-argument parser on a CPU machine: parse command lines, report what SGLang makes of each.

Runs the installed wheel's code (sglang==0.5.23): `ServerArgs.add_cli_args` from srt/server_args.py, which registers
every flag declared in srt/arg_groups/, on an argparse parser, as `prepare_server_args` (the parser of
`python -m sglang.launch_server` and `sglang serve`) does. Two imports are kept from running, both beside the point
of parsing and unable to load here:
- `sglang/__init__.py`, which patches transformers and imports the frontend language (and with it torch._dynamo):
  the package is entered as a bare namespace over the wheel's directory instead;
- `triton`, the GPU kernel compiler that srt/utils/common.py imports at module level and a CPU build of torch does
  not ship: a stand-in module whose every attribute is a function that raises when called. Registering and parsing
  flags calls none of them (a call would fail the parse loudly, never pass it).
The pure-Python packages SGLang's argument modules import (msgspec, orjson, pybase64, pyzmq, requests, starlette)
come with the test extra.

    python tests/workers/sglang_args.py < [argv, ...]   (JSON: each argv is what follows `-m sglang.launch_server`)
    ─► last line of stdout: [{"error": null | argparse's message, "values": {dest: value} | null}, ...] (JSON)
"""

import argparse
import importlib.util
import json
import sys
import types


class ParseError(Exception):
    pass


class ReportingParser(argparse.ArgumentParser):
    """argparse's parser, reporting an error to the caller instead of printing usage and exiting with status 2."""

    def error(self, message):
        raise ParseError(message)


class Unavailable(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)

        def unavailable(*args, **kwargs):
            raise RuntimeError(f"{self.__name__}.{name} was called while parsing flags; it needs a GPU")

        return unavailable


def sglang_parser() -> argparse.ArgumentParser:
    spec = importlib.util.find_spec("sglang")
    if spec is None:
        raise SystemExit("sglang is not installed: pip install --no-deps sglang==0.5.23 (part of the test extra)")
    package = types.ModuleType("sglang")
    package.__path__ = list(spec.submodule_search_locations)
    sys.modules["sglang"] = package
    sys.modules.setdefault("triton", Unavailable("triton"))
    from sglang.srt.server_args import ServerArgs

    parser = ReportingParser(prog="sglang serve")
    ServerArgs.add_cli_args(parser)
    return parser


def main():
    parser = sglang_parser()
    results = []
    for argv in json.load(sys.stdin):
        try:
            values = vars(parser.parse_args(argv))
            results.append({"error": None, "values": json.loads(json.dumps(values, default=str))})
        except ParseError as error:
            results.append({"error": str(error), "values": None})
    print(json.dumps(results))


if __name__ == "__main__":
    main()
