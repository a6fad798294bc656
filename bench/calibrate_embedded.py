"""Calibrate the embedded default: for each setting of a grid, what the no-argument command gives, and what a
supervised control on the same warm-start data gives for the same extra wall time, overall and per difficulty cell.

    --grid FLAG=V1,V2 ... (any pretrain_dppo flag: warm-start-steps, warm-start-problems, warm-start-cells,
        embedded-hidden-size, embedded-num-layers, time-budget-s, lr, ...) ─► settings = the cartesian product
    each setting, on the embedded default plus its flags:
      1. RL: examples/pretrain_dppo.py with a cache of its own, so the warm start is built inside the run as on a
         fresh clone ─► its JSON line (held-out accuracy before / after, steps, seconds) and final checkpoint
      2. control: the same warm start lengthened by the RL run's RL seconds x the warm start's own supervised
         steps per second (warm_start.json beside its checkpoint); same data flags and seed, so the same problems
      3. per cell: greedy held-out accuracy of the warm start, the RL result and the control (checkpoints exported to
         HF, generated with transformers; the task's hash-reserved held-out prompts, never trained on)
    ─► a table per setting and a per-cell table ─► last line `rl_minus_control: X` (the best setting, in points)

Runs are resumable (a run whose directory holds summary.json with the same command is read, not re-run).
"Seconds" is the trainer's own clock from start-up to the JSON line (interpreter start and imports excluded);
measure on an idle machine: the control's step count comes from the warm start's measured speed.

Examples:
    python bench/calibrate_embedded.py --grid warm-start-steps=300,600 warm-start-problems=500,2000
    python bench/calibrate_embedded.py --grid embedded-hidden-size=128,192 --common "--time-budget-s 240"
    python bench/calibrate_embedded.py --grid warm-start-cells=2x1:3x1:4x1,2x1:3x1:4x1:6x1:8x1 --no-control
"""

import argparse
import itertools
import json
import shlex
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.markdown_table import markdown  # noqa: E402
from bench.training_run import launch_unless_finished  # noqa: E402
from megatron_dppo.launch.arguments import parse_args as parse_training_args  # noqa: E402


def parse_grid(items: list[str]) -> list[list[str]]:
    """['warm-start-steps=300,600', 'warm-start-cells=2x1:3x1'] -> the flags of every setting of the product;
    ':' separates the words of one value (a flag that takes several)."""
    axes = []
    for item in items:
        name, separator, values = item.partition("=")
        if not separator or not name or not values:
            raise ValueError(f"--grid item {item!r} must read FLAG=V1,V2 (e.g. warm-start-steps=300,600)")
        axes.append([[f"--{name.removeprefix('--')}", *value.split(":")] for value in values.split(",")])
    return [[flag for part in combination for flag in part] for combination in itertools.product(*axes)]


def setting_name(flags: list[str]) -> str:
    return "_".join(token.removeprefix("--").replace("-", "") for token in flags) or "default"


def heldout_by_cell(cells: tuple[str, ...], count: int) -> dict[str, list]:
    from megatron_dppo.data.synthetic import SyntheticArithmetic

    return {cell: SyntheticArithmetic(seed=0, cells=[cell]).heldout(count) for cell in cells}


def accuracy_by_cell(checkpoint: Path, tokenizer_dir: Path, out_dir: Path, problems: dict[str, list], task: str,
                     max_new_tokens: int) -> dict[str, float]:
    """Greedy held-out accuracy per cell of a Megatron checkpoint, exported to HF and generated with transformers."""
    import torch
    from transformers import AutoModelForCausalLM

    from megatron_dppo.actor.conversion import megatron_to_hf
    from megatron_dppo.data.tokenizer import CharTokenizer
    from megatron_dppo.pipeline.tasks import SYNTHETIC_REWARDS, reward_scorer
    from megatron_dppo.rewards import RewardRow

    if not (out_dir / "config.json").is_file():
        megatron_to_hf(checkpoint, out_dir, tokenizer_dir=tokenizer_dir)
    tokenizer = CharTokenizer.from_pretrained(out_dir)
    model = AutoModelForCausalLM.from_pretrained(out_dir).eval()
    score = reward_scorer(SYNTHETIC_REWARDS[task])
    result = {}
    for cell, cell_problems in problems.items():
        prompts = [tokenizer.encode(p.prompt) for p in cell_problems]
        width = max(map(len, prompts))
        input_ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(ids)) + ids for ids in prompts])  # [N, W]
        attention_mask = (input_ids != tokenizer.pad_token_id).long()
        with torch.no_grad():
            generated = model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=False,
                                       max_new_tokens=max_new_tokens, eos_token_id=tokenizer.eos_token_id,
                                       pad_token_id=tokenizer.pad_token_id)
        responses = [tokenizer.decode([t for t in row[width:].tolist() if t != tokenizer.pad_token_id])
                     for row in generated]
        result[cell] = statistics.fmean(score(responses, [RewardRow(str(p.answer), {}) for p in cell_problems]).scores)
    return result


