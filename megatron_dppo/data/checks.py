"""The model folder and the prompt flags, checked before any process starts, and the defaults the data decides.

    --hf-checkpoint DIR or ORG/NAME (tools/evaluate.py: --model-dir) ─► hf_model_folder: a Hub name resolved to its
        snapshot (hub.py) ─► hf_checkpoint_errors: config.json, a tokenizer, weights
    the prompt flags ─► prompt_data_errors: the synthetic task takes none of a user's prompt flags, a built-in set
                        none of those naming fields ─► --reward-type against the data, a held-out set for the reward
                     ─► --eval-prompt-data SOURCE, or NAME SOURCE [NAME SOURCE ...] (slime's form) ─► eval_sets
                     ─► each source (--prompt-data, each held-out set): resolve_source (built-in files present, local
                        files readable by suffix; a hub name is checked when it is loaded), a split and a
                        configuration only for a Hugging Face data set (on the Hub, or a folder of one)
    no --reward-type ─► default_reward_type (the built-in set's, math for your own prompts)
    no --eval-prompt-data ─► default_eval_prompt_data (the reward's held-out set)

Invariants:
- each problem is one line naming the flag, the input and the fix, returned (not raised), so that the trainer's flag
  checks (arguments.py) report every problem of a command line at once;
- imports nothing of the trainer's flags, nor torch: arguments.py imports it, and parsing runs before every launch;
  which flags were given comes from the trainer's parser, which holds their defaults.
"""

import argparse
import re
from pathlib import Path

from megatron_dppo.data.datasets import (
    DATASETS,
    HELDOUT_SETS,
    TRAINING_SETS,
    PromptDataError,
    config_error,
    resolve_source,
)
from megatron_dppo.hub import HubError, resolve_model

HF_MODEL_FILES = "config.json, tokenizer files and *.safetensors"
# the fields (and hub split and configuration) of a user's own prompts: neither the synthetic task nor a built-in set
# takes them
OWN_PROMPT_FLAGS = ("--input-key", "--label-key", "--difficulty-key", "--prompt-data-split", "--prompt-data-config")
# the flags prompt_data_errors asks about whether they were given (set away from their defaults)
PROMPT_FLAGS = (*OWN_PROMPT_FLAGS, "--apply-chat-template", "--eval-prompt-data", "--eval-prompt-data-split",
                "--eval-prompt-data-config")
HELDOUT_METRIC = "heldout_accuracy"  # the first held-out set's accuracy; a named set's also as heldout_accuracy/NAME
_SET_NAME = re.compile(r"[\w.-]+")


def default_reward_type(prompt_data: str) -> str:
    """The reward of a built-in set (synthetic for the synthetic task), math for the user's own prompts."""
    if prompt_data == "synthetic":
        return "synthetic"
    name = TRAINING_SETS.get(prompt_data, prompt_data)
    return DATASETS[name].reward_type if name in DATASETS else "math"


def default_eval_prompt_data(prompt_data: str, reward_type: str) -> str | None:
    """The held-out set of the reward (math500, gsm8k_test); the synthetic task has its own."""
    return None if prompt_data == "synthetic" else HELDOUT_SETS.get(reward_type)


def eval_sets(values: list[str] | None, default: str | None) -> list[tuple[str, str]]:
    """--eval-prompt-data as (name, source) pairs, in the order given: one SOURCE (or none: `default`, the reward's
    held-out set) is the run's held-out set, name "" (logged as heldout_accuracy); NAME SOURCE [NAME SOURCE ...]
    (slime's form) names each, logged as heldout_accuracy/NAME (the first also as heldout_accuracy). Raises
    ValueError, one line, for any other count or a name that is not a plain word or is given twice."""
    if not values:
        return [] if default is None else [("", default)]
    if len(values) == 1:
        return [("", values[0])]
    if len(values) % 2:
        raise ValueError(f"--eval-prompt-data takes one SOURCE, or NAME SOURCE pairs (slime's form), but got "
                         f"{len(values)} values: {' '.join(values)}; give each set a name")
    pairs = list(zip(values[::2], values[1::2]))
    names = [name for name, _ in pairs]
    for name in names:
        fault = "given twice" if names.count(name) > 1 else None if _SET_NAME.fullmatch(name) else "not a plain word"
        if fault:
            raise ValueError(f"--eval-prompt-data: the set name {name!r} is {fault}; each NAME is a word of letters, "
                             f"digits, '.', '_' or '-' that names one set (its metric is {HELDOUT_METRIC}/NAME)")
    return pairs


def eval_metric(name: str) -> str:
    """The metric a held-out set's accuracy is logged as: heldout_accuracy, or heldout_accuracy/NAME."""
    return f"{HELDOUT_METRIC}/{name}" if name else HELDOUT_METRIC


