"""Write the built-in prompt sets as Parquet files in the layout --prompt-data reads: one row per prompt, with
`prompt` (the text the model is given, the request for a \\boxed{} answer included), `label` (the reference final
answer) and, for MATH, `difficulty` (its level and subject: --difficulty-key difficulty gives DPPO's prompt level the
prior --prompt-data math gives it). Your own data in this layout needs no other flag; with other field names pass
--input-key / --label-key.

    each set: its local copy, <data dir>/math/train.jsonl, gsm8k/..., bench/... (load_local_builtin)
              or, where there is none, its public Hugging Face data set (data/public_sources.py: downloaded into the
              Hugging Face cache; with HF_HUB_OFFLINE=1 read from it), its fields and their types checked
        ──► the set's own row parser ──► OUT/<set>.parquet (prompt, label[, difficulty])
        ──► --prompt-data OUT/math_train.parquet, --eval-prompt-data ...

Both ways give the rows their source holds, through the same row parser; the public copies are not checked row for
row against the local files (docs/data_and_rewards.md says where they are known to differ).

The data dir is DPPO_DATA_DIR, or ../shared/data beside the project, or --data-dir; docs/data_and_rewards.md lists
its files and their public sources. Each line printed names the set's rows, the bad rows left out, its file and where
the rows came from (the local file, or the Hub data set and the commit used). MATH train has two rows without a
final answer: pass --skip-bad-rows, which leaves out at most 1% of a set's rows (more, and the set is refused: its
rows are not laid out as read here). A set that cannot be written (no source reachable, a changed source, no usable
row) is reported in one line and the others are still written; the exit status is then 1.

Example:
    python tools/prepare_data.py --out data --skip-bad-rows
    python tools/prepare_data.py --out data --sets math_train math500
"""

import argparse
import sys

from megatron_dppo.data.datasets import DATASETS
from megatron_dppo.flags import ToolHelpFormatter


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=ToolHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for <set>.parquet")
    parser.add_argument("--sets", nargs="+", default=list(DATASETS), choices=list(DATASETS), metavar="SET",
                        help=f"which sets: {', '.join(DATASETS)}")
    parser.add_argument("--data-dir", default=None,
                        help="folder of the built-in sets' local copies (default: DPPO_DATA_DIR or "
                             "../shared/data); a set without one is downloaded from its public Hugging Face data set")
    parser.add_argument("--skip-bad-rows", action="store_true",
                        help="leave out rows without a usable prompt or label (at most 1%% of a set's)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from pathlib import Path

    from datasets import Dataset, disable_progress_bars

    from megatron_dppo.data.public_sources import load_builtin
    from megatron_dppo.errors import UserInputError

    disable_progress_bars()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    failed = []
    for name in args.sets:
        try:
            loaded = load_builtin(name, args.data_dir, args.skip_bad_rows)
        except UserInputError as error:  # PromptDataError, HubError: one line naming the set and the fix
            print(f"prepare_data.py: error: {error}", file=sys.stderr, flush=True)
            failed.append(name)
            continue
        examples, path = loaded.rows.examples, out / f"{name}.parquet"
        columns = {"prompt": [e.prompt for e in examples], "label": [e.answer for e in examples]}
        if any(e.difficulty for e in examples):
            columns["difficulty"] = [e.difficulty for e in examples]
        Dataset.from_dict(columns).to_parquet(str(path))
        print(f"{name:14s} {len(examples):6d} rows  {path}  ({loaded.rows.skipped} bad rows left out; --reward-type "
              f"{DATASETS[name].reward_type}; from {loaded.origin})", flush=True)
    if failed:
        print(f"prepare_data.py: error: {len(failed)} of {len(args.sets)} sets not written ({', '.join(failed)}): "
              "see their lines above", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
