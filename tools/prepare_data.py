"""Write the built-in prompt sets as Parquet files in the layout --prompt-data reads: one row per prompt, with
`prompt` (the text the model is given, the request for a \\boxed{} answer included) and `label` (the reference final
answer). Your own data in this layout needs no other flag; with other field names pass --input-key / --label-key.

    <data dir>/math/train.jsonl, gsm8k/..., bench/... ──► load_dataset (each set's own fields, checked)
        ──► OUT/<set>.parquet (prompt, label) ──► --prompt-data OUT/math_train.parquet, --eval-prompt-data ...

The data dir is DPPO_DATA_DIR, or ../shared/data beside the project, or --data-dir; docs/data_and_rewards.md lists
its files and where they come from. MATH train has two rows without a final answer: pass --skip-bad-rows.

Example:
    python tools/prepare_data.py --out data --skip-bad-rows
    python tools/prepare_data.py --out data --sets math_train math500
"""

import argparse
import sys

from megatron_dppo.data.datasets import DATASETS, PromptDataError, load_dataset


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for <set>.parquet")
    parser.add_argument("--sets", nargs="+", default=list(DATASETS), choices=list(DATASETS), metavar="SET",
                        help=f"which sets (default: all): {', '.join(DATASETS)}")
    parser.add_argument("--data-dir", default=None,
                        help="folder of the built-in sets (default: DPPO_DATA_DIR or ../shared/data)")
    parser.add_argument("--skip-bad-rows", action="store_true", help="leave out rows without a usable prompt or label")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from pathlib import Path

    from datasets import Dataset, disable_progress_bars

    disable_progress_bars()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in args.sets:
        try:
            examples = load_dataset(name, data_dir=args.data_dir, skip_bad_rows=args.skip_bad_rows)
        except PromptDataError as error:
            sys.exit(f"prepare_data.py: error: {error}")
        path = out / f"{name}.parquet"
        table = Dataset.from_dict({"prompt": [e.prompt for e in examples], "label": [e.answer for e in examples]})
        table.to_parquet(str(path))
        print(f"{name:14s} {len(examples):6d} rows  {path}  (--reward-type {DATASETS[name].reward_type})", flush=True)


if __name__ == "__main__":
    main()
