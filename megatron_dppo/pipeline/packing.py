"""Dense Prompt Packing: kept sequences → token-budget bins → balanced data-parallel ranks → THD micro-batches.

lengths ─► pad each to the SP/CP multiple ─► window-greedy bins (≤ max_tokens_per_gpu)
        ─► split the costliest bins until the count is a multiple of dp_size
        ─► Karmarkar–Karp of bins over ranks on cost Σs + c·Σs², equal micro-batch count per rank
        ─► move single sequences from the heaviest to the lightest rank while that lowers the max
        ─► build_thd_batch per bin ─► model ─► unpack back to per-sample order

Invariants, checked where they are made:
- every sequence lands in exactly one bin, and no bin's padded token count exceeds max_tokens_per_gpu;
- every rank has the same number of micro-batches (the pipeline schedule needs it);
- the same input gives the same output: no randomness, ties broken by sample index;
- in a THDBatch, the per-token fields at position t belong to the prediction of token t+1 of the same
  sequence, so the last position of every sequence (and all padding) is masked.
"""

import bisect
import heapq
import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import torch

# c in the bin cost Σs + c·Σs². Per layer, linear layers cost 2·P FLOPs per token (P = parameters per layer)
# and causal attention costs 2·q_dim·s² FLOPs per sequence, so c = q_dim / P. For Qwen3-4B
# (q_dim 32·128 = 4096, P ≈ 101 M) that is 4.0e-5; dense 1–8B models lie between 2e-5 and 6e-5.
DEFAULT_ATTENTION_COST_COEF = 4.0e-5


def sequence_pad_multiple(
    tensor_parallel_size: int = 1, context_parallel_size: int = 1, sequence_parallel: bool = False
) -> int:
    """The multiple every packed sequence is padded to.

    Sequence parallelism splits the packed token dimension over the TP ranks, so every sequence is padded to
    a multiple of tp (then the total is one too). Context parallelism cuts each sequence into 2·cp chunks for
    causal load balance, so every sequence is padded to a multiple of 2·cp; with both, to tp·2·cp, so that each
    CP rank's share of every sequence is again a multiple of tp.
    """
    sizes = {"tensor_parallel_size": tensor_parallel_size, "context_parallel_size": context_parallel_size}
    for name, value in sizes.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    multiple = 2 * context_parallel_size if context_parallel_size > 1 else 1
    if sequence_parallel:
        multiple *= tensor_parallel_size
    return multiple


