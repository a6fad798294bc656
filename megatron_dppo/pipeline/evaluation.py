"""Benchmark evaluation: pass@1 (mean over k samples) and maj@k on the six math benchmarks or any prompt source.

    load_benchmarks: built-in name (its local copy, else its public source: load_builtin) or file / directory / hub
                     set (load_prompt_data)[:limit] ──► encode_examples
        ──► RolloutClient.agenerate(n=k) (progress bar) ──► decode
        ──► score each sample (math: math-verify pool; gsm8k: exact number) ──► aggregate
        ──► {"benchmarks": {name: {pass@1, maj@k, problems: [...]}}} and a markdown table

- pass@1 is the mean over problems of the mean score of the k samples.
- maj@k votes over the samples' parsed final answers (normalised string for math, exact number for GSM8K);
  samples without an answer do not vote; ties go to the answer seen first; a problem with no vote scores 0.
  Samples that share a vote key share a score (same answer against the same reference), so the majority's
  score is that of any of its members.
"""

import asyncio
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from tqdm import tqdm

from megatron_dppo.data.datasets import DATASETS, Example, encode_examples, load_prompt_data
from megatron_dppo.data.public_sources import load_builtin
from megatron_dppo.rewards import gsm8k as gsm8k_reward
from megatron_dppo.rewards.math import VerifierPool, normalize_answer, score_batch
from megatron_dppo.rollout.client import Completion, RolloutClient, SamplingParams

EVALUATION_REWARDS = ("math", "gsm8k")


@dataclass(frozen=True)
class Benchmark:
    examples: list[Example]
    reward: str  # one of EVALUATION_REWARDS


@dataclass(frozen=True)
class SampleScore:
    score: float
    vote_key: str | None  # the parsed answer in canonical form; None when no answer was found


def score_samples(
    reward: str, texts: Sequence[str], references: Sequence[str], pool: VerifierPool | None
) -> list[SampleScore]:
    """Score decoded samples against their references with the benchmark's reward."""
    if reward == "math":
        results = score_batch(texts, references, pool=pool)
        return [SampleScore(r.score, normalize_answer(r.answer) if r.answer else None) for r in results]
    if reward == "gsm8k":
        scores = []
        for text, reference in zip(texts, references):
            number = gsm8k_reward.final_number(text)
            vote_key = None if number is None else str(number)
            scores.append(SampleScore(gsm8k_reward.compute_score(text, reference), vote_key))
        return scores
    raise ValueError(f"unknown reward {reward!r}; choose one of {EVALUATION_REWARDS}")


def majority_score(samples: Sequence[SampleScore]) -> float:
    votes = Counter(sample.vote_key for sample in samples if sample.vote_key is not None)
    if not votes:
        return 0.0
    winner = votes.most_common(1)[0][0]  # most_common keeps first-seen order among ties
    return next(sample.score for sample in samples if sample.vote_key == winner)


def aggregate(per_problem: Sequence[Sequence[SampleScore]]) -> dict[str, float]:
    if not per_problem:
        raise ValueError("no problems to aggregate; check --limit and the benchmark file")
    pass_at_1 = sum(sum(s.score for s in samples) / len(samples) for samples in per_problem) / len(per_problem)
    maj_at_k = sum(majority_score(samples) for samples in per_problem) / len(per_problem)
    return {"pass@1": pass_at_1, "maj@k": maj_at_k}


def generate_grouped(client: RolloutClient, prompts: list[list[int]], params: SamplingParams, k: int,
                     description: str, show_progress: bool = True) -> list[list[Completion]]:
    """k completions per prompt, [prompt][sample], with a progress bar over finished samples."""

    async def collect() -> list[list[Completion]]:
        grouped: list[list[Completion | None]] = [[None] * k for _ in prompts]
        with tqdm(total=len(prompts) * k, desc=description, unit="sample", disable=not show_progress) as bar:
            async for completion in client.agenerate(prompts, params, n=k):
                grouped[completion.prompt_index][completion.sample_index] = completion
                bar.update(1)
        missing = sum(c is None for group in grouped for c in group)
        if missing:
            raise RuntimeError(f"{description}: the rollout servers returned {missing} fewer samples than asked")
        return grouped  # type: ignore[return-value]

    return asyncio.run(collect())


def evaluate_benchmark(name: str, benchmark: Benchmark, client: RolloutClient, tokenizer, k: int,
                       params: SamplingParams, apply_chat_template: bool, pool: VerifierPool | None,
                       show_progress: bool = True) -> dict:
    """Generate k samples per problem, score them, and return the summary with per-problem records."""
    examples = benchmark.examples
    prompts = encode_examples(examples, apply_chat_template, tokenizer)
    grouped = generate_grouped(client, prompts, params, k, name, show_progress)
    texts = [tokenizer.decode(c.output_ids, skip_special_tokens=True) for group in grouped for c in group]
    references = [example.answer for example in examples for _ in range(k)]
    flat = score_samples(benchmark.reward, texts, references, pool)
    per_problem = [flat[i * k : (i + 1) * k] for i in range(len(examples))]
    problems = [
        {
            "row": example.row,
            "reference": example.answer,
            "scores": [s.score for s in samples],
            "answers": [s.vote_key for s in samples],
            "finish_reasons": [c.finish_reason for c in group],
            "responses": texts[index * k : (index + 1) * k],
        }
        for index, (example, samples, group) in enumerate(zip(examples, per_problem, grouped))
    ]
    return {"num_problems": len(examples), "k": k, **aggregate(per_problem), "problems": problems}


def load_benchmarks(sources: Sequence[str], reward_type: str = "math", input_key: str = "prompt",
                    label_key: str = "label", split: str = "test", limit: int | None = None,
                    skip_bad_rows: bool = False, data_dir: str | None = None) -> dict[str, Benchmark]:
    """Each source's first `limit` problems and its reward: a built-in set's own (gsm8k for GSM8K, math for the
    others; its local copy, else its public source), `reward_type` for the user's files and hub data sets (read
    with `input_key` / `label_key`)."""
    if reward_type not in EVALUATION_REWARDS:
        raise ValueError(f"unknown evaluation reward {reward_type!r}; choose one of {EVALUATION_REWARDS}")
    benchmarks = {}
    for source in sources:
        if source in DATASETS:
            examples = load_builtin(source, data_dir, skip_bad_rows, limit).rows.examples
            benchmarks[source] = Benchmark(examples, DATASETS[source].reward_type)
        else:
            benchmarks[source] = Benchmark(load_prompt_data(source, input_key, label_key, reward_type, split,
                                                            skip_bad_rows, limit, "--benchmarks"), reward_type)
    return benchmarks


def evaluate(benchmarks: dict[str, Benchmark], client: RolloutClient, tokenizer, k: int, params: SamplingParams,
             apply_chat_template: bool = False, pool: VerifierPool | None = None, show_progress: bool = True) -> dict:
    if k < 1:
        raise ValueError(f"k={k} samples per problem must be >= 1")
    return {name: evaluate_benchmark(name, benchmark, client, tokenizer, k, params, apply_chat_template, pool,
                                     show_progress) for name, benchmark in benchmarks.items()}


def markdown_table(results: dict) -> str:
    """| benchmark | problems | k | pass@1 | maj@k |, scores in percent."""
    lines = ["| benchmark | problems | k | pass@1 (%) | maj@k (%) |", "|---|---|---|---|---|"]
    for name, summary in results.items():
        lines.append(f"| {name} | {summary['num_problems']} | {summary['k']} | {100 * summary['pass@1']:.1f} | "
                     f"{100 * summary['maj@k']:.1f} |")
    return "\n".join(lines) + "\n"
