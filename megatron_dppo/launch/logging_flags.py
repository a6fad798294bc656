"""What a run leaves to read besides metrics.jsonl (arguments.py adds these flags to the trainer's parser): its
Weights & Biases run (Megatron-LM's --wandb-project, --wandb-exp-name, --wandb-save-dir; W&B's entity and group; a
table of sample rollouts) and each step's rollouts as JSONL (slime's --save-debug-rollout-data).

    argv ─► add_flags (parse) ─► errors (one line per flag given without the one it needs)
         ─► launch/run.py: metrics.WandbRun and metrics.MetricsLogger read them; pipeline/rollout_records.py
            decides at which steps a step's rollouts are recorded

Like arguments.py, it imports no torch.
"""

import argparse

from megatron_dppo.flags import COUNT, COUNT_OR_NONE
from megatron_dppo.metrics import wandb_project_flag

WANDB_ONLY = ("--wandb-exp-name", "--wandb-save-dir", "--wandb-entity", "--wandb-group",
              "--wandb-rollout-table-rows", "--wandb-rollout-table-interval")


def add_flags(parser: argparse.ArgumentParser) -> None:
    logging = parser.add_argument_group("logging (Weights & Biases, rollout records; metrics.jsonl: --log-dir)")
    logging.add_argument("--wandb-project", type=wandb_project_flag, help="also log the metrics TensorBoard gets to "
                         "this Weights & Biases project (pip install -e '.[wandb]'; WANDB_MODE=offline: on disk)")
    logging.add_argument("--wandb-entity", help="the W&B team or user the run belongs to (default: W&B's default "
                         "entity of the logged-in user)")
    logging.add_argument("--wandb-group", help="the W&B group of the run (e.g. one name for the runs of a comparison)")
    logging.add_argument("--wandb-exp-name", help="the W&B run's name (default: W&B picks one)")
    logging.add_argument("--wandb-save-dir", help="where W&B keeps the run's files (default: --log-dir/wandb)")
    logging.add_argument("--wandb-rollout-table-rows", type=COUNT_OR_NONE, default=4,
                         help="rows of the W&B table of sample rollouts (prompt, response, reward, finish reason, "
                              "weight), one response of each of the first prompts; 0: no table")
    logging.add_argument("--wandb-rollout-table-interval", type=COUNT, default=10,
                         help="log the table of sample rollouts every N steps")
    logging.add_argument("--save-debug-rollout-data", metavar="DIR", default=None,
                         help="write every step's rollouts to DIR/step_NNNNNN.jsonl from rank 0, one JSON row per "
                              "response: prompt and response text and ids, reward (and a custom reward's other "
                              "keys), finish reason, advantage, DPPO's prompt keep probability and training weight "
                              "(0: not trained); slime's flag")


def errors(args: argparse.Namespace, given: list[str]) -> list[str]:
    """The W&B flags that need --wandb-project, given without it (`given`: those of WANDB_ONLY whose value is not
    the parser's default)."""
    if args.wandb_project:
        return []
    return [f"{flag} sets up the W&B run, which needs --wandb-project NAME: add it or drop {flag}" for flag in given]
