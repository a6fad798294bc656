"""Export a Megatron dist checkpoint (saved at any TP/PP, by the trainer or the converter) to an HF directory.

    --megatron-dir (a save dir, following `latest`, or an iter_* dir)
        ──► megatron_dppo.actor.conversion.megatron_to_hf
        ──► --out: config.json, generation_config.json, safetensors shards + index, tokenizer files

Streams layer by layer on the CPU: no model is built and no process group is started.
Example:
    python tools/convert_megatron_to_hf.py --megatron-dir ckpt/run1 --out hf/run1 --dtype bf16 --tokenizer-dir base
"""

import argparse
import sys

from megatron_dppo.actor.conversion import DTYPES, megatron_to_hf, run_tool
from megatron_dppo.flags import ToolHelpFormatter
from megatron_dppo.hub import resolve_model


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=ToolHelpFormatter)
    parser.add_argument("--megatron-dir", required=True, help="Megatron save directory or iter_* directory")
    parser.add_argument("--out", required=True, help="new HF directory (must not exist)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="dtype of the HF weights (default: the checkpoint's)")
    parser.add_argument("--tokenizer-dir", default=None, metavar="DIR_OR_ORG/NAME",
                        help="copy the tokenizer files, and generation_config.json if present, from this directory "
                        "(usually the base model's; a Hub model name works too)")
    parser.add_argument("--max-shard-size-mb", type=float, default=2048.0, help="largest safetensors shard")
    args = parser.parse_args(argv)
    if args.max_shard_size_mb <= 0:
        parser.error(f"--max-shard-size-mb {args.max_shard_size_mb} must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    def export():
        tokenizer_dir = resolve_model(args.tokenizer_dir, "--tokenizer-dir") if args.tokenizer_dir else None
        return megatron_to_hf(args.megatron_dir, args.out, args.dtype, tokenizer_dir,
                              int(args.max_shard_size_mb * 1024**2))

    return run_tool(export)


if __name__ == "__main__":
    sys.exit(main())
