"""vLLM's own server-argument parser, run by vLLM's interpreter: parse command lines, report what vLLM makes of each.

The parser is the one vLLM 0.32's OpenAI-compatible server builds (vllm/entrypoints/launchers/api_server/entry.py:
`make_arg_parser(FlexibleArgumentParser())`, then `validate_parsed_serve_args`), which is what
`python -m vllm.entrypoints.openai.api_server <flags>` runs. Only the error reporting differs: an
error comes back to the caller instead of usage and exit status 2. Imports nothing of megatron_dppo.

    <vLLM env>/bin/python tests/workers/vllm_args.py < [argv, ...]   (JSON: each argv the server's flags)
    ─► last line of stdout: [{"error": null | message, "values": {dest: value} | null}, ...] (JSON)
"""

import json
import sys

from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
from vllm.utils.argparse_utils import FlexibleArgumentParser


class ParseError(Exception):
    pass


class ReportingParser(FlexibleArgumentParser):
    def error(self, message):
        raise ParseError(message)


def main():
    parser = make_arg_parser(ReportingParser(description="vLLM OpenAI-Compatible RESTful API server."))
    results = []
    for argv in json.load(sys.stdin):
        try:
            namespace = parser.parse_args(argv)
            validate_parsed_serve_args(namespace)
            results.append({"error": None, "values": json.loads(json.dumps(vars(namespace), default=str))})
        except (ParseError, ValueError, TypeError) as error:
            results.append({"error": f"{type(error).__name__}: {error}", "values": None})
    print(json.dumps(results))


if __name__ == "__main__":
    main()