def pack(
    lengths: Sequence[int],
    max_tokens_per_gpu: int,
    window: int,
    dp_size: int = 1,
    *,
    pad_multiple: int = 1,
    attention_cost_coef: float = DEFAULT_ATTENTION_COST_COEF,
) -> list[list[list[int]]]:
    """Pack sequences of `lengths` tokens into micro-batches: `result[rank][micro_batch]` is a list of sample
    indices (ascending). Every rank gets the same number of micro-batches.

    Each length is first rounded up to `pad_multiple` (see `sequence_pad_multiple`); with context parallelism
    pass the budget of the whole CP group, `max_tokens_per_gpu * cp_size`. When the bin count is not a multiple
    of dp_size, the costliest bins holding two or more sequences are split in two. Only when no bin can be
    split any more (fewer sequences than micro-batch slots) are empty micro-batches (`[]`) added; build them
    with `build_thd_batch(samples, [])` and run them like any other: they hold one all-padding pseudo-sequence
    with a zero loss mask, which keeps the pipeline schedule and the gradient all-reduce in step.
    Bins go to ranks by Karmarkar–Karp on the cost Σs + c·Σs² (c = `attention_cost_coef`), then single
    sequences move from the heaviest rank to the lightest while that lowers the heaviest load.
    """
    lengths = _checked_lengths(lengths)
    for name, value in (("max_tokens_per_gpu", max_tokens_per_gpu), ("window", window), ("dp_size", dp_size),
                        ("pad_multiple", pad_multiple)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if pad_multiple > 1:
        lengths = [-(-length // pad_multiple) * pad_multiple for length in lengths]
    longest = max(lengths)
    if longest > max_tokens_per_gpu:
        index = lengths.index(longest)
        padded = f" (padded to a multiple of {pad_multiple})" if pad_multiple > 1 else ""
        raise ValueError(
            f"sequence {index} has {longest} tokens{padded}, more than max_tokens_per_gpu={max_tokens_per_gpu}: "
            "raise --max-tokens-per-gpu or cap prompt + response length below it"
        )

    bins = _window_greedy_bins(lengths, max_tokens_per_gpu, window)
    if dp_size > 1:
        bin_costs = [_bin_cost(bin_, lengths, attention_cost_coef) for bin_ in bins]
        _split_bins_to_multiple(bins, bin_costs, lengths, dp_size, attention_cost_coef)
        rank_bins = _karmarkar_karp(bin_costs, dp_size)
        _move_sequences_to_lighter_ranks(rank_bins, bins, lengths, max_tokens_per_gpu, attention_cost_coef)
        rank_bins = [sorted(rank) for rank in rank_bins]
    else:
        rank_bins = [list(range(len(bins)))]
    result = [[sorted(bins[bin_id]) for bin_id in rank] for rank in rank_bins]

    packed = sorted(index for rank in result for bin_ in rank for index in bin_)
    assert packed == list(range(len(lengths))), "packing lost or duplicated a sequence"
    assert all(sum(lengths[i] for i in bin_) <= max_tokens_per_gpu for rank in result for bin_ in rank), (
        "packing overfilled a bin"
    )
    assert len({len(rank) for rank in result}) == 1, "ranks got different micro-batch counts"
    return result


def pack_micro_batches(samples: Sequence["TrainingSample"], max_tokens_per_gpu: int, window: int, dp_size: int,
                       dp_rank: int, *, pad_multiple: int = 1, pad_token_id: int = 0) -> tuple[list["THDBatch"], dict]:
    """Dense Prompt Packing of a step's samples: data-parallel rank `dp_rank`'s THD micro-batches (every rank packs
    the same bins from the same samples, without communication) and the step's packing stats."""
    if not samples:
        return [], {"packing_density": 0.0, "micro_batches": 0}
    lengths = [sample.num_tokens for sample in samples]
    rank_bins = pack(lengths, max_tokens_per_gpu, window, dp_size, pad_multiple=pad_multiple)
    micro_batches = [build_thd_batch(samples, bin_, pad_multiple, pad_token_id) for bin_ in rank_bins[dp_rank]]
    density = packing_density(rank_bins, lengths, max_tokens_per_gpu)
    return micro_batches, {"packing_density": density, "micro_batches": len(micro_batches)}


def packing_density(rank_bins: list[list[list[int]]], lengths: Sequence[int], max_tokens_per_gpu: int) -> float:
    """Valid tokens / (micro-batches · max_tokens_per_gpu): the share of the token budget doing useful work."""
    micro_batches = sum(len(rank) for rank in rank_bins)
    valid_tokens = sum(int(lengths[i]) for rank in rank_bins for bin_ in rank for i in bin_)
    return valid_tokens / (micro_batches * max_tokens_per_gpu)


def _checked_lengths(lengths: Sequence[int]) -> list[int]:
    lengths = list(lengths.tolist() if hasattr(lengths, "tolist") else lengths)  # tensors and arrays too
    if not lengths:
        raise ValueError("no sequences to pack: every sample was pruned; skip the step or lower the pruning rate")
    for index, length in enumerate(lengths):
        is_integer = type(length) is int or (isinstance(length, numbers.Integral) and not isinstance(length, bool))
        if not is_integer or length < 1:
            raise ValueError(
                f"length of sequence {index} is {length!r}: every length must be a positive integer token count"
            )
    return [int(length) for length in lengths]


def _window_greedy_bins(lengths: list[int], budget: int, window: int) -> list[list[int]]:
    """Window-greedy best fit: bins of sample indices, none over `budget`.

    Windows of `window` consecutive sequences are taken in order. Inside a window, the longest goes first into
    the open bin with the least room that still fits it (a new bin when none does). After each window, bins
    that cannot take the window's shortest sequence are closed; the others stay open for the next window.
    """
    bins: list[list[int]] = []
    open_bins: list[tuple[int, int]] = []  # (room left, bin id), ascending
    for start in range(0, len(lengths), window):
        longest_first = sorted(range(start, min(start + window, len(lengths))), key=lengths.__getitem__,
                               reverse=True)
        for index in longest_first:
            length = lengths[index]
            slot = bisect.bisect_left(open_bins, (length, -1))  # first bin whose room is >= length
            if slot == len(open_bins):
                bin_id, room = len(bins), budget
                bins.append([])
            else:
                room, bin_id = open_bins.pop(slot)
            bins[bin_id].append(index)
            bisect.insort(open_bins, (room - length, bin_id))
        shortest = lengths[longest_first[-1]]
        del open_bins[:bisect.bisect_left(open_bins, (shortest, -1))]
    return bins


def _sequence_cost(length: int, coef: float) -> float:
    """Estimated forward cost of one sequence: linear layers ∝ s, causal attention ∝ s²."""
    return length + coef * length * length


def _bin_cost(bin_: list[int], lengths: list[int], coef: float) -> float:
    return sum(_sequence_cost(lengths[i], coef) for i in bin_)


def _split_bins_to_multiple(bins: list[list[int]], bin_costs: list[float], lengths: list[int], dp_size: int,
                            coef: float) -> None:
    """Split the costliest multi-sequence bins (in place) until len(bins) is a multiple of dp_size; where no bin
    holds two sequences any more, add empty bins."""
    while len(bins) % dp_size:
        splittable = [bin_id for bin_id, bin_ in enumerate(bins) if len(bin_) > 1]
        if not splittable:
            missing = dp_size - len(bins) % dp_size
            bins.extend([] for _ in range(missing))
            bin_costs.extend(0.0 for _ in range(missing))
            return
        bin_id = max(splittable, key=lambda b: (bin_costs[b], -b))
        halves: tuple[list[int], list[int]] = ([], [])
        half_tokens = [0, 0]
        for index in sorted(bins[bin_id], key=lambda i: (-lengths[i], i)):  # longest first into the lighter half
            lighter = 0 if half_tokens[0] <= half_tokens[1] else 1
            halves[lighter].append(index)
            half_tokens[lighter] += lengths[index]
        bins[bin_id] = halves[0]
        bins.append(halves[1])
        bin_costs[bin_id] = _bin_cost(halves[0], lengths, coef)
        bin_costs.append(_bin_cost(halves[1], lengths, coef))


def _karmarkar_karp(costs: list[float], dp_size: int) -> list[list[int]]:
    """Partition bin ids into dp_size groups of equal count with near-equal total cost.

    Largest differencing method with equal counts: bins sorted by cost are cut into rows of dp_size, each row a
    partial solution with one bin per rank. The two partial solutions with the widest spread (max - min load)
    are merged, heaviest rank of one with the lightest of the other, until one remains. Each merge adds one bin
    to every rank of a row, so counts stay equal.
    """
    assert len(costs) % dp_size == 0, "bin count must be a multiple of dp_size before balancing"
    order = sorted(range(len(costs)), key=lambda b: (-costs[b], b))
    heap = []  # (-spread, tie-break, ranks sorted by load descending: [(load, bin ids)])
    for row, start in enumerate(range(0, len(order), dp_size)):
        ranks = [(costs[b], [b]) for b in order[start:start + dp_size]]
        heapq.heappush(heap, (-(ranks[0][0] - ranks[-1][0]), row, ranks))
    tie_break = len(heap)
    while len(heap) > 1:
        _, _, heavier = heapq.heappop(heap)
        _, _, lighter = heapq.heappop(heap)
        merged = [(load_a + load_b, bins_a + bins_b)
                  for (load_a, bins_a), (load_b, bins_b) in zip(heavier, reversed(lighter))]
        merged.sort(key=lambda rank: -rank[0])
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), tie_break, merged))
        tie_break += 1
    return [bin_ids for _, bin_ids in heap[0][2]]


