"""Partial rollouts (partial_rollouts.py) through the trainer's own ExperienceMaker, against a scripted engine whose
every sample is a fixed function of its seed (so chunking can only reveal it in pieces): every started sample is
trained once or counted, carried tokens keep the log-prob and version that sampled them, the staleness bound holds,
the trained response lengths are those of synchronous rollouts, and the state round-trips through a checkpoint."""

import copy
import pickle
from collections import Counter

import pytest

from megatron_dppo.data.tokenizer import CharTokenizer
from megatron_dppo.launch.arguments import parse_args
from megatron_dppo.pipeline.experience import ExperienceMaker
from megatron_dppo.pipeline.tasks import synthetic_task
from megatron_dppo.rollout.client import Completion

GROUP, BATCH, MAX_LEN = 4, 6, 176  # the worked task's response limit


class ScriptedEngine:
    """Sample with seed s: response length 1 + s % 150, tokens 3 + (s + k) % 10 and the
    end marker last; the log-prob of position k under weight version v is -(v + 1) / 100 - k / 10^4. `version` is the
    weight version it holds (the test moves it as a weight sync would)."""

    def __init__(self, eos: int):
        self.eos, self.version, self.requests = eos, 0, []

    def full_response(self, seed: int) -> list[int]:
        length = 1 + seed % 150
        return [3 + (seed + k) % 10 for k in range(length - 1)] + [self.eos]

    def logprob(self, position: int) -> float:
        return -(self.version + 1) / 100 - position / 10**4

    def generate_requests(self, requests, params):
        completions = []
        for index, request in enumerate(requests):
            prefix = request.input_ids[len(self.prompt_of(request.input_ids)):]
            full = self.full_response(request.seed)
            assert full[:len(prefix)] == prefix, "a continued sample must resume its own response"
            new = full[len(prefix):len(prefix) + request.max_new_tokens]
            reason = "stop" if new and new[-1] == self.eos else "length"
            completions.append(Completion(index, 0, new, [self.logprob(len(prefix) + k) for k in range(len(new))],
                                          reason, None))
        self.requests.append(len(requests))
        return completions

    def generate(self, prompts, params, n=1):  # a synchronous step: one request per prompt x n, seeded alike
        from megatron_dppo.rollout.client import seeded_requests

        completions = self.generate_requests(seeded_requests(prompts, 0, params, n), params)
        for index, completion in enumerate(completions):
            completion.prompt_index, completion.sample_index = index // n, index % n
        return completions

    def prompt_of(self, input_ids):
        return next(prompt for prompt in self.prompts if input_ids[:len(prompt)] == prompt)


def maker_for(flags: list[str]) -> tuple[ExperienceMaker, ScriptedEngine]:
    args = parse_args(["--rollout-batch-size", str(BATCH), "--n-samples-per-prompt", str(GROUP),
                       "--rollout-max-response-len", str(MAX_LEN), "--data-train-size", "64", "--algorithm", "grpo",
                       "--no-dapo-filter", *flags])
    tokenizer = CharTokenizer.for_synthetic_task()
    task = synthetic_task(tokenizer, 0, 64, 4)
    engine = ScriptedEngine(tokenizer.eos_token_id)
    engine.prompts = [p.input_ids for p in task.prompts]
    return ExperienceMaker(args, task, tokenizer, engine), engine


def run_steps(maker: ExperienceMaker, engine: ScriptedEngine, steps: int, first: int = 1) -> list:
    """Steps first..first+steps-1 as the trainer runs them: rollouts, experience, then the weight sync's version."""
    trained = []
    for step in range(first, first + steps):
        rollouts = maker.generate(step)
        maker.make(rollouts, step, 0.0)
        trained.append((step, maker.weight_version, rollouts))
        maker.weight_version = engine.version = step
    return trained


