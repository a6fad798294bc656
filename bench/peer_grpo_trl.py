"""The TRL peer's training run, in TRL's own environment (tools/setup_peer_env.sh): bench/peer_grpo.py starts it as
`<peer python> bench/peer_grpo_trl.py CONFIG --socket-fd N` and answers its reward requests. It imports nothing of
this project, whose dependencies that environment does not have.

    CONFIG (model, prompt stream, held-out set, GRPOConfig fields, budget) ─► GRPOTrainer with timers around its own
    phases; rewards and held-out scores: (prompt ids, completion ids) ─► socket pair ─► our task.score
    ─► <run dir>/metrics.jsonl (peer_step_record: our trainer's layout), summary.json, trl_args.json

Invariants: the prompts TRL tokenizes are our task's input_ids (checked first); the exported warm start scores what
ours does, within WARM_START_MISMATCH_PROBLEMS held-out problems; the prompt stream outlasts the budget.
"""

import argparse
import json
import statistics
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path

TRL_VERSION = "1.16.0"
# Both sides evaluate the same weights greedily; batch padding may flip a few argmaxes, never more than this many.
WARM_START_MISMATCH_PROBLEMS = 3
GENERATE_BATCH = 128  # held-out prompts per greedy `generate` call in the peer


# ------------------------------------------------------------------------------------------------ metrics layout
def completion_up_to_eos(token_ids: list[int], eos_ids: set[int], pad_token_id: int) -> list[int]:
    """A generated row cut after its first eos (kept, as the engine keeps its stop token), else its padding."""
    for index, token in enumerate(token_ids):
        if token in eos_ids:
            return token_ids[:index + 1]
    while token_ids and token_ids[-1] == pad_token_id:
        token_ids = token_ids[:-1]
    return token_ids


def peer_step_record(step: int, seconds_wall: float, seconds_step: float, phases: dict, rewards: list[float],
                     completion_lengths: list[int], prompt_lengths: list[int], group: int) -> dict:
    """One TRL step in our trainer's metrics.jsonl layout (experience.step_statistics and Trainer.update's names).

    phases: seconds_rollout (generate), seconds_reward, seconds_experience (TRL's whole experience making);
    update is what the step spends after the experience is made. TRL trains every sample: kept fractions are 1."""
    if not rewards or len(rewards) != len(completion_lengths) or len(rewards) % group:
        raise ValueError(f"a step needs one reward and one length per completion, in full groups of {group}: got "
                         f"{len(rewards)} rewards and {len(completion_lengths)} lengths")
    groups = [rewards[start:start + group] for start in range(0, len(rewards), group)]
    generated = sum(completion_lengths)
    return {
        "step": step, "seconds_wall": seconds_wall, "seconds_step": seconds_step,
        "seconds_rollout": phases["seconds_rollout"], "seconds_reward": phases["seconds_reward"],
        "seconds_update": max(seconds_step - phases["seconds_experience"], 0.0),
        "tokens_generated": generated,
        "tokens_per_second_rollout": generated / max(phases["seconds_rollout"], 1e-9),
        "response_length_mean": generated / len(completion_lengths),
        "tokens_trained": generated + sum(prompt_lengths),
        "reward_mean": statistics.fmean(rewards),
        "accuracy": sum(reward == 1 for reward in rewards) / len(rewards),
        "zero_variance_group_fraction": sum(len(set(g)) == 1 for g in groups) / len(groups),
        "kept_fraction": 1.0, "kept_fraction_prompts": 1.0, "kept_fraction_completions": 1.0,
        "sequences_trained": len(rewards),
    }



# ------------------------------------------------------------------------------------------------ the run
def remote_scores(connection: Connection, prompt_ids: list[int], completion_ids: list[list[int]]) -> list[float]:
    connection.send((list(prompt_ids), [list(ids) for ids in completion_ids]))
    return connection.recv()



@dataclass
class StepRecorder:
    """What the timed trainer and the reward function saw during the current step."""

    phases: dict = field(default_factory=lambda: dict.fromkeys(
        ("seconds_rollout", "seconds_reward", "seconds_experience"), 0.0))
    rewards: list = field(default_factory=list)
    completion_lengths: list = field(default_factory=list)
    prompt_lengths: list = field(default_factory=list)

    def add(self, phase: str, seconds: float) -> None:
        self.phases[phase] += seconds

    def drain(self) -> dict:
        """This step's observations; the recorder starts the next step empty."""
        taken = vars(self).copy()
        self.__init__()
        return taken


def greedy_accuracy(model, heldout: list[dict], max_new_tokens: int, eos_ids: list[int], pad_token_id: int,
                    connection: Connection) -> float:
    """Our evaluation (Trainer.evaluate) with in-process `generate`: greedy, our stop token, task.score."""
    import torch
    from transformers import GenerationConfig

    config = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=eos_ids,
                              pad_token_id=pad_token_id, disable_compile=True)
    was_training = model.training
    model.eval()
    completions = []
    for start in range(0, len(heldout), GENERATE_BATCH):
        rows = [p["input_ids"] for p in heldout[start:start + GENERATE_BATCH]]
        width = max(map(len, rows))
        input_ids = torch.tensor([[pad_token_id] * (width - len(r)) + r for r in rows])  # [B, width], left-padded
        attention_mask = (torch.arange(width)[None, :] >= torch.tensor([width - len(r) for r in rows])[:, None])
        with torch.no_grad():
            output = model.generate(input_ids=input_ids, attention_mask=attention_mask.long(),
                                    generation_config=config)
        completions += [completion_up_to_eos(row[width:].tolist(), set(eos_ids), pad_token_id) for row in output]
    model.train(was_training)
    scores = remote_scores(connection, [p["prompt_id"] for p in heldout], completions)
    return statistics.fmean(scores)