def _move_sequences_to_lighter_ranks(rank_bins: list[list[int]], bins: list[list[int]], lengths: list[int],
                                     budget: int, coef: float) -> None:
    """Even out rank loads by moving single sequences between bins (in place).

    Karmarkar–Karp moves whole bins, so with few bins a rank the loads stay uneven (a step of 256 MATH sequences
    on 8 ranks has 3 bins a rank and max/min ≈ 1.2). Repeatedly take the sequence of the heaviest rank whose cost
    is closest to half the gap to the lightest rank and move it into the lightest rank's roomiest bin, while its
    cost is below the gap (so the largest load falls) and its bin keeps another sequence. Each move lowers the
    sum of squared loads, so this ends; bin counts per rank do not change.
    """
    costs = [_sequence_cost(length, coef) for length in lengths]
    bin_tokens = [sum(lengths[i] for i in bin_) for bin_ in bins]
    loads = [sum(costs[i] for bin_id in rank for i in bins[bin_id]) for rank in rank_bins]
    for _ in range(len(lengths)):
        heavy = max(range(len(loads)), key=loads.__getitem__)
        light = min(range(len(loads)), key=loads.__getitem__)
        gap = loads[heavy] - loads[light]
        target = min(rank_bins[light], key=bin_tokens.__getitem__)
        room = budget - bin_tokens[target]
        candidates = [(abs(gap / 2 - costs[i]), i, bin_id) for bin_id in rank_bins[heavy] if len(bins[bin_id]) > 1
                      for i in bins[bin_id] if lengths[i] <= room and costs[i] < gap]
        if not candidates:
            return
        _, index, source = min(candidates)
        bins[source].remove(index)
        bins[target].append(index)
        bin_tokens[source] -= lengths[index]
        bin_tokens[target] += lengths[index]
        loads[heavy] -= costs[index]
        loads[light] += costs[index]


