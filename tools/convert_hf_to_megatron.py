"""Convert an HF safetensors directory into a Megatron dist checkpoint for a TP x PP layout (CPU, no GPU needed).

    --hf-dir (a folder with config.json + model.safetensors or shards with an index, or a Hub name ORG/NAME,
              resolved by megatron_dppo.hub: downloaded into the Hugging Face cache, or read from it offline)
        ──► megatron_dppo.actor.conversion.hf_to_megatron ──► --out/iter_0000000 + --out/latest

The result is what the trainer's --load reads (any TP/PP can load it: dist checkpoints reshard on load). It streams:
each of the tp x pp CPU ranks holds one layer's slice of one parameter (or its embedding shard) at a time.
Example:
    python tools/convert_hf_to_megatron.py --hf-dir Qwen/Qwen2.5-0.5B --out ckpt/qwen --tp 2 --pp 1 --dtype bf16
"""

import argparse
import sys

from megatron_dppo.actor.conversion import DTYPES, hf_to_megatron, run_tool
from megatron_dppo.flags import ToolHelpFormatter
from megatron_dppo.hub import resolve_model


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=ToolHelpFormatter)
    parser.add_argument("--hf-dir", required=True, metavar="DIR_OR_ORG/NAME",
                        help="HF model directory (safetensors), or a Hub model name")
    parser.add_argument("--out", required=True, help="new Megatron save directory (must not exist)")
    parser.add_argument("--tp", type=int, default=1, help="tensor model parallel size")
    parser.add_argument("--pp", type=int, default=1, help="pipeline model parallel size")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="parameter dtype of the checkpoint (default: that of the HF weights)")
    args = parser.parse_args(argv)
    if args.tp < 1 or args.pp < 1:
        parser.error(f"--tp {args.tp} and --pp {args.pp} must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return run_tool(lambda: hf_to_megatron(resolve_model(args.hf_dir, "--hf-dir"), args.out, args.tp, args.pp,
                                           args.dtype))


if __name__ == "__main__":
    sys.exit(main())