def sample_keys(rollouts) -> list:
    return [(prompt.prompt_id, seed_index) for prompt in rollouts.prompts for seed_index in range(GROUP)]


@pytest.mark.parametrize("staleness", [0, 1, 2])
def test_every_started_sample_is_trained_once_or_counted_open_at_the_end(staleness):
    maker, engine = maker_for(["--partial-rollout", "--partial-rollout-chunk-tokens", "5",
                               "--partial-rollout-max-staleness", str(staleness)])
    trained = run_steps(maker, engine, 12)
    counts = maker.partial.counts
    assert counts["samples_trained"] == sum(len(r.output_ids) for _, _, r in trained) == 12 * BATCH * GROUP
    assert counts["samples_started"] == counts["samples_trained"] + maker.partial.samples_in_flight()
    assert maker.partial.samples_in_flight() == staleness * BATCH * GROUP
    # each draw trains exactly once: the trained cohorts are draws 1..12 in order, none twice
    assert [r.prompt_decision is not None for _, _, r in trained] == [True] * 12
    ids = [tuple(sorted(p.prompt_id for p in r.prompts)) for _, _, r in trained]
    synchronous, sync_engine = maker_for([])
    assert ids == [tuple(sorted(p.prompt_id for p in r.prompts)) for _, _, r in run_steps(synchronous, sync_engine,
                                                                                          12)]


def test_carried_tokens_keep_the_logprob_and_version_of_the_weights_that_sampled_them():
    maker, engine = maker_for(["--partial-rollout", "--partial-rollout-chunk-tokens", "4",
                               "--partial-rollout-max-staleness", "2"])
    carried_versions = set()
    for _, version, rollouts in run_steps(maker, engine, 10):
        for ids, logprobs, versions in zip(rollouts.output_ids, rollouts.output_logprobs, rollouts.output_versions):
            assert len(ids) == len(logprobs) == len(versions)
            assert versions == sorted(versions) and max(versions, default=version) <= version
            for position, (logprob, sampled_by) in enumerate(zip(logprobs, versions)):
                assert logprob == pytest.approx(-(sampled_by + 1) / 100 - position / 10**4)
            carried_versions.add(len(set(versions)))
    assert max(carried_versions) > 1, "no sample was continued under newer weights"


@pytest.mark.parametrize("staleness", [0, 1, 3])
def test_no_token_is_older_than_the_staleness_bound_when_it_trains(staleness):
    maker, engine = maker_for(["--partial-rollout", "--partial-rollout-chunk-tokens", "3",
                               "--partial-rollout-max-staleness", str(staleness)])
    ages = [version - v for _, version, rollouts in run_steps(maker, engine, 10)
            for versions in rollouts.output_versions for v in versions]
    assert max(ages) == staleness  # reached (short chunks), never exceeded


def test_a_run_resumed_with_a_smaller_bound_restarts_the_carried_samples_past_it_and_counts_them():
    maker, engine = maker_for(["--partial-rollout", "--partial-rollout-chunk-tokens", "3",
                               "--partial-rollout-max-staleness", "3"])
    run_steps(maker, engine, 4)
    state = pickle.loads(pickle.dumps(maker.partial.state_dict()))
    resumed, resumed_engine = maker_for(["--partial-rollout", "--partial-rollout-chunk-tokens", "3",
                                         "--partial-rollout-max-staleness", "1"])
    resumed.partial.load_state_dict(state)
    resumed.weight_version = resumed_engine.version = 4
    resumed.task.load_state_dict(maker.task.state_dict())
    trained = run_steps(resumed, resumed_engine, 6, first=5)
    assert resumed.partial.counts["samples_restarted"] > 0 and resumed.partial.counts["tokens_discarded"] > 0
    assert max(version - v for _, version, r in trained for vs in r.output_versions for v in vs) <= 3
    assert max(version - v for _, version, r in trained[3:] for vs in r.output_versions for v in vs) <= 1
    started, trained_count = resumed.partial.counts["samples_started"], resumed.partial.counts["samples_trained"]
    assert started == trained_count + resumed.partial.samples_in_flight()