@dataclass
class TrainingSample:
    """One prompt+response sequence as the trainer hands it to the packer (any object with these attributes
    works). Log-probs are per response token; the loss covers response tokens only."""

    prompt_ids: Sequence[int]
    response_ids: Sequence[int]
    advantage: float = 0.0
    sample_weight: float = 1.0  # importance / pruning weight, 1 / keep_prob for a kept DPPO sample
    old_logprobs: Sequence[float] | torch.Tensor | None = None
    ref_logprobs: Sequence[float] | torch.Tensor | None = None
    rollout_logprobs: Sequence[float] | torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)


@dataclass
class THDBatch:
    """One packed micro-batch in THD layout (T tokens, n packed sequences).

    Alignment: position t holds token x_t; `labels[t]` is x_{t+1} of the same sequence, and every per-token
    field at t (loss_mask, advantages, sample_weights, *_logprobs) belongs to the prediction of x_{t+1}. For a
    sequence with P prompt and R response tokens, response token j is scored at position P - 1 + j; those R
    positions have loss_mask 1. The last real position of each sequence has no target, and positions inside a
    sequence's padded span are padding: both have loss_mask 0, label pad_token_id, and zero per-token fields.

    `cu_seqlens` counts real tokens, `cu_seqlens_padded` the padded spans (offsets into the T positions): pass
    both to PackedSeqParams as cu_seqlens_q/kv and cu_seqlens_q/kv_padded. Sequences are laid out in ascending
    sample id. An empty micro-batch holds one all-padding pseudo-sequence with sample id -1.
    """

    tokens: torch.Tensor  # [1, T] int64
    labels: torch.Tensor  # [1, T] int64, next token of the same sequence
    position_ids: torch.Tensor  # [1, T] int64, restarting at 0 for every sequence
    cu_seqlens: torch.Tensor  # [n + 1] int32, real lengths
    cu_seqlens_padded: torch.Tensor  # [n + 1] int32, padded lengths; cu_seqlens_padded[-1] == T
    max_seqlen: int  # longest padded sequence
    loss_mask: torch.Tensor  # [T] float32
    advantages: torch.Tensor  # [T] float32
    sample_weights: torch.Tensor  # [T] float32
    old_logprobs: torch.Tensor | None  # [T] float32
    ref_logprobs: torch.Tensor | None  # [T] float32
    rollout_logprobs: torch.Tensor | None  # [T] float32
    sample_index: torch.Tensor  # [T] int64, sample id of each position, -1 on padding
    sample_ids: torch.Tensor  # [n] int64, -1 for the pseudo-sequence of an empty micro-batch
    prompt_lengths: torch.Tensor  # [n] int64

    @property
    def num_tokens(self) -> int:
        return self.tokens.shape[1]

    @property
    def num_valid_tokens(self) -> int:
        return int((self.sample_index >= 0).sum())


LOGPROB_FIELDS = ("old_logprobs", "ref_logprobs", "rollout_logprobs")


def padding_token_id(tokenizer) -> int:
    """The id padded positions carry: the tokenizer's pad token, else its EOS (Llama 3's and Qwen's base tokenizers
    have no pad token), else 0. Padding is masked out of every loss, so any id of the vocabulary serves."""
    for token_id in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if token_id is not None:
            return token_id
    return 0


