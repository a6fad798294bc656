"""The embedded engine's prefix cache (servers/embedded/prefix_cache.py): continued samples are not prefilled again,
their results are what generation without chunks gives, and no cached K/V serves weights other than those that
computed it.

Tolerances: tokens equal exactly (greedy, and seeded sampling, whose uniforms depend on the seed and the position
only); log-probs within 1e-5 (the cached K/V came from a decode step, the straight run's from the same step of a
longer batch: the same arithmetic in another batch shape, which may round differently, fp32).
"""

import pytest
import torch

from megatron_dppo.servers.embedded.prefix_cache import PrefixCache
from tests.test_rollout_engine import save_tiny_model, sequence_logprobs

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9], [10, 11], [1, 2, 3, 4]]
CHUNK, CHUNKS = 4, 3


def kv(length: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    return [torch.full((2, length, 4), float(length))], [torch.zeros(2, length, 4)]


def test_lookup_finds_the_longest_cached_prefix_never_the_whole_context_and_evicts_least_recently_used():
    cache = PrefixCache(capacity_tokens=10)
    cache.insert([1, 2], *kv(2))
    cache.insert([1, 2, 3, 4], *kv(4))
    assert cache.lookup([1, 2, 3, 4, 5]).tokens == (1, 2, 3, 4)
    assert cache.lookup([1, 2, 3, 4]).tokens == (1, 2)  # the last token is always computed
    assert cache.lookup([1, 2, 9]).tokens == (1, 2)
    assert cache.lookup([2, 1]) is None
    cache.lookup([1, 2, 7])  # [1, 2] is now the most recently used
    cache.insert([7, 7, 7, 7, 7], *kv(5))  # 11 tokens > 10: the least recently used, [1, 2, 3, 4], goes
    assert cache.tokens == 7 and cache.lookup([1, 2, 3, 4, 5]).tokens == (1, 2)
    assert cache.lookup([7, 7, 7, 7, 7, 8]).tokens == (7, 7, 7, 7, 7)
    cache.insert(list(range(11)), *kv(11))  # larger than the whole cache: not kept
    assert cache.tokens == 7
    cache.clear()
    assert cache.lookup([1, 2, 3]) is None and cache.tokens == 0 and not cache.root.children


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("prefix_cache_model"))


def sequences(prompts, outputs, max_new_tokens, seeds):
    from megatron_dppo.servers.embedded.request_parser import Sequence, SequenceParams

    return [Sequence(rid=str(i), prompt_ids=prompt + output, params=SequenceParams(
        max_new_tokens=max_new_tokens, temperature=0.0 if seed is None else 1.0), return_logprob=True,
        logprob_start_len=-1, seed=seed) for i, (prompt, output, seed) in enumerate(zip(prompts, outputs, seeds))]


def chunked(engine, prompts, seeds) -> tuple[list[list[int]], list[list[float]]]:
    """Generate CHUNKS chunks of CHUNK tokens per prompt, each chunk a new request continuing the last (as partial
    rollouts send them)."""
    outputs, logprobs = [[] for _ in prompts], [[] for _ in prompts]
    for _ in range(CHUNKS):
        batch = sequences(prompts, outputs, CHUNK, seeds)
        engine.scheduler.decode(batch)
        for index, seq in enumerate(batch):
            outputs[index] += seq.output_ids
            logprobs[index] += seq.output_logprobs
    return outputs, logprobs


def straight(engine, prompts, seeds) -> tuple[list[list[int]], list[list[float]]]:
    batch = sequences(prompts, [[] for _ in prompts], CHUNK * CHUNKS, seeds)
    engine.scheduler.decode(batch)
    return [seq.output_ids for seq in batch], [seq.output_logprobs for seq in batch]


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_chunks_continued_from_the_cache_equal_generation_without_chunks_and_prefill_only_their_last_token(
        model_dir, sampling):
    from megatron_dppo.servers.embedded.engine import EmbeddedEngine

    engine = EmbeddedEngine(model_dir, deterministic_inference=True)
    seeds = [None] * len(PROMPTS) if sampling == "greedy" else [1000 + i for i in range(len(PROMPTS))]
    windows = []
    prefill = engine.decoder._prefill_distinct
    engine.decoder._prefill_distinct = lambda *args: (lambda out: (windows.append(out[1].shape[1]), out)[1])(
        prefill(*args))
    expected_tokens, expected_logprobs = straight(engine, PROMPTS, seeds)
    engine.prefix_cache.clear()
    windows.clear()
    tokens, logprobs = chunked(engine, PROMPTS, seeds)
    assert tokens == expected_tokens
    torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(expected_logprobs), atol=1e-5, rtol=0)
    # chunk 1 prefills the prompts; chunks 2 and 3 compute one position per row: the rest came from the cache
    assert windows == [max(map(len, PROMPTS)), 1, 1], windows
    cached = sum(len(prompt) + CHUNK * chunk - 1 for prompt in PROMPTS for chunk in (1, 2))
    assert engine.prefix_cache.hit_tokens == cached