def hf_model_folder(name: str, flag: str = "--hf-checkpoint") -> tuple[str, list[str]]:
    """(the model's folder, its problems): a Hub name resolved to its snapshot (megatron_dppo.hub: downloaded, or
    from the cache offline), then the folder checked by hf_checkpoint_errors."""
    try:
        folder = str(resolve_model(name, flag))
    except HubError as error:
        return name, [str(error)]
    return folder, hf_checkpoint_errors(folder, flag)


def hf_checkpoint_errors(path: str, flag: str = "--hf-checkpoint") -> list[str]:
    """--hf-checkpoint must be a Hugging Face model folder (a Hub name is resolved to its snapshot first, by
    megatron_dppo.hub): the trainer reads its config, tokenizer and weights, and the rollout servers load it."""
    directory = Path(path).expanduser()
    if not directory.is_dir():
        return [f"{flag} {path}: no such directory; pass the local folder of a Hugging Face model "
                f"({HF_MODEL_FILES}), e.g. one written by save_pretrained, or its Hub name ORG/NAME"]
    missing = [what for what, present in (
        ("config.json", (directory / "config.json").is_file()),
        ("tokenizer (tokenizer.json or tokenizer_config.json)",
         any((directory / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json"))),
        ("*.safetensors weights", any(directory.glob("*.safetensors")))) if not present]
    if missing:
        return [f"{flag} {path} has no {', no '.join(missing)}: pass the folder of a complete Hugging Face "
                f"model ({HF_MODEL_FILES})"]
    return []


def prompt_data_errors(args: argparse.Namespace, given: list[str]) -> list[str]:
    """The trainer's prompt flags (`args`): which apply to which source, the reward against the data, and the sources
    themselves unless --dry-run. `given`: those of PROMPT_FLAGS set away from their defaults."""
    own_prompt_flags = [flag for flag in OWN_PROMPT_FLAGS if flag in given]
    errors = []
    if args.prompt_data == "synthetic":
        if args.reward_type not in (None, "synthetic"):
            errors.append(f"--reward-type {args.reward_type} does not score --prompt-data synthetic: drop it (the "
                          "synthetic task has its own reward) or pass the prompts it scores")
        for_prompt_files = [flag for flag in (*OWN_PROMPT_FLAGS, "--apply-chat-template", "--eval-prompt-data")
                            if flag in given]
        errors.extend(f"{flag} does not apply to --prompt-data synthetic (the task builds its own prompts and held-out "
                      "set): drop it" for flag in for_prompt_files)
        return errors
    if TRAINING_SETS.get(args.prompt_data, args.prompt_data) in DATASETS:  # a built-in set
        if args.reward_type == "synthetic":
            errors.append(f"--reward-type synthetic does not score --prompt-data {args.prompt_data}: the synthetic "
                          "reward wants '<integer>$' answers; use math or gsm8k")
        errors.extend(f"{flag} applies to your own prompt files; the built-in set {args.prompt_data} has its own "
                      "fields: drop it" for flag in own_prompt_flags)
    reward_type = args.reward_type or default_reward_type(args.prompt_data)
    try:
        held_out = eval_sets(args.eval_prompt_data, default_eval_prompt_data(args.prompt_data, reward_type))
    except ValueError as error:
        return [*errors, str(error)]
    if not held_out:
        errors.append(f"--reward-type {reward_type} has no built-in held-out set: pass --eval-prompt-data SOURCE")
    if args.dry_run:
        return errors
    errors.extend(prompt_source_errors("--prompt-data", args.prompt_data, args.prompt_data_split,
                                       "--prompt-data-split" in given, args.prompt_data_config, training=True))
    for name, source in held_out:
        chosen_by = f"held-out set {name}: " if name else "" if args.eval_prompt_data else (
            f"held-out prompts (--eval-prompt-data defaults to {source} for --reward-type {reward_type}; "
            "pass your own held-out file with --eval-prompt-data): ")
        errors.extend(prompt_source_errors("--eval-prompt-data", source, args.eval_prompt_data_split,
                                           "--eval-prompt-data-split" in given, args.eval_prompt_data_config,
                                           training=False, chosen_by=chosen_by))
    return errors


def prompt_source_errors(flag: str, source: str, split: str, split_given: bool, config: str | None, training: bool,
                         chosen_by: str = "") -> list[str]:
    """The source of `flag` can be read, and its split (`flag`-split) and configuration (`flag`-config) are given
    only for a Hugging Face data set, the one kind read by split and configuration. `chosen_by` says how a source the
    user did not give was chosen, before the error naming it."""
    try:
        resolved = resolve_source(source, flag, training=training, config=config)
    except PromptDataError as error:
        return [f"{chosen_by}{error}"]
    if problem := config_error(resolved, flag, config):
        return [f"{chosen_by}{problem}"]
    if resolved.kind != "hub" and split_given:
        return [f"{chosen_by}{flag}-split {split} applies to Hugging Face data sets; {source} is read whole: drop it"]
    return []