def calibrate(flags: list[str], args: argparse.Namespace) -> dict:
    """RL and control for one setting; returns its row values and per-cell accuracies."""
    from megatron_dppo.launch.embedded import WARM_START_RECORD, rl_cells

    out = Path(args.out_dir) / setting_name(flags)
    common = [*shlex.split(args.common), *flags, "--seed", str(args.seed)]
    training = parse_training_args(common)
    rl_dir = launch_unless_finished([*common, "--cache-dir", str(out / "cache"), "--save", str(out / "rl_ckpt")],
                                    out / "rl", args.processes)
    rl = json.loads((rl_dir / "summary.json").read_text())
    warm_start = next((out / "cache").glob("embedded_*/warm_start"))
    record = json.loads((warm_start / WARM_START_RECORD).read_text())
    row = {"setting": " ".join(flags) or "(default)", "seconds": rl["seconds"], "warm_s": record["seconds"],
           "steps": rl["steps"], "before": rl["heldout_accuracy_before"], "after": rl["heldout_accuracy_after"]}
    checkpoints = {"warm start": warm_start, "RL": out / "rl_ckpt"}
    if not args.no_control:
        extra_steps = round(rl["seconds_rl"] * record["steps"] / record["seconds"])
        control_dir = launch_unless_finished(
            [*common, "--warm-start-steps", str(training.warm_start_steps + extra_steps), "--train-iters", "0",
             "--cache-dir", str(out / "control_cache")], out / "control", args.processes)
        row["control"] = json.loads((control_dir / "summary.json").read_text())["heldout_accuracy_before"]
        row["control_steps"] = training.warm_start_steps + extra_steps
        checkpoints["control"] = next((out / "control_cache").glob("embedded_*/warm_start"))
    init = next((out / "cache").glob("embedded_*/init"))
    problems = heldout_by_cell(rl_cells(training), args.cell_eval_size)
    cells = {name: accuracy_by_cell(path, init, out / "hf" / name.replace(" ", "_"), problems,
                                    training.synthetic_task, training.rollout_max_response_len)
             for name, path in checkpoints.items()}
    return {"row": row, "cells": cells}


def report(results: list[dict], control: bool) -> tuple[str, float | None]:
    header = ["setting", "seconds (warm start)", "RL steps", "held-out before → after", "gain (points)"]
    if control:
        header += ["control (its warm-start steps)", "RL − control (points)"]
    rows, margins = [], []
    for result in results:
        row = result["row"]
        line = [row["setting"], f"{row['seconds']:.0f} ({row['warm_s']:.0f})", str(row["steps"]),
                f"{row['before']:.3f} → {row['after']:.3f}", f"{100 * (row['after'] - row['before']):+.1f}"]
        if control:
            margins.append(100 * (row["after"] - row["control"]))
            line += [f"{row['control']:.3f} ({row['control_steps']})", f"{margins[-1]:+.1f}"]
        rows.append(line)
    sections = [markdown(header, rows)]
    for result in results:
        cells = result["cells"]
        names = list(cells)
        cell_rows = [[cell, *(f"{cells[name][cell]:.2f}" for name in names)] for cell in cells["RL"]]
        cell_rows.append(["mean", *(f"{statistics.fmean(cells[name].values()):.3f}" for name in names)])
        sections.append(f"Per cell, greedy, {result['row']['setting']}:\n\n" + markdown(["cell", *names], cell_rows))
    return "\n\n".join(sections), (max(margins) if margins else None)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--grid", nargs="*", default=[], help="FLAG=V1,V2 items; ':' joins a value's words")
    parser.add_argument("--common", default="", help="flags every run gets, as one string (e.g. '--eval-size 256')")
    parser.add_argument("--seed", type=int, default=1234, help="--seed of every run (the warm start's and RL's)")
    parser.add_argument("--cell-eval-size", type=int, default=64, help="held-out problems per cell")
    parser.add_argument("--no-control", action="store_true", help="skip the supervised control")
    parser.add_argument("--processes", type=int, default=2, help="torchrun --nproc-per-node")
    parser.add_argument("--out-dir", default="runs/calibrate_embedded")
    args = parser.parse_args(argv)
    if args.cell_eval_size < 1:
        parser.error(f"--cell-eval-size {args.cell_eval_size} must be >= 1")
    try:
        settings = parse_grid(args.grid)
    except ValueError as error:
        parser.error(str(error))
    results = []
    for flags in settings:
        results.append(calibrate(flags, args))
        print(f"finished {' '.join(flags) or '(default)'}", flush=True)
    table, best = report(results, not args.no_control)
    print(table)
    print(f"rl_minus_control: {best:.1f}" if best is not None else "rl_minus_control: nan")


if __name__ == "__main__":
    main()