def build_thd_batch(
    samples: Sequence[TrainingSample], indices: Sequence[int], pad_multiple: int = 1, pad_token_id: int = 0
) -> THDBatch:
    """Pack `samples[i] for i in indices` (one bin from `pack`) into a THDBatch, each sequence padded to a
    multiple of `pad_multiple` (`sequence_pad_multiple`); an empty `indices` gives the all-padding batch."""
    if not isinstance(pad_multiple, int) or pad_multiple < 1:
        raise ValueError(f"pad_multiple must be a positive integer, got {pad_multiple!r}")
    sample_ids = sorted(int(i) for i in indices)
    if len(set(sample_ids)) != len(sample_ids):
        raise ValueError(f"indices {list(indices)} name a sample more than once: pass one bin from pack()")
    members = []
    for sample_id in sample_ids:
        if not 0 <= sample_id < len(samples):
            raise ValueError(f"sample index {sample_id} is out of range for {len(samples)} samples")
        members.append(samples[sample_id])
    logprob_present = {field: _logprob_presence(samples, members, sample_ids, field) for field in LOGPROB_FIELDS}
    for sample_id, sample in zip(sample_ids, members):
        if len(sample.prompt_ids) < 1:
            raise ValueError(
                f"sample {sample_id} has an empty prompt: its first response token would have no position "
                "to be predicted from; every sample needs at least one prompt token (e.g. BOS)"
            )
    if not members:  # an empty micro-batch: one padding pseudo-sequence, no loss
        sample_ids = [-1]
        prompts, responses = [[pad_token_id] * pad_multiple], [[]]
    else:
        prompts = [list(sample.prompt_ids) for sample in members]
        responses = [list(sample.response_ids) for sample in members]

    prompt_lengths = torch.tensor([len(p) for p in prompts], dtype=torch.int64)  # [n]
    response_lengths = torch.tensor([len(r) for r in responses], dtype=torch.int64)  # [n]
    seq_lengths = prompt_lengths + response_lengths
    padded_lengths = (seq_lengths + pad_multiple - 1) // pad_multiple * pad_multiple
    cu_seqlens = _cumulative(seq_lengths)
    cu_seqlens_padded = _cumulative(padded_lengths)
    num_tokens = int(cu_seqlens_padded[-1])

    real_positions = _spans(cu_seqlens_padded[:-1], seq_lengths)  # where real tokens sit in the T positions
    tokens = torch.full((num_tokens,), pad_token_id, dtype=torch.int64)
    tokens[real_positions] = torch.tensor([t for p, r in zip(prompts, responses) for t in p + r], dtype=torch.int64)
    sample_index = torch.full((num_tokens,), -1, dtype=torch.int64)
    sample_index[real_positions] = torch.tensor(sample_ids)[_segment_ids(seq_lengths)]
    position_ids = torch.arange(num_tokens) - cu_seqlens_padded[:-1][_segment_ids(padded_lengths)]

    # Targets: position t scores token t+1 of its sequence; the last real position of a sequence has none.
    scoring_positions = _spans(cu_seqlens_padded[:-1], seq_lengths - 1)
    labels = torch.full((num_tokens,), pad_token_id, dtype=torch.int64)
    labels[scoring_positions] = tokens[scoring_positions + 1]
    response_positions = _response_positions(cu_seqlens_padded[:-1], prompt_lengths, response_lengths)
    loss_mask = torch.zeros(num_tokens)
    loss_mask[response_positions] = 1.0
    advantages = torch.zeros(num_tokens)
    sample_weights = torch.zeros(num_tokens)
    if members:
        response_sequence = _segment_ids(response_lengths)  # [Σ R], which sequence each response token is in
        advantages[response_positions] = torch.tensor([float(s.advantage) for s in members])[response_sequence]
        sample_weights[response_positions] = torch.tensor([float(s.sample_weight) for s in members])[response_sequence]
    logprobs = dict.fromkeys(LOGPROB_FIELDS)
    for field in LOGPROB_FIELDS:
        if logprob_present[field]:
            logprobs[field] = torch.zeros(num_tokens)
            if members:
                values = [torch.as_tensor(getattr(s, field), dtype=torch.float32).reshape(-1) for s in members]
                logprobs[field][response_positions] = torch.cat(values)

    return THDBatch(
        tokens=tokens.unsqueeze(0),
        labels=labels.unsqueeze(0),
        position_ids=position_ids.unsqueeze(0),
        cu_seqlens=cu_seqlens.to(torch.int32),
        cu_seqlens_padded=cu_seqlens_padded.to(torch.int32),
        max_seqlen=int(padded_lengths.max()),
        loss_mask=loss_mask,
        advantages=advantages,
        sample_weights=sample_weights,
        sample_index=sample_index,
        sample_ids=torch.tensor(sample_ids, dtype=torch.int64),
        prompt_lengths=prompt_lengths,
        **logprobs,
    )


