"""Evaluate a model on the math benchmarks, or on your own prompt files: pass@1 (mean over k samples) and maj@k.

    --benchmarks: built-in names (from DPPO_DATA_DIR or ../shared/data, or --data-dir; else downloaded from their
                  public Hugging Face data sets, as tools/prepare_data.py does), .jsonl/.json/.parquet files,
                  directories of them, or Hugging Face data set names; all read and checked before any server starts
    --urls (SGLang or any compatible server; --tokenizer-dir the servers' model) or --model-dir (starts the embedded
    engine on the CPU, in fp32: for small models); a model is a folder or a Hub name (megatron_dppo.hub)
        ──► megatron_dppo.pipeline.evaluation.evaluate ──► <output-dir>/results.json and results.md

Examples:
    python tools/evaluate.py --urls http://node2:30000 --tokenizer-dir hf/run --benchmarks math500 --output-dir eval
    python tools/evaluate.py --model-dir ckpt/hf --benchmarks math500 gsm8k --k 4 --temperature 0.6 --output-dir eval
    python tools/evaluate.py --model-dir ckpt/hf --benchmarks data/heldout.parquet --apply-chat-template \\
        --output-dir eval
"""

import argparse
import contextlib
import json
import sys
from pathlib import Path

from megatron_dppo.data.checks import hf_model_folder
from megatron_dppo.data.datasets import BENCHMARKS, PromptDataError
from megatron_dppo.errors import UserInputError
from megatron_dppo.flags import ToolHelpFormatter
from megatron_dppo.hub import HubError, resolve_model
from megatron_dppo.pipeline.evaluation import EVALUATION_REWARDS, evaluate, load_benchmarks, markdown_table
from megatron_dppo.rewards.math import VerifierPool
from megatron_dppo.rollout.client import RolloutClient, SamplingParams
from megatron_dppo.rollout.launcher import launch_embedded_engine


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=ToolHelpFormatter)
    parser.add_argument("--benchmarks", nargs="+", default=list(BENCHMARKS), metavar="SOURCE",
                        help=f"built-in names ({', '.join(BENCHMARKS)}, ...), files, directories or hub data sets")
    parser.add_argument("--limit", type=int, default=None,
                        help="evaluate only the first N problems of each (default: all)")
    parser.add_argument("--k", type=int, default=1, help="samples per problem")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--max-new-tokens", type=int, default=1024)
    server = parser.add_mutually_exclusive_group(required=True)
    server.add_argument("--urls", nargs="+", help="rollout servers (SGLang /generate API)")
    server.add_argument("--model-dir", metavar="DIR_OR_ORG/NAME",
                        help="HF model directory or Hub name: start the embedded engine on it (CPU, fp32)")
    parser.add_argument("--tokenizer-dir", metavar="DIR_OR_ORG/NAME",
                        help="HF tokenizer directory or Hub name (default: --model-dir)")
    parser.add_argument("--output-dir", required=True, help="where results.json and results.md go")
    parser.add_argument("--apply-chat-template", action="store_true",
                        help="render prompts with the tokenizer's chat template (as the model was trained)")
    parser.add_argument("--reward-type", choices=EVALUATION_REWARDS, default="math",
                        help="the reward of your own files (built-in sets bring their own)")
    parser.add_argument("--input-key", default="prompt", help="prompt field of your own files")
    parser.add_argument("--label-key", default="label", help="reference answer field of your own files")
    parser.add_argument("--split", default="test", help="split of Hugging Face data sets")
    parser.add_argument("--skip-bad-rows", action="store_true", help="leave out rows without a usable prompt or label")
    parser.add_argument("--data-dir", default=None,
                        help="folder of the built-in sets (default: DPPO_DATA_DIR or ../shared/data)")
    parser.add_argument("--reward-workers", type=int, default=None,
                        help="math-verify worker processes (default: min(4, CPU cores))")
    parser.add_argument("--reward-timeout-s", type=float, default=5.0, help="deadline for one math-verify check")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    args = parser.parse_args(argv)
    if args.urls and not args.tokenizer_dir:
        parser.error("--urls needs --tokenizer-dir (the tokenizer the servers' model uses)")
    if args.k < 1 or (args.limit is not None and args.limit < 1):
        parser.error(f"--k ({args.k}) and --limit ({args.limit}) must be >= 1")
    try:  # a Hub name becomes its snapshot folder
        args.tokenizer_dir = args.tokenizer_dir and str(resolve_model(args.tokenizer_dir, "--tokenizer-dir"))
    except HubError as error:
        sys.exit(f"evaluate.py: error: {error}")
    if args.model_dir:
        args.model_dir, errors = hf_model_folder(args.model_dir, "--model-dir")
        if errors:
            sys.exit(f"evaluate.py: error: {errors[0]}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:  # read every benchmark before a server starts, so a bad file stops the run at once
        benchmarks = load_benchmarks(args.benchmarks, args.reward_type, args.input_key, args.label_key, args.split,
                                     args.limit, args.skip_bad_rows, args.data_dir)
    except UserInputError as error:  # PromptDataError, or HubError for a built-in set neither local nor cached
        sys.exit(f"evaluate.py: error: {error}")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_dir or args.model_dir)
    stop_token_ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else None
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_new_tokens=args.max_new_tokens,
                            stop_token_ids=stop_token_ids)
    with contextlib.ExitStack() as stack:
        if args.model_dir:
            urls = [stack.enter_context(launch_embedded_engine(args.model_dir)).url]
        else:
            urls = args.urls
        pool = stack.enter_context(VerifierPool(args.reward_workers, timeout_s=args.reward_timeout_s))
        try:
            results = evaluate(benchmarks, RolloutClient(urls), tokenizer, args.k, params, args.apply_chat_template,
                               pool, show_progress=not args.no_progress)
        except PromptDataError as error:  # a prompt the chat template (or its absence) cannot render
            sys.exit(f"evaluate.py: error: {error}")
    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    config = {key: value for key, value in vars(args).items() if key != "no_progress"}
    (output_dir / "results.json").write_text(json.dumps({"config": config, "benchmarks": results}, indent=2) + "\n")
    table = markdown_table(results)
    (output_dir / "results.md").write_text(table)
    sys.stdout.write(table)


if __name__ == "__main__":
    main()
