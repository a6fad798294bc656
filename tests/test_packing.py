"""Dense Prompt Packing: bins, DP balance, THD layout and exact unpacking (pure torch, no Megatron)."""

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_dppo.pipeline.packing import (
    LOGPROB_FIELDS,
    TrainingSample,
    build_thd_batch,
    pack,
    packing_density,
    sequence_pad_multiple,
    unpack,
)

PROPERTY_SETTINGS = settings(max_examples=150, deadline=None)


@st.composite
def packing_problems(draw):
    """(lengths, max_tokens_per_gpu, window, dp_size, pad_multiple) where every padded length fits the budget."""
    pad_multiple = draw(st.sampled_from([1, 2, 4, 8]))
    budget = pad_multiple * draw(st.integers(1, 40))
    lengths = draw(st.lists(st.integers(1, budget), min_size=1, max_size=80))
    window = draw(st.integers(1, 100))
    dp_size = draw(st.integers(1, 9))
    return lengths, budget, window, dp_size, pad_multiple


def padded(length: int, multiple: int) -> int:
    return -(-length // multiple) * multiple


@PROPERTY_SETTINGS
@given(packing_problems())
def test_every_sequence_is_packed_exactly_once_and_no_bin_exceeds_the_budget(problem):
    lengths, budget, window, dp_size, pad_multiple = problem
    rank_bins = pack(lengths, budget, window, dp_size, pad_multiple=pad_multiple)
    assert len(rank_bins) == dp_size
    packed = [index for rank in rank_bins for bin_ in rank for index in bin_]
    assert sorted(packed) == list(range(len(lengths)))
    for rank in rank_bins:
        for bin_ in rank:
            assert bin_ == sorted(bin_)
            assert sum(padded(lengths[i], pad_multiple) for i in bin_) <= budget


@PROPERTY_SETTINGS
@given(packing_problems())
def test_every_rank_gets_the_same_number_of_micro_batches_and_empty_ones_only_when_nothing_can_split(problem):
    lengths, budget, window, dp_size, pad_multiple = problem
    rank_bins = pack(lengths, budget, window, dp_size, pad_multiple=pad_multiple)
    assert len({len(rank) for rank in rank_bins}) == 1
    bins = [bin_ for rank in rank_bins for bin_ in rank]
    if any(not bin_ for bin_ in bins):
        # Empty micro-batches are the last resort: every other bin already holds a single sequence.
        assert all(len(bin_) <= 1 for bin_ in bins)
        assert len(lengths) < len(bins)


@PROPERTY_SETTINGS
@given(packing_problems())
def test_pack_is_deterministic_and_leaves_its_input_unchanged(problem):
    lengths, budget, window, dp_size, pad_multiple = problem
    original = list(lengths)
    first = pack(lengths, budget, window, dp_size, pad_multiple=pad_multiple)
    second = pack(list(lengths), budget, window, dp_size, pad_multiple=pad_multiple)
    assert first == second
    assert lengths == original


@PROPERTY_SETTINGS
@given(packing_problems(), st.data())
def test_sequence_longer_than_the_budget_raises_an_error_naming_it(problem, data):
    lengths, budget, window, dp_size, pad_multiple = problem
    position = data.draw(st.integers(0, len(lengths)))
    too_long = budget + data.draw(st.integers(1, 5))
    lengths = lengths[:position] + [too_long] + lengths[position:]
    with pytest.raises(ValueError, match=rf"sequence {position} has \d+ tokens.*max_tokens_per_gpu={budget}"):
        pack(lengths, budget, window, dp_size, pad_multiple=pad_multiple)


def test_padding_to_the_multiple_counts_against_the_budget():
    # 7 tokens fit a budget of 7, but padded to a multiple of 4 (8 tokens) they do not.
    with pytest.raises(ValueError, match="sequence 1 has 8 tokens .padded to a multiple of 4."):
        pack([3, 7], 7, 4, pad_multiple=4)


@pytest.mark.parametrize(
    "lengths, window, expected_bins",
    [
        # Window 1 (6, 3, 5) longest first: 6 → new bin 0, 5 → new bin 1, 3 → bin 0 (tightest fit, room 1 left).
        # Bin 0 cannot take the window's shortest (3) and is closed; bin 1 (room 5) carries on, so window 2's
        # 2 and 1 both go to bin 1 even though 1 would fit bin 0 exactly.
        ([6, 3, 5, 2, 1], 3, [[0, 1], [2, 3, 4]]),
        # Window 1 (5, 5, 5): bin 0 = two 5s (closed, full), bin 1 = one 5 carried with room 5.
        # Window 2: 7 → new bin 2 (room 3); 2 → bin 2, the best fit, not bin 1, the first fit.
        ([5, 5, 5, 7, 2], 3, [[0, 1], [2], [3, 4]]),
    ],
)
def test_window_greedy_places_longest_first_into_the_best_fitting_open_bin(lengths, window, expected_bins):
    assert pack(lengths, 10, window) == [expected_bins]


def test_karmarkar_karp_finds_the_perfect_equal_count_split():
    # No two sequences fit one bin of 15; with c = 0 the optimum is 46 tokens and 4 bins a rank.
    lengths = [15, 14, 13, 12, 11, 10, 9, 8]
    rank_bins = pack(lengths, 15, 8, dp_size=2, attention_cost_coef=0.0)
    assert [sum(lengths[i] for bin_ in rank for i in bin_) for rank in rank_bins] == [46, 46]
    assert [len(rank) for rank in rank_bins] == [4, 4]


@pytest.mark.parametrize("count", [256, 4000])  # 256: one step of 32 prompts x 8, about 3 bins a rank
def test_dp_load_ratio_stays_within_5_percent_on_long_tail_lengths(count):
    generator = torch.Generator().manual_seed(0)
    lengths = torch.exp(torch.randn(count, generator=generator) + 6.4).clamp(16, 8192).long().tolist()
    coef = 4.0e-5
    rank_bins = pack(lengths, 9216, 256, dp_size=8, attention_cost_coef=coef)
    loads = [sum(lengths[i] + coef * lengths[i] ** 2 for bin_ in rank for i in bin_) for rank in rank_bins]
    assert max(loads) / min(loads) <= 1.05


def test_window_greedy_fills_bins_nearly_as_densely_as_the_lower_bound():
    generator = torch.Generator().manual_seed(1)
    lengths = torch.exp(torch.randn(3000, generator=generator) + 6.0).clamp(16, 4096).long().tolist()
    rank_bins = pack(lengths, 4096, 128)
    lower_bound = -(-sum(lengths) // 4096)
    assert len(rank_bins[0]) <= 1.02 * lower_bound + 1
    assert packing_density(rank_bins, lengths, 4096) >= 0.97


def test_uneven_bin_counts_split_the_largest_bins_instead_of_adding_empty_micro_batches():
    # Ten 5-token sequences fill five bins of 10; four ranks need eight bins: three bins are split in two.
    rank_bins = pack([5] * 10, 10, 10, dp_size=4)
    bins = [bin_ for rank in rank_bins for bin_ in rank]
    assert [len(rank) for rank in rank_bins] == [2, 2, 2, 2]
    assert all(bins)
    assert sorted(len(bin_) for bin_ in bins) == [1] * 6 + [2] * 2


def random_samples(seed: int, count: int, logprob_fields=LOGPROB_FIELDS) -> list[TrainingSample]:
    rng = random.Random(seed)
    samples = []
    for _ in range(count):
        response_length = rng.randint(0, 9)
        samples.append(TrainingSample(
            prompt_ids=[rng.randint(1, 99) for _ in range(rng.randint(1, 9))],
            response_ids=[rng.randint(1, 99) for _ in range(response_length)],
            advantage=rng.uniform(-2, 2),
            sample_weight=rng.uniform(0.5, 4),
            **{field: [-rng.random() * 5 for _ in range(response_length)] for field in logprob_fields},
        ))
    return samples


def test_fewer_sequences_than_ranks_give_empty_micro_batches_that_train_nothing():
    samples = random_samples(seed=3, count=3)
    rank_bins = pack([s.num_tokens for s in samples], 64, 8, dp_size=4, pad_multiple=4)
    assert sorted(map(len, (bin_ for rank in rank_bins for bin_ in rank))) == [0, 1, 1, 1]
    empty = build_thd_batch(samples, [], pad_multiple=4)
    assert empty.tokens.shape == (1, 4)
    assert empty.sample_ids.tolist() == [-1]
    assert empty.cu_seqlens.tolist() == [0, 4] and empty.cu_seqlens_padded.tolist() == [0, 4]
    assert empty.loss_mask.sum() == 0 and empty.num_valid_tokens == 0
    assert (empty.sample_index == -1).all()
    assert torch.equal(empty.old_logprobs, torch.zeros(4))  # present, like in the step's other micro-batches
    assert unpack(empty, empty.tokens) == []


@PROPERTY_SETTINGS
@given(
    seed=st.integers(0, 10_000),
    count=st.integers(1, 30),
    dp_size=st.integers(1, 4),
    pad_multiple=st.sampled_from([1, 2, 8]),
    logprob_fields=st.sets(st.sampled_from(LOGPROB_FIELDS)),
)
def test_unpack_of_packed_batches_restores_every_sample_in_original_order(
    seed, count, dp_size, pad_multiple, logprob_fields
):
    samples = random_samples(seed, count, tuple(logprob_fields))
    rank_bins = pack([s.num_tokens for s in samples], 32, 5, dp_size, pad_multiple=pad_multiple)
    restored = {}
    for rank in rank_bins:
        for bin_ in rank:
            batch = build_thd_batch(samples, bin_, pad_multiple=pad_multiple)
            fields = {
                "tokens": unpack(batch, batch.tokens, response_only=False),
                "advantages": unpack(batch, batch.advantages),
                "sample_weights": unpack(batch, batch.sample_weights),
                **{field: unpack(batch, getattr(batch, field)) for field in logprob_fields},
            }
            for field in set(LOGPROB_FIELDS) - logprob_fields:
                assert getattr(batch, field) is None
            real_ids = [sample_id for sample_id in batch.sample_ids.tolist() if sample_id >= 0]
            for position, sample_id in enumerate(real_ids):
                restored[sample_id] = {name: values[position] for name, values in fields.items()}
    assert sorted(restored) == list(range(count))
    for sample_id, sample in enumerate(samples):
        values = restored[sample_id]
        assert values["tokens"].tolist() == list(sample.prompt_ids) + list(sample.response_ids)
        response_length = len(sample.response_ids)
        assert torch.equal(values["advantages"], torch.full((response_length,), sample.advantage))
        assert torch.equal(values["sample_weights"], torch.full((response_length,), sample.sample_weight))
        for field in logprob_fields:
            assert torch.equal(values[field], torch.tensor(getattr(sample, field), dtype=torch.float32))


@PROPERTY_SETTINGS
@given(seed=st.integers(0, 10_000), count=st.integers(1, 12), pad_multiple=st.sampled_from([1, 3, 8]))
def test_thd_layout_restarts_positions_and_scores_each_response_token_from_the_position_before_it(
    seed, count, pad_multiple
):
    samples = random_samples(seed, count)
    indices = random.Random(seed).sample(range(count), count)  # any order in, ascending ids out
    batch = build_thd_batch(samples, indices, pad_multiple=pad_multiple)
    tokens, labels, positions = batch.tokens[0], batch.labels[0], batch.position_ids[0]
    cu_seqlens, cu_padded = batch.cu_seqlens.tolist(), batch.cu_seqlens_padded.tolist()

    assert batch.sample_ids.tolist() == list(range(count))
    assert batch.cu_seqlens.dtype == torch.int32 and batch.cu_seqlens_padded.dtype == torch.int32
    assert batch.num_tokens == cu_padded[-1] == tokens.shape[0]
    assert batch.num_valid_tokens == cu_seqlens[-1] == sum(s.num_tokens for s in samples)
    assert batch.max_seqlen == max(b - a for a, b in zip(cu_padded, cu_padded[1:]))
    for sample_id, sample in enumerate(samples):
        start, end = cu_padded[sample_id], cu_padded[sample_id + 1]
        real = cu_seqlens[sample_id + 1] - cu_seqlens[sample_id]
        prompt = len(sample.prompt_ids)
        assert real == sample.num_tokens and (end - start) % pad_multiple == 0 and end - start < real + pad_multiple
        assert positions[start:end].tolist() == list(range(end - start))
        assert batch.sample_index[start:start + real].eq(sample_id).all()
        assert batch.sample_index[start + real:end].eq(-1).all()
        # The mask covers exactly the positions whose next token is a response token.
        expected_mask = [0.0] * (prompt - 1) + [1.0] * len(sample.response_ids) + [0.0] * (end - start - real + 1)
        assert batch.loss_mask[start:end].tolist() == expected_mask
        assert labels[start:start + real - 1].tolist() == tokens[start + 1:start + real].tolist()
        scored = batch.loss_mask[start:end].bool()
        assert labels[start:end][scored].tolist() == list(sample.response_ids)
        assert torch.equal(batch.old_logprobs[start:end][scored], torch.tensor(sample.old_logprobs))
        assert batch.advantages[start:end][~scored].eq(0).all()


def test_sequence_pad_multiple_for_sequence_and_context_parallelism():
    assert sequence_pad_multiple() == 1
    assert sequence_pad_multiple(tensor_parallel_size=4) == 1  # no SP: the token dimension is not split
    assert sequence_pad_multiple(tensor_parallel_size=4, sequence_parallel=True) == 4
    assert sequence_pad_multiple(context_parallel_size=2) == 4
    assert sequence_pad_multiple(tensor_parallel_size=2, context_parallel_size=4, sequence_parallel=True) == 16


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: pack([], 8, 4), "no sequences to pack"),
        (lambda: pack([3, 0, 2], 8, 4), "length of sequence 1 is 0"),
        (lambda: pack([3, 2.5], 8, 4), "length of sequence 1 is 2.5"),
        (lambda: pack([3], 0, 4), "max_tokens_per_gpu must be a positive integer"),
        (lambda: pack([3], 8, 0), "window must be a positive integer"),
        (lambda: pack([3], 8, 4, dp_size=0), "dp_size must be a positive integer"),
        (lambda: pack([3], 8, 4, pad_multiple=0), "pad_multiple must be a positive integer"),
        (lambda: sequence_pad_multiple(context_parallel_size=0), "context_parallel_size must be a positive"),
        (lambda: build_thd_batch([TrainingSample([], [1])], [0]), "sample 0 has an empty prompt"),
        (lambda: build_thd_batch([TrainingSample([1], [2, 3], old_logprobs=[-1.0])], [0]),
         "sample 0 has 1 old_logprobs for 2 response tokens"),
        (lambda: build_thd_batch([TrainingSample([1], [2], ref_logprobs=[-1.0]), TrainingSample([1], [2])], [0, 1]),
         "ref_logprobs is given for sample 0 but not for sample 1"),
        (lambda: build_thd_batch([TrainingSample([1], [2]), TrainingSample([1], [2], old_logprobs=[-1.0])], [1]),
         "old_logprobs is given for sample 1 but not for sample 0"),
        (lambda: build_thd_batch([TrainingSample([1], [2])], [0, 0]), "name a sample more than once"),
        (lambda: build_thd_batch([TrainingSample([1], [2])], [1]), "sample index 1 is out of range"),
        (lambda: unpack(build_thd_batch([TrainingSample([1], [2])], [0]), torch.zeros(5)),
         "per_token_values has shape .5,. but the batch has 2 positions"),
    ],
)
def test_bad_input_raises_a_clear_error(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_a_tokenizer_without_a_pad_token_pads_packed_batches_with_its_eos():
    from types import SimpleNamespace

    from megatron_dppo.pipeline.packing import padding_token_id

    no_pad = SimpleNamespace(pad_token_id=None, eos_token_id=7)  # as Llama 3's and Qwen's base tokenizers
    samples = [TrainingSample([1, 2], [3]), TrainingSample([4], [5, 6])]
    batch = build_thd_batch(samples, [0, 1], pad_multiple=4, pad_token_id=padding_token_id(no_pad))
    assert batch.tokens[0].tolist() == [1, 2, 3, 7, 4, 5, 6, 7]
    assert padding_token_id(SimpleNamespace(pad_token_id=None, eos_token_id=None)) == 0
    assert padding_token_id(SimpleNamespace(pad_token_id=3, eos_token_id=7)) == 3
