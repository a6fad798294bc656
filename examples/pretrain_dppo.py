"""DPPO / GRPO-family RL on Megatron-Core. Launch with torchrun; see `--help` and the README.

    torchrun --nproc-per-node 2 examples/pretrain_dppo.py            # the embedded CPU default
    torchrun --nproc-per-node 8 examples/pretrain_dppo.py --hf-checkpoint Qwen/Qwen3-4B \\
        --prompt-data data/math_train.parquet --apply-chat-template \\
        --rollout-backend external --rollout-urls http://node2:30000 ...   # your model, rolled out by SGLang
    WORLD_SIZE=8 LOCAL_WORLD_SIZE=8 python examples/pretrain_dppo.py --dry-run ...  # the plans; nothing starts

The second form is the README's "Your cluster" (its data from tools/prepare_data.py); examples/configs/ hold the
Qwen3-4B recipes, which run it under Slurm with their data step. Both run end to end in the tests on CPUs, with a
tiny model and the embedded engine in place of SGLang (tests/test_readme.py, tests/test_recipes.py); on GPUs with
SGLang they have not run yet (README, "What has run where"). The last line printed by rank 0 is a JSON summary.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
    from megatron_dppo.errors import UserInputError, require_torchrun
    from megatron_dppo.launch.arguments import parse_args
    from megatron_dppo.platform.process import exit_saying_once, is_rank0

    args = parse_args()
    try:
        if args.dry_run:  # print the launch plan and parallel layout (or why it cannot be laid out); start nothing
            from megatron_dppo.launch.launch_plan import print_plan

            print_plan(args)
            return
        require_torchrun()  # before the imports below, which take seconds
        from megatron_dppo.launch.run import run

        summary = run(args)
    except UserInputError as error:  # the user's to fix (data, launch): one line, not a traceback
        exit_saying_once(2, f"pretrain_dppo.py: error: {error}")
    if is_rank0():
        print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