def test_trained_response_lengths_are_those_of_synchronous_rollouts():
    """Closing a step early favours short responses within it; carrying the rest trains every one later, so over a
    run the trained lengths are the synchronous run's: here exactly, sample for sample (the engine is scripted)."""
    partial, engine = maker_for(["--partial-rollout", "--partial-rollout-chunk-tokens", "4",
                                 "--partial-rollout-max-staleness", "2"])
    synchronous, sync_engine = maker_for([])
    lengths = [Counter(len(ids) for _, _, r in run_steps(maker, e, 15) for ids in r.output_ids)
               for maker, e in ((partial, engine), (synchronous, sync_engine))]
    assert lengths[0] == lengths[1]
    assert max(lengths[0]) > 100  # long responses (up to the scripted 150) are in the trained set


def test_with_staleness_0_and_whole_chunks_partial_rollouts_are_synchronous_rollouts():
    partial, engine = maker_for(["--partial-rollout", "--partial-rollout-chunk-tokens", str(MAX_LEN),
                                 "--partial-rollout-max-staleness", "0"])
    synchronous, sync_engine = maker_for([])
    for (_, _, a), (_, _, b) in zip(run_steps(partial, engine, 5), run_steps(synchronous, sync_engine, 5)):
        assert a.output_ids == b.output_ids and a.output_logprobs == b.output_logprobs
        assert a.rewards.equal(b.rewards) and a.output_versions == b.output_versions


def test_a_step_runs_fewer_chunks_than_its_longest_response_needs():
    maker, engine = maker_for(["--partial-rollout", "--partial-rollout-chunk-tokens", "4",
                               "--partial-rollout-max-staleness", "2"])
    trained = run_steps(maker, engine, 20)
    chunks = [r.stats["partial_chunks"] for _, _, r in trained[5:]]
    longest = max(len(ids) for _, _, r in trained for ids in r.output_ids)
    assert sum(chunks) / len(chunks) < 0.6 * -(-longest // 4)


def test_open_cohorts_survive_a_checkpoint_and_continue_exactly():
    flags = ["--partial-rollout", "--partial-rollout-chunk-tokens", "4", "--partial-rollout-max-staleness", "2"]
    straight, engine = maker_for(flags)
    expected = run_steps(straight, engine, 9)
    first, first_engine = maker_for(flags)
    run_steps(first, first_engine, 4)
    saved = pickle.loads(pickle.dumps({"partial": first.partial.state_dict(), "task": first.task.state_dict(),
                                       "history": first.history.state_dict()}))
    resumed, resumed_engine = maker_for(flags)
    resumed.partial.load_state_dict(saved["partial"])
    resumed.task.load_state_dict(saved["task"])
    resumed.history.load_state_dict(saved["history"])
    resumed.weight_version = resumed_engine.version = 4
    for (_, _, a), (_, _, b) in zip(expected[4:], run_steps(resumed, resumed_engine, 5, first=5)):
        assert [p.prompt_id for p in a.prompts] == [p.prompt_id for p in b.prompts]
        assert a.output_ids == b.output_ids and a.output_versions == b.output_versions
        assert a.output_logprobs == b.output_logprobs


def test_partial_rollout_flags_are_checked():
    with pytest.raises(SystemExit):
        parse_args(["--partial-rollout-chunk-tokens", "8"])  # without --partial-rollout
    with pytest.raises(SystemExit):
        parse_args(["--partial-rollout", "--algorithm", "grpo", "--dapo-dynamic-sampling"])
    with pytest.raises(SystemExit):
        parse_args(["--partial-rollout", "--partial-rollout-chunk-tokens", "0"])
    assert copy.copy(parse_args(["--partial-rollout"])).partial_rollout_max_staleness == 1
