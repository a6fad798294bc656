"""Resuming the optimizer, through examples/pretrain_dppo.py on 2 CPU ranks, bf16 (the recipe's precision):

    converted tiny Qwen3 ─► straight: 2 steps, saved at 2
                        ─► never stepped: --train-iters 0, saved at 0 (every update before a save skipped: no kept
                           samples, or fp16 overflows) ─► resumed to step 2, saved at 2
    with the distributed optimizer, and again without it (resumed at TP 2: its state is the model's, any layout)

- a checkpoint saved before any optimizer step resumes, and the run from it equals the straight one bitwise (the
  checkpoint holds Adam's initial state: zero moments, step 0; what Adam's first step creates itself);
- the distributed optimizer's state (dp_reshardable) loads only under the TP/PP it was saved with: under another, the
  error names the layout change and --no-load-optim, which then loads the weights alone (any TP/PP).
"""

import json
from pathlib import Path

from tests import test_mixed_precision_resume as mixed_precision
from tests.launch import REPO_ROOT, finish, start_torchrun
from tests.test_mixed_precision_resume import RUN, assert_equal, saved_tensors

ENTRY = REPO_ROOT / "examples" / "pretrain_dppo.py"
# the fixtures of the bf16/fp16 resume tests: a tiny Qwen3 (q/k norms) and its converted checkpoints (TP 1)
tiny_qwen3, converted = mixed_precision.tiny_qwen3, mixed_precision.converted


def train(model_dir: Path, load: Path, save: Path, steps: int, *flags, expect_ok: bool = True) -> str:
    process = start_torchrun(ENTRY, 2, ["--hf-checkpoint", model_dir, "--load", load, "--bf16", *RUN,
                                        "--train-iters", steps, "--save", save, "--log-dir", save / "log", *flags])
    output = finish(process, 300, "the run")
    assert (process.returncode == 0) == expect_ok, f"exit {process.returncode}:\n{output[-6000:]}"
    return output


def logged_steps(save: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (save / "log" / "metrics.jsonl").read_text().splitlines()]


def test_a_distributed_optimizer_saved_before_any_step_resumes_as_a_straight_run_and_a_layout_change_is_named(
        tiny_qwen3, converted, tmp_path):
    model_dir, start = tiny_qwen3, converted / "bf16"
    flags = ["--use-distributed-optimizer"]
    train(model_dir, start, tmp_path / "straight", 2, *flags)
    train(model_dir, start, tmp_path / "resumed", 0, *flags)
    assert (tmp_path / "resumed" / "latest").read_text().strip() == "iter_0000000"
    train(model_dir, tmp_path / "resumed", tmp_path / "resumed", 2, *flags)
    assert logged_steps(tmp_path / "resumed") == [1, 2]
    assert_equal(saved_tensors(tmp_path / "straight" / "iter_0000002", tmp_path / "straight.pt"),
                 saved_tensors(tmp_path / "resumed" / "iter_0000002", tmp_path / "resumed.pt"), "resumed")

    tp2 = ["--tensor-model-parallel-size", "2", *flags]
    output = train(model_dir, tmp_path / "straight", tmp_path / "tp2", 3, *tp2, expect_ok=False)
    errors = [line for line in output.splitlines() if line.startswith("pretrain_dppo.py: error:")]
    assert len(errors) == 1 and "]: Traceback" not in output, output[-4000:]  # one line, no rank's traceback
    for words in ("saved by the distributed optimizer under TP 1 x PP 1", "this run is TP 2 x PP 1",
                  "--no-load-optim"):
        assert words in errors[0], errors[0]
    train(model_dir, tmp_path / "straight", tmp_path / "tp2", 3, *tp2, "--no-load-optim")
    assert logged_steps(tmp_path / "tp2") == [3]  # the run's step came back; the optimizer started afresh


def test_an_optimizer_saved_before_any_step_resumes_under_another_tp_without_the_distributed_optimizer(
        tiny_qwen3, converted, tmp_path):
    model_dir, start = tiny_qwen3, converted / "bf16"
    train(model_dir, start, tmp_path / "run", 0)
    train(model_dir, tmp_path / "run", tmp_path / "run", 2, "--tensor-model-parallel-size", "2")
    assert logged_steps(tmp_path / "run") == [1, 2]