def unpack(batch: THDBatch, per_token_values: torch.Tensor, response_only: bool = True) -> list[torch.Tensor]:
    """Per-sample slices of `per_token_values` ([T] or [1, T], aligned to the batch positions), in the batch's
    sample order, which is ascending original sample id.

    response_only=True gives, for each sample, the R values at the positions that score its response tokens
    (unpack(batch, batch.old_logprobs) returns each sample's old_logprobs); False gives the P + R values at its
    real positions (unpack(batch, batch.tokens, response_only=False) returns prompt_ids + response_ids).
    """
    values = per_token_values.reshape(-1)
    aligned = per_token_values.dim() == 1 or (per_token_values.dim() == 2 and per_token_values.shape[0] == 1)
    if not aligned or values.shape[0] != batch.num_tokens:
        raise ValueError(
            f"per_token_values has shape {tuple(per_token_values.shape)} but the batch has {batch.num_tokens} "
            "positions: pass values aligned to the batch, shaped [T] or [1, T]"
        )
    real = batch.sample_ids >= 0
    cu_seqlens = batch.cu_seqlens.long()
    cu_seqlens_padded = batch.cu_seqlens_padded.long()
    seq_lengths = (cu_seqlens[1:] - cu_seqlens[:-1])[real]
    starts = cu_seqlens_padded[:-1][real]
    if response_only:
        prompt_lengths = batch.prompt_lengths[real]
        response_lengths = seq_lengths - prompt_lengths
        positions = _response_positions(starts, prompt_lengths, response_lengths)
        return list(values[positions].split(response_lengths.tolist()))
    return list(values[_spans(starts, seq_lengths)].split(seq_lengths.tolist()))


def _logprob_presence(samples: Sequence, members: list, sample_ids: list[int], field: str) -> bool:
    """Whether `field` is a tensor in the batch: decided by samples[0], so that every micro-batch of a step
    (an empty one included) agrees; raise when a member disagrees or has the wrong number of log-probs."""
    present = len(samples) > 0 and getattr(samples[0], field) is not None
    for sample_id, sample in zip(sample_ids, members):
        values = getattr(sample, field)
        if (values is not None) != present:
            given, missing = (0, sample_id) if present else (sample_id, 0)
            raise ValueError(
                f"{field} is given for sample {given} but not for sample {missing}: give it for every sample "
                "or for none"
            )
        if values is not None and len(values) != len(sample.response_ids):
            raise ValueError(
                f"sample {sample_id} has {len(values)} {field} for {len(sample.response_ids)} response tokens: "
                "log-probs are one per response token"
            )
    return present


def _cumulative(lengths: torch.Tensor) -> torch.Tensor:
    """[0, l0, l0+l1, ...] as int64 ([n + 1])."""
    return torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lengths, 0)])


def _spans(starts: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Concatenation of arange(start, start + count) for every (start, count)."""
    counts = counts.clamp(min=0)
    segments = _segment_ids(counts)
    return starts[segments] + torch.arange(len(segments)) - _cumulative(counts)[segments]


def _segment_ids(counts: torch.Tensor) -> torch.Tensor:
    """[Σ counts]: i repeated counts[i] times. (torch.repeat_interleave does the same but starts threads even for
    a few elements, which costs milliseconds per call on a busy CPU.)"""
    ends = torch.cumsum(counts, 0)
    return torch.searchsorted(ends, torch.arange(int(ends[-1]) if len(ends) else 0), right=True)


def _response_positions(starts: torch.Tensor, prompt_lengths: torch.Tensor,
                        response_lengths: torch.Tensor) -> torch.Tensor:
    """Positions that score the response tokens: start + P - 1 + j for each sequence, in order."""
    return _spans(starts + prompt_lengths - 1, response_lengths)
