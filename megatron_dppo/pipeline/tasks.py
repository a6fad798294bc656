"""What the trainer trains on: a prompt source (ids, token ids, references) and its reward, behind one interface.

    task.next_prompts(n) → [Prompt(prompt_id, input_ids, reference)]   resumable (state_dict)
    task.score(responses, references, fields) → [float]                the reward of each decoded response (fields:
                                                                       each prompt's row, for a custom reward)
    task.heldout(n[, name]) → [Prompt]                                 never trained on: the first held-out set,
                                                                       or the set named (--eval-prompt-data NAME
                                                                       SOURCE ...; task.heldout_sets, in order)

Prompt ids are stable integers (the row index in the data set, or the index in the synthetic training pool), so
DPPO's prompt history recognises a prompt when it comes back in a later epoch; held-out ids are negative, distinct
across the held-out sets.
"""

from collections.abc import Sequence
from dataclasses import dataclass, field

from megatron_dppo.data.datasets import Example, PromptSampler

SYNTHETIC_REWARDS = {"worked": "synthetic", "answer": "synthetic_answer"}  # --synthetic-task -> its reward


@dataclass
class Prompt:
    prompt_id: int
    input_ids: list[int]
    reference: object
    text: str = ""
    difficulty: str = ""  # a stratum known before rollout (synthetic cell, MATH level/type): DPPO's prior
    fields: dict = field(default_factory=dict)  # the prompt's row (Example.fields): a custom reward's keywords


class Task:
    def __init__(self, prompts: list[Prompt], heldout: list[Prompt] | dict[str, list[Prompt]], scorer, seed: int):
        """`heldout`: one held-out set, or several by name (the first is the run's headline)."""
        self.prompts = prompts
        self.heldout_sets = heldout if isinstance(heldout, dict) else {"": heldout}
        self.scorer = scorer
        self.sampler = PromptSampler(len(prompts), seed)

    def next_prompts(self, count: int) -> list[Prompt]:
        return [self.prompts[index] for index in self.sampler.next_indices(count)]

    def heldout(self, count: int, name: str | None = None) -> list[Prompt]:
        """The first `count` prompts of the held-out set `name` (default: the first set)."""
        return self.heldout_sets[next(iter(self.heldout_sets)) if name is None else name][:count]

    def score(self, responses: list[str], references: list, fields: list[dict] | None = None) -> list[float]:
        return self.scorer(responses, references, fields if fields is not None else [{}] * len(responses))

    def state_dict(self) -> dict:
        return {"sampler": self.sampler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state["sampler"])


def synthetic_task(tokenizer, seed: int, train_size: int, heldout_size: int, cells=None, task: str = "worked",
                   scorer=None) -> Task:
    """A recurring pool of `train_size` synthetic problems (so prompts come back and history can prune them; drawn
    from a stream apart from the warm start's, data.synthetic.rl_pool_seed), and the fixed held-out split (seed
    12345, never in training), over `cells` (default: the task's). A prompt carries only its final answer, the
    reward's reference: the worked solutions are the warm start's alone. `scorer`: a custom reward in place of the
    task's own."""
    from megatron_dppo.data.synthetic import TASK_CELLS, SyntheticArithmetic, check_task, rl_pool_seed

    generator = SyntheticArithmetic(rl_pool_seed(seed), cells or TASK_CELLS[check_task(task)])

    def as_prompt(index, problem):
        return Prompt(index, tokenizer.encode(problem.prompt), problem.answer, problem.prompt, problem.cell,
                      {"prompt": problem.prompt, "cell": problem.cell})

    train = [as_prompt(i, p) for i, p in enumerate(generator.sample(train_size))]
    heldout = [as_prompt(-1 - i, p) for i, p in enumerate(generator.heldout(heldout_size))]
    return Task(train, heldout, scorer or reward_scorer(SYNTHETIC_REWARDS[task]), seed)


def dataset_task(train: Sequence[Example], heldout: Sequence[Example] | dict[str, Sequence[Example]], tokenizer,
                 seed: int, reward_type: str, apply_chat_template: bool = False, timeout_s: float = 5.0,
                 scorer=None) -> Task:
    """Training and held-out prompts from loaded examples (megatron_dppo.data.datasets.load_prompt_data), encoded
    with or without the tokenizer's chat template and scored by `reward_type` (or `scorer`, a custom reward).
    `heldout`: one set, or several by name. Training ids are the row order (0, 1, ...), held-out ids negative (-1,
    -2, ..., running on from one set to the next)."""
    from megatron_dppo.data.datasets import encode_examples

    def as_prompts(examples, ids):
        encoded = encode_examples(examples, apply_chat_template, tokenizer)
        return [Prompt(prompt_id, input_ids, example.answer, tokenizer.decode(input_ids), example.difficulty,
                       example.fields)
                for prompt_id, input_ids, example in zip(ids, encoded, examples)]

    named = heldout if isinstance(heldout, dict) else {"": heldout}
    heldout_sets, next_id = {}, -1
    for name, examples in named.items():
        heldout_sets[name] = as_prompts(examples, range(next_id, next_id - len(examples), -1))
        next_id -= len(examples)
    return Task(as_prompts(train, range(len(train))), heldout_sets if isinstance(heldout, dict) else heldout_sets[""],
                scorer or reward_scorer(reward_type, timeout_s), seed)


def reward_scorer(reward_type: str, timeout_s: float = 5.0):
    """`scorer(responses, references, fields) -> [float]` for a name of REWARD_FUNCTIONS (which read no fields); math
    checks go to one verifier pool per batch (with its per-check timeout) instead of one call at a time."""
    from megatron_dppo.rewards import REWARD_FUNCTIONS

    if reward_type not in REWARD_FUNCTIONS:
        raise ValueError(f"unknown reward type {reward_type!r}: choose one of {sorted(REWARD_FUNCTIONS)}")
    if reward_type == "math":
        from megatron_dppo.rewards.math import VerifierPool, score_batch

        pool = VerifierPool(timeout_s=timeout_s)
        return lambda responses, refs, fields=None: [
            result.score for result in score_batch(responses, [str(a) for a in refs], pool=pool)]
    compute_score = REWARD_FUNCTIONS[reward_type]
    return lambda responses, refs, fields=None: [compute_score(r, str(a)) for r, a in zip(responses, refs)]