def continue_after_new_weights(model_dir, new_dir, keep_stale_cache: bool) -> list:
    from megatron_dppo.servers.embedded.engine import EmbeddedEngine

    engine = EmbeddedEngine(model_dir, deterministic_inference=True)
    if keep_stale_cache:  # what the engine would do without invalidation: the test's counterfactual
        engine.prefix_cache.clear = lambda: None
    first = sequences(PROMPTS, [[] for _ in PROMPTS], CHUNK, [None] * len(PROMPTS))
    engine.scheduler.decode(first)
    assert engine.prefix_cache.tokens > 0
    engine.weights.load_from_disk({"model_path": new_dir})  # the weight route's load
    assert (engine.prefix_cache.tokens == 0) != keep_stale_cache
    continued = sequences(PROMPTS, [seq.output_ids for seq in first], CHUNK, [None] * len(PROMPTS))
    engine.scheduler.decode(continued)
    return continued


def test_a_continued_request_after_a_weight_update_is_computed_with_the_new_weights(model_dir, tmp_path):
    """A chunk is cached under the old weights; the weights change (the engine's own load path); the continuation
    must be scored by the new weights alone, as the trainer recomputes it, never from the stale K/V. With the cache
    left uncleared, the same continuation comes out scored otherwise: the check can tell."""
    from transformers import AutoModelForCausalLM

    new_dir = save_tiny_model(tmp_path / "new_weights", seed=1)
    new_model = AutoModelForCausalLM.from_pretrained(new_dir, dtype=torch.float32).eval()
    for seq in continue_after_new_weights(model_dir, new_dir, keep_stale_cache=False):
        recomputed = sequence_logprobs(new_model, seq.prompt_ids, seq.output_ids)
        torch.testing.assert_close(torch.tensor(seq.output_logprobs), recomputed, atol=1e-5, rtol=0)
    stale = continue_after_new_weights(model_dir, new_dir, keep_stale_cache=True)
    worst = max((torch.tensor(seq.output_logprobs) - sequence_logprobs(new_model, seq.prompt_ids, seq.output_ids))
                .abs().max().item() for seq in stale)
    assert worst > 1e-3, f"stale K/V changed the log-probs by {worst} only: the check could not tell"


def test_only_rows_a_later_request_can_continue_are_cached_not_those_at_a_stop_token_or_the_context_end(model_dir):
    """A row that stops at max_new_tokens with room left in the context is a chunk a later request may continue: its
    K/V is kept. A row that ends at a stop token, or at the end of the model's context (no request can add a token
    to it), leaves nothing in the cache."""
    from megatron_dppo.servers.embedded.engine import EmbeddedEngine

    engine = EmbeddedEngine(model_dir, deterministic_inference=True)
    context = engine.scheduler.max_positions  # 256
    long_prompt = list(range(1, 60)) * 5  # 295 tokens: cut to leave exactly CHUNK positions
    at_end = sequences([long_prompt[:context - CHUNK]], [[]], CHUNK, [None])
    engine.scheduler.decode(at_end)
    assert len(at_end[0].output_ids) == CHUNK and at_end[0].finish_reason["type"] == "length"
    assert engine.prefix_cache.tokens == 0, "a row at the end of the context was cached"

    first = sequences(PROMPTS[:1], [[]], CHUNK, [None])
    engine.scheduler.decode(first)
    stop = first[0].output_ids[1]  # greedy: the same request stops at its second token when that is a stop id
    assert engine.prefix_cache.tokens == len(PROMPTS[0]) + CHUNK - 1  # a chunk: its K/V kept
    engine.prefix_cache.clear()
    stopping = sequences(PROMPTS[:1], [[]], CHUNK, [None])
    stopping[0].params.stop_token_ids = {stop}
    engine.scheduler.decode(stopping)
    ends_at = first[0].output_ids.index(stop) + 1  # the same greedy tokens, up to the first stop id
    assert stopping[0].finish_reason == {"type": "stop", "matched": stop}
    assert stopping[0].output_ids == first[0].output_ids[:ends_at]
    assert engine.prefix_cache.tokens == 0, "a row that ended at a stop token was cached"
