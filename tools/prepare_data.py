"""Write the built-in prompt sets as Parquet files in the layout --prompt-data reads: one row per prompt, with
`prompt` (the text the model is given, the request for a \\boxed{} answer included) and `label` (the reference final
answer). Your own data in this layout needs no other flag; with other field names pass --input-key / --label-key.

    each set: its local copy, <data dir>/math/train.jsonl, gsm8k/..., bench/... (load_dataset)
              or, where there is none, its public Hugging Face data set (data/public_sources.py: downloaded into the
              Hugging Face cache; with HF_HUB_OFFLINE=1 read from it)
        ──► the set's own fields, checked ──► OUT/<set>.parquet (prompt, label), the same rows either way
        ──► --prompt-data OUT/math_train.parquet, --eval-prompt-data ...

The data dir is DPPO_DATA_DIR, or ../shared/data beside the project, or --data-dir; docs/data_and_rewards.md lists
its files and their public sources. Each line printed names the set's rows, its file and where they came from (the
local file, or the Hub data set and the commit used). MATH train has two rows without a final answer: pass
--skip-bad-rows.

Example:
    python tools/prepare_data.py --out data --skip-bad-rows
    python tools/prepare_data.py --out data --sets math_train math500
"""

import argparse
import sys

from megatron_dppo.data.datasets import DATASETS


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for <set>.parquet")
    parser.add_argument("--sets", nargs="+", default=list(DATASETS), choices=list(DATASETS), metavar="SET",
                        help=f"which sets (default: all): {', '.join(DATASETS)}")
    parser.add_argument("--data-dir", default=None,
                        help="folder of the built-in sets' local copies (default: DPPO_DATA_DIR or ../shared/data); a "
                             "set without one is downloaded from its public Hugging Face data set")
    parser.add_argument("--skip-bad-rows", action="store_true", help="leave out rows without a usable prompt or label")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from pathlib import Path

    from datasets import Dataset, disable_progress_bars

    from megatron_dppo.data.public_sources import load_builtin
    from megatron_dppo.errors import UserInputError

    disable_progress_bars()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in args.sets:
        try:
            examples, origin = load_builtin(name, args.data_dir, args.skip_bad_rows)
        except UserInputError as error:  # PromptDataError, HubError: one line naming the set and the fix
            sys.exit(f"prepare_data.py: error: {error}")
        path = out / f"{name}.parquet"
        table = Dataset.from_dict({"prompt": [e.prompt for e in examples], "label": [e.answer for e in examples]})
        table.to_parquet(str(path))
        print(f"{name:14s} {len(examples):6d} rows  {path}  (--reward-type {DATASETS[name].reward_type}; from "
              f"{origin})", flush=True)


if __name__ == "__main__":
    main()