def run_trl_worker(config_path: Path, socket_fd: int) -> None:
    """The peer's training run; runs in TRL's environment and imports nothing of this project."""
    config = json.loads(config_path.read_text())
    import torch

    torch.set_num_threads(config["threads"])
    import trl
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    if trl.__version__ != TRL_VERSION:
        raise SystemExit(f"the peer environment has trl {trl.__version__}, not {TRL_VERSION}: run "
                         "tools/setup_peer_env.sh")
    started = time.perf_counter()
    connection = Connection(socket_fd)
    run_dir = Path(config["run_dir"])
    tokenizer = AutoTokenizer.from_pretrained(config["model_dir"])
    pool = {int(key): prompt for key, prompt in config["pool"].items()}
    mismatched = [key for key, prompt in pool.items()
                  if tokenizer(text=[prompt["text"]])["input_ids"][0] != prompt["input_ids"]]
    if mismatched:
        raise SystemExit(f"TRL's tokenization of {len(mismatched)} prompts (first: prompt id {mismatched[0]}) differs "
                         "from our task's input_ids: the exported tokenizer is not the one the task encodes with")
    stream = config["stream"]
    dataset = Dataset.from_dict({"prompt": [pool[i]["text"] for i in stream], "prompt_id": stream})
    recorder = StepRecorder()

    def task_score(prompts, completions, completion_ids, prompt_id, **_):
        scores = remote_scores(connection, prompt_id, completion_ids)
        recorder.rewards += scores
        return scores

    class TimedGRPOTrainer(GRPOTrainer):
        """GRPOTrainer with timers around its own phases; what it computes is unchanged."""

        def _generate_single_turn(self, prompt_ids, *args, **kwargs):
            start = time.perf_counter()
            completion_ids, logprobs = super()._generate_single_turn(prompt_ids, *args, **kwargs)
            recorder.add("seconds_rollout", time.perf_counter() - start)
            recorder.completion_lengths += [len(ids) for ids in completion_ids]
            recorder.prompt_lengths += [len(ids) for ids in prompt_ids]
            return completion_ids, logprobs

        def _calculate_rewards(self, *args, **kwargs):
            start = time.perf_counter()
            rewards = super()._calculate_rewards(*args, **kwargs)
            recorder.add("seconds_reward", time.perf_counter() - start)
            return rewards

        def _generate_and_score_completions(self, *args, **kwargs):
            start = time.perf_counter()
            output = super()._generate_and_score_completions(*args, **kwargs)
            recorder.add("seconds_experience", time.perf_counter() - start)
            return output

    evaluation = dict(heldout=config["heldout"], max_new_tokens=config["trl"]["max_completion_length"],
                      eos_ids=[tokenizer.eos_token_id], pad_token_id=tokenizer.pad_token_id, connection=connection)
    metrics_file = run_dir / "metrics.jsonl"
    metrics_file.write_text("")

    class BudgetAndEvaluation(TrainerCallback):
        """Per step: our record, greedy held-out accuracy every eval_interval steps, stop once past the budget."""

        def on_train_begin(self, args, state, control, **kwargs):
            self.rl_start = self.last = time.perf_counter()

        def on_step_end(self, args, state, control, model=None, **kwargs):
            now = time.perf_counter()
            seen = recorder.drain()
            record = peer_step_record(state.global_step, now - self.rl_start, now - self.last, seen["phases"],
                                      seen["rewards"], seen["completion_lengths"], seen["prompt_lengths"],
                                      config["trl"]["num_generations"])
            if config["eval_interval"] and state.global_step % config["eval_interval"] == 0:
                record["heldout_accuracy"] = greedy_accuracy(model, **evaluation)
            with open(metrics_file, "a") as log:
                log.write(json.dumps(record) + "\n")
            if time.perf_counter() - self.rl_start > config["budget_s"]:
                control.should_training_stop = True
            self.last = time.perf_counter()

    timer = BudgetAndEvaluation()
    trainer = TimedGRPOTrainer(model=config["model_dir"], reward_funcs=task_score, args=GRPOConfig(**config["trl"]),
                               train_dataset=dataset, processing_class=tokenizer, callbacks=[timer])
    (run_dir / "trl_args.json").write_text(trainer.args.to_json_string())  # every field TRL ran with
    before = greedy_accuracy(trainer.model, **evaluation)
    expected = config["expected_accuracy_before"]
    if expected is not None and abs(before - expected) * len(config["heldout"]) > WARM_START_MISMATCH_PROBLEMS:
        raise SystemExit(f"the exported warm start scores {before:.4f} held-out accuracy in TRL's environment, ours "
                         f"{expected:.4f}: the export or the evaluation differs; the comparison would be void")
    trainer.train()
    seconds_rl = time.perf_counter() - timer.rl_start
    steps = trainer.state.global_step
    if seconds_rl <= config["budget_s"] and steps >= config["trl"]["max_steps"]:
        raise SystemExit(f"the peer used up its {steps}-step prompt stream before the budget: lower "
                         "MIN_STEP_SECONDS in bench/peer_grpo.py")
    after = greedy_accuracy(trainer.model, **evaluation)
    summary = {"heldout_accuracy_before": round(before, 4), "heldout_accuracy_after": round(after, 4), "steps": steps,
               "seconds": round(time.perf_counter() - started, 1), "seconds_rl": seconds_rl}
    (run_dir / "summary.json").write_text(json.dumps(summary))
    print(json.dumps(summary), flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", help="the run's config.json, written by bench/peer_grpo.py")
    parser.add_argument("--socket-fd", type=int, required=True, help="this end of the reward service's socket pair")
    args = parser.parse_args(argv)
    run_trl_worker(Path(args.config), args.socket_fd)


if __name__ == "__main__":
    main()
