"""What each rollout correction does to a step where the rollout engine really disagrees with the trainer: the step's
bias against the on-policy gradient (exact) and its variance (Monte Carlo), at several gap sizes, with DPPO on and off.

    a tiny random HF decoder (the trainer's weights) and the embedded engine's perturbed copy of them (--weight-noise
    S: Gaussian noise of S times each weight's RMS, servers/embedded/weights.py), one copy per --noise level
    ─► every response of RESPONSE_TOKENS tokens over a VOCAB-token vocabulary is enumerated for each of B prompts
       (4^8 = 65,536 per prompt): the trainer's log-probs π and hidden states, the engine's log-probs μ, the reward
       (1 when the response's share of tokens 0 and 1 reaches its prompt's threshold)
    ─► exact: the expected step of G samples per prompt drawn from the engine, under each correction, with Dr.GRPO's
       advantage (r − group mean, linear in the rewards: the expectation is a covariance over the enumeration)
           E[step_c] = −(G − 1) / (B G) · Σ_q Cov_μ(r, f_c),   f_c(y) = (1/L) Σ_t v_t(y) ∇ log π(y_t)
       and the on-policy gradient g_on, the same with the trainer's own π as the sampling policy and no correction;
       bias = |E[step_c] − g_on| / |g_on|; DPPO's pruned step has the full step's expectation (its 1/p weights
       and the full batch's normaliser; bench/unbiasedness.py shows it), so its bias is the same
    ─► Monte Carlo: --draws steps per gap sampled from μ through the trainer's own code (select_samples with the
       pruner: DPPO off = none, on = --no-dppo-refill and both levels at rate 0.5, the defaults otherwise,
       its prompt level predicting from one earlier group per prompt; policy_loss with the trainer's log-probs as old
       log-probs and the engine's as rollout log-probs) ─► variance = mean |g − mean g|² / |g_on|²; and a check that
       the sampled steps' mean is the exact expectation (|mean − E| over its standard error, about 1)
    ─► the engine check: the embedded engine itself (the real server, over HTTP) started with the same --weight-noise
       samples a batch, and its log-probs must be the bench's perturbed copy's; its logprob_gap_train_vs_rollout
    repeated --repeats times with other seeds (model, prompts, noise): the table shows the medians.

Gradients are taken with respect to the output projection (lm_head, untied): that block of the gradient is exact
with the rest of the network at the trainer's weights, and one matmul away from hidden states computed once. With
every response RESPONSE_TOKENS long, the three loss aggregations differ by a constant factor only; the corrections
use the command line's defaults (token-tis and seq-tis capped at 2, seq-mis rejecting above 2, geo-rs band
[0.999, 1.001], icepop band [0.5, 5]), and geo-rs once more with the band [0.95, 1.05].

    python bench/rollout_correction.py [--noise 0.0002 0.002 0.01 0.03] [--draws 400] [--repeats 3] [--json rows.json]
"""

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
torch.set_num_threads(1)  # small tensors; the engine check's server gets the other core

from bench.markdown_table import markdown  # noqa: E402
from megatron_dppo.algo import PromptDecision, PromptHistory, build_pruner, compute_advantages, score_prompts  # noqa
from megatron_dppo.algo.losses import loss_normalizer, policy_loss  # noqa: E402
from megatron_dppo.algo.rollout_correction import correction_weights  # noqa: E402
from megatron_dppo.convert.tiny import save_random_hf_model, tiny_hf_config  # noqa: E402
from megatron_dppo.launch.arguments import parse_args  # noqa: E402
from megatron_dppo.launch.rollout_correction_flags import ROLLOUT_CORRECTIONS  # noqa: E402
from megatron_dppo.pipeline.experience import loss_config, pruner_options, select_samples  # noqa: E402
from megatron_dppo.rollout.client import RolloutClient, SamplingParams  # noqa: E402
from megatron_dppo.rollout.launcher import launch_embedded_engine  # noqa: E402
from megatron_dppo.servers.embedded.weights import WeightNoise  # noqa: E402

VOCAB, PROMPT_TOKENS, RESPONSE_TOKENS = 4, 4, 8
SEQUENCES = VOCAB**RESPONSE_TOKENS  # every response of one prompt
MODEL = dict(vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, ffn_hidden_size=64,
             max_position_embeddings=16, initializer_range=0.3)  # far from uniform: about 1 nat of entropy per token
DPPO_FLAGS = ["--algorithm", "dppo", "--no-dppo-refill", "--dppo-prompt-prune-rate", "0.5",
              "--dppo-completion-prune-rate", "0.5", "--advantage-estimator", "dr_grpo",
              "--loss-agg-mode", "seq-mean-token-mean"]
CHUNK = 8192  # sequences per forward pass of the enumeration
# each correction with the command line's defaults, and geo-rs once more with a band that fits this world's gaps
CORRECTIONS = {**{name: ["--rollout-correction", name] for name in ROLLOUT_CORRECTIONS},
               "geo-rs 0.95-1.05": ["--rollout-correction", "geo-rs", "--rollout-correction-band", "0.95", "1.05"]}


@dataclass
class PromptSpace:
    """Every response of one prompt: what the trainer and the engines say of it, and its reward."""

    tokens: torch.Tensor  # [S, L] the responses
    hidden: torch.Tensor  # [S, L, H] the trainer's final hidden states that score each response token
    trainer_logprobs: torch.Tensor  # [S, L] float64
    rewards: torch.Tensor  # [S] float64
    engine_logprobs: dict = field(default_factory=dict)  # noise → [S, L] float64, the perturbed copy's


@dataclass
class Row:
    noise: float  # the engine's --weight-noise (0: the exact engine)
    gap: float  # E_μ of the mean |trainer − engine| log-prob per token (logprob_gap_train_vs_rollout)
    dppo: bool
    correction: str  # a label of CORRECTIONS
    bias: float  # |E[step] − g_on| / |g_on|, exact
    variance: float  # mean |g − mean g|² / |g_on|², over the sampled steps
    check_se: float  # |mean of the sampled steps − E[step]| / its standard error (about 1 when they agree)
    weight_mean: float  # E_μ of the correction's mean token weight
    capped_or_masked: float  # E_μ of the share of tokens the correction caps or masks
    rejected: float  # E_μ of the share of sequences it rejects


def all_responses() -> torch.Tensor:
    """[S, L]: every response, in the order of its base-VOCAB number (token 0 first)."""
    index = torch.arange(SEQUENCES)[:, None]
    return index // VOCAB ** torch.arange(RESPONSE_TOKENS - 1, -1, -1) % VOCAB


def response_index(tokens: list[int]) -> int:
    return sum(token * VOCAB ** (RESPONSE_TOKENS - 1 - t) for t, token in enumerate(tokens))


@torch.no_grad()
def score(model, prompt: list[int], responses: torch.Tensor, with_hidden: bool):
    """Per-token log-probs [S, L] float64 of the responses after `prompt` (and the final hidden states [S, L, H])."""
    logprobs, hidden = [], []
    for chunk in responses.split(CHUNK):
        tokens = torch.cat([torch.tensor(prompt).expand(len(chunk), -1), chunk], dim=1)
        states = model.model(input_ids=tokens).last_hidden_state[:, len(prompt) - 1:-1]  # [chunk, L, H]
        token_logprobs = torch.log_softmax(model.lm_head(states).double(), -1)
        logprobs.append(token_logprobs.gather(2, chunk[:, :, None]).squeeze(2))
        hidden.append(states if with_hidden else states[:, :0])
    return torch.cat(logprobs), torch.cat(hidden)


def build_spaces(seed: int, batch: int, noises: list[float], out_dir: Path):
    """The repeat's model (saved, for the engine check), its output projection [V, H] (the trainer's weights whose
    gradient is measured), prompts and their enumerated responses."""
    from transformers import AutoModelForCausalLM

    model_dir = save_random_hf_model(tiny_hf_config(**MODEL), out_dir / f"model_{seed}", seed=seed)
    generator = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, VOCAB, (PROMPT_TOKENS,), generator=generator).tolist() for _ in range(batch)]
    thresholds = torch.linspace(0.25, 0.75, batch, dtype=torch.float64)[torch.randperm(batch, generator=generator)]
    responses = all_responses()
    low_share = (responses < 2).double().mean(dim=1)  # [S]
    trainer = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    spaces = []
    for prompt, threshold in zip(prompts, thresholds):
        logprobs, hidden = score(trainer, prompt, responses, with_hidden=True)
        spaces.append(PromptSpace(responses, hidden, logprobs, (low_share >= threshold).double()))
    for noise in noises:  # the engine's perturbed copy, made by the engine's own WeightNoise
        engine = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        WeightNoise(noise, seed).apply(engine, [name for name, _ in engine.named_parameters(remove_duplicate=False)])
        for prompt, space in zip(prompts, spaces):
            space.engine_logprobs[noise] = score(engine, prompt, responses, with_hidden=False)[0]
    return model_dir, trainer.lm_head.weight.detach(), prompts, spaces


def expected_step(spaces: list[PromptSpace], weight: torch.Tensor, sampling: list[torch.Tensor],
                  token_weights: list[torch.Tensor], group: int) -> torch.Tensor:
    """E[step] [params] of G samples per prompt from `sampling` (per prompt [S] probabilities) with the correction's
    token weights (per prompt [S, L]), Dr.GRPO's advantage and the full batch's normaliser B G (seq-mean-token-mean)."""
    weight = weight.detach().clone().requires_grad_()
    total = 0.0
    for space, probability, token_weight in zip(spaces, sampling, token_weights):
        logprobs = torch.log_softmax(space.hidden @ weight.T, -1).gather(2, space.tokens[:, :, None]).squeeze(2)
        f = (token_weight * logprobs).mean(dim=1)  # [S] f_c(y) before the gradient: (1/L) Σ_t v_t log π(y_t)
        centred = space.rewards - (probability * space.rewards).sum()
        total = total + (probability * centred * f.double()).sum()  # its gradient: Cov(r, f_c)
    (gradient,) = torch.autograd.grad(total, weight)
    return -(group - 1) / (len(spaces) * group) * gradient.reshape(-1).double()


def sequence_probabilities(logprobs: torch.Tensor) -> torch.Tensor:
    probability = logprobs.sum(dim=1).exp()
    return probability / probability.sum()  # sums to 1 up to rounding: renormalised so draws and sums agree


@dataclass
class Sampled:
    """One sampled step's rollout, as the trainer's loss takes it (tokens of all samples concatenated)."""

    rewards: torch.Tensor  # [B, G]
    lengths: torch.Tensor  # [B, G]
    hidden: torch.Tensor  # [tokens, H]
    labels: torch.Tensor  # [tokens]
    trainer_logprobs: torch.Tensor  # [tokens]
    engine_logprobs: torch.Tensor  # [tokens]
    sample_of_token: torch.Tensor  # [tokens] flat sample index p G + g


def sample_step(spaces: list[PromptSpace], sampling: list[torch.Tensor], engine: list[torch.Tensor], group: int,
                generator: torch.Generator) -> Sampled:
    picks = [torch.multinomial(probability, group, replacement=True, generator=generator) for probability in sampling]
    tokens = torch.cat([space.tokens[pick] for space, pick in zip(spaces, picks)])  # [B G, L]
    return Sampled(
        torch.stack([space.rewards[pick] for space, pick in zip(spaces, picks)]),
        torch.full((len(spaces), group), RESPONSE_TOKENS),
        torch.cat([space.hidden[pick] for space, pick in zip(spaces, picks)]).flatten(0, 1),
        tokens.reshape(-1),
        torch.cat([space.trainer_logprobs[pick] for space, pick in zip(spaces, picks)]).reshape(-1),
        torch.cat([logprobs[pick] for logprobs, pick in zip(engine, picks)]).reshape(-1),
        torch.arange(len(tokens)).repeat_interleave(RESPONSE_TOKENS))


def selection_of(step: Sampled, pruner, prompt_decision: PromptDecision, estimator: str, draw: int):
    """The trainer's select_samples over the prompts `prompt_decision` kept, rows and advantages in the step's prompt
    rows. The prompt level decides before rollout; here every prompt is sampled and the pruned prompts' samples are
    left unused, which is the same in distribution (a prompt's samples do not depend on the others')."""
    rows = prompt_decision.kept
    selection = select_samples(step.rewards[rows], step.lengths[rows], prompt_decision, pruner, None,
                               prompt_decision.num_prompts, estimator, draw, 0.0)
    selection.rows = rows[selection.rows]
    advantages = torch.zeros_like(step.rewards)
    advantages[rows] = selection.advantages
    selection.advantages = advantages
    return selection


def step_gradient(weight: torch.Tensor, step: Sampled, selection, config) -> torch.Tensor:
    """∇ over lm_head [params] of the trainer's policy_loss on the selected samples with their weights, normalised
    by the full batch."""
    group = step.rewards.shape[1]
    flat = selection.rows * group + selection.columns  # [kept] flat sample index
    weight_of = torch.zeros(step.rewards.numel(), dtype=torch.float64)
    weight_of[flat] = selection.weights
    kept = torch.isin(step.sample_of_token, flat)
    owners = step.sample_of_token[kept]
    weight = weight.detach().clone().requires_grad_()
    logprobs = torch.log_softmax(step.hidden[kept] @ weight.T, -1).double()
    logprobs = logprobs.gather(1, step.labels[kept, None]).squeeze(1)
    loss, _ = policy_loss(config, logprobs=logprobs, old_logprobs=step.trainer_logprobs[kept],
                          advantages=selection.advantages.reshape(-1)[owners], loss_mask=torch.ones_like(logprobs),
                          sample_weights=weight_of[owners], sample_ids=owners,
                          normalizer=loss_normalizer(config, selection.normalizer_counts),
                          rollout_logprobs=step.engine_logprobs[kept])
    (gradient,) = torch.autograd.grad(loss, weight)
    return gradient.reshape(-1).double()


def token_weights(config, space: PromptSpace, engine: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The correction of every response: its token weights v_t [S, L], which tokens it caps or masks [S, L], and
    which responses it rejects [S] (the latter two as 0/1)."""
    if not config.rollout_correction.enabled:
        return torch.ones_like(engine), torch.zeros_like(engine), torch.zeros(len(engine), dtype=torch.float64)
    result = correction_weights(config.rollout_correction, space.trainer_logprobs.reshape(-1), engine.reshape(-1),
                                torch.ones(engine.numel(), dtype=torch.float64),
                                torch.arange(SEQUENCES).repeat_interleave(RESPONSE_TOKENS), SEQUENCES)
    return (result.weights.view_as(engine), (result.capped | result.masked).view_as(engine).double(),
            result.rejected.double())


def expectation(sampling: list[torch.Tensor], per_response: list[torch.Tensor]) -> float:
    """E_μ of a per-response value [S] over every prompt's responses, averaged over the prompts."""
    return statistics.mean(float((probability * value).sum()) for probability, value in zip(sampling, per_response))


def engine_check(model_dir: Path, noise: float, seed: int, prompts: list, spaces: list[PromptSpace],
                 group: int) -> tuple[float, float]:
    """The embedded engine started with --weight-noise `noise` samples every prompt G times: (max |its log-prob −
    the bench's perturbed copy's| over the sampled tokens, their mean |trainer − engine| log-prob gap)."""
    handle = launch_embedded_engine(str(model_dir), threads=1, enable_deterministic_inference=True,
                                    weight_noise=noise, weight_noise_seed=seed)
    try:
        completions = RolloutClient([handle.url]).generate(
            prompts, SamplingParams(temperature=1.0, max_new_tokens=RESPONSE_TOKENS, seed=seed), n=group)
    finally:
        handle.stop()
    worst, gaps = 0.0, []
    for completion in completions:
        space = spaces[completion.prompt_index]
        index = response_index(completion.output_ids)
        served = torch.tensor(completion.output_logprobs, dtype=torch.float64)
        worst = max(worst, float((served - space.engine_logprobs[noise][index]).abs().max()))
        gaps.append(float((served - space.trainer_logprobs[index]).abs().mean()))
    return worst, statistics.mean(gaps)


def run_repeat(seed: int, options) -> tuple[list[Row], list[str]]:
    model_dir, weight, prompts, spaces = build_spaces(seed, options.batch, options.noise, options.out_dir)
    configs = {label: loss_config(parse_args([*DPPO_FLAGS, *flags])) for label, flags in CORRECTIONS.items()}
    args = parse_args([*DPPO_FLAGS, "--rl-seed", str(seed)])
    name, fields = pruner_options(args)
    dppo, grpo = build_pruner(name, **fields), build_pruner("none")
    generator = torch.Generator().manual_seed(seed)
    trainer_sampling = [sequence_probabilities(space.trainer_logprobs) for space in spaces]
    ones = [torch.ones_like(space.trainer_logprobs) for space in spaces]
    on_policy = expected_step(spaces, weight, trainer_sampling, ones, options.group)
    scale = on_policy.norm()
    # the history DPPO's prompt level predicts from: one earlier group of every prompt, from the trainer's policy
    earlier = sample_step(spaces, trainer_sampling, [space.trainer_logprobs for space in spaces], options.group,
                          generator)
    history = PromptHistory()
    history.update(list(range(options.batch)),
                   score_prompts(earlier.rewards, compute_advantages(earlier.rewards, "dr_grpo"), dppo.prompt_score),
                   earlier.lengths.double().mean(dim=1), rewards=earlier.rewards)
    everything = PromptDecision.keep_all(options.batch)
    rows, notes = [], []
    for noise in (0.0, *options.noise):
        engine = [space.engine_logprobs[noise] if noise else space.trainer_logprobs for space in spaces]
        sampling = [sequence_probabilities(logprobs) for logprobs in engine]
        gap = sum(float((p[:, None] * (space.trainer_logprobs - e).abs()).sum()) / RESPONSE_TOKENS
                  for p, space, e in zip(sampling, spaces, engine)) / len(spaces)
        if noise:
            worst, served_gap = engine_check(model_dir, noise, seed, prompts, spaces, options.group)
            notes.append(f"seed {seed}, weight noise {noise:g}: the engine's log-probs differ from the bench's "
                         f"perturbed copy by at most {worst:.1e}; its samples' log-prob gap {served_gap:.4f} "
                         f"(exact: {gap:.4f})")
        names = list(CORRECTIONS) if noise else ["none"]
        expected, stats = {}, {}
        for correction in names:
            corrections = [token_weights(configs[correction], space, e) for space, e in zip(spaces, engine)]
            expected[correction] = expected_step(spaces, weight, sampling, [c[0] for c in corrections], options.group)
            stats[correction] = {"weight_mean": expectation(sampling, [c[0].mean(dim=1) for c in corrections]),
                                 "capped_or_masked": expectation(sampling, [c[1].mean(dim=1) for c in corrections]),
                                 "rejected": expectation(sampling, [c[2] for c in corrections])}
        sampled = {(on, correction): [] for on in (False, True) for correction in names}
        for draw in range(options.draws):
            step = sample_step(spaces, sampling, engine, options.group, generator)
            chosen = {False: selection_of(step, grpo, everything, args.advantage_estimator, draw),
                      True: selection_of(step, dppo, dppo.select_prompts(list(range(options.batch)), history, draw),
                                         args.advantage_estimator, draw)}
            for (on, correction), values in sampled.items():
                values.append(step_gradient(weight, step, chosen[on], configs[correction]))
        for (on, correction), values in sampled.items():
            values = torch.stack(values)
            mean = values.mean(dim=0)
            standard_error = values.var(dim=0).sum().sqrt() / math.sqrt(len(values))
            rows.append(Row(noise, gap, on, correction, float((expected[correction] - on_policy).norm() / scale),
                            float((values - mean).square().sum(dim=1).mean() / scale**2),
                            float((mean - expected[correction]).norm() / standard_error), **stats[correction]))
    return rows, notes


def median_rows(repeats: list[list[Row]]) -> list[Row]:
    """Each row's measured fields as the median over the repeats (rows matched by noise, DPPO and correction)."""
    measured = ("gap", "bias", "variance", "check_se", "weight_mean", "capped_or_masked", "rejected")
    return [Row(**{**asdict(group[0]), **{name: statistics.median(getattr(row, name) for row in group)
                                          for name in measured}})
            for group in zip(*repeats)]


def summary_tables(rows: list[Row]) -> str:
    """The table above by gap: each correction's bias (the same with DPPO on and off) with the sequences it rejects
    (or the tokens it caps or masks where it rejects none), and its variance with DPPO off / on."""
    noises = sorted({row.noise for row in rows if row.noise})
    gaps = {noise: next(row.gap for row in rows if row.noise == noise) for noise in noises}
    by_key = {(row.noise, row.dppo, row.correction): row for row in rows}
    header = ["correction", *(f"gap {gaps[noise]:.4f}" for noise in noises)]

    def cut(row):
        if row.rejected:
            return f" ({row.rejected:.1%} of sequences)"
        return f" ({row.capped_or_masked:.1%} of tokens)" if row.capped_or_masked else ""

    bias = markdown(header, [[correction, *(f"{by_key[noise, False, correction].bias:.3f}"
                                            f"{cut(by_key[noise, False, correction])}" for noise in noises)]
                             for correction in CORRECTIONS])
    exact = f"{by_key[0.0, False, 'none'].variance:.2f} / {by_key[0.0, True, 'none'].variance:.2f}"
    variance = markdown(header, [[correction, *(f"{by_key[noise, False, correction].variance:.2f} / "
                                                f"{by_key[noise, True, correction].variance:.2f}" for noise in noises)]
                                 for correction in CORRECTIONS])
    return (f"\nbias against the on-policy gradient (what the correction cuts):\n\n{bias}\n\nvariance, DPPO off / on "
            f"(the exact engine's, no correction: {exact}):\n\n{variance}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--noise", type=float, nargs="+", default=[0.0002, 0.002, 0.01, 0.03],
                        help="the engine's --weight-noise levels (relative to each weight's RMS)")
    parser.add_argument("--draws", type=int, default=400, help="sampled steps per gap, for the variance")
    parser.add_argument("--repeats", type=int, default=3, help="independent repeats (seeds); the table is their median")
    parser.add_argument("--batch", type=int, default=8, help="prompts per step (B)")
    parser.add_argument("--group", type=int, default=8, help="samples per prompt (G)")
    parser.add_argument("--out-dir", type=Path, default=Path("runs/bench_rollout_correction"),
                        help="where the tiny models are saved (the engine check serves them)")
    parser.add_argument("--json", type=Path, help="also write the rows (median and per repeat) here")
    options = parser.parse_args()
    start = time.perf_counter()
    repeats, notes = [], []
    for seed in range(options.repeats):
        rows, repeat_notes = run_repeat(seed, options)
        repeats.append(rows)
        notes += repeat_notes
    rows = median_rows(repeats)
    print("\n".join(notes))
    print(markdown(
        ["weight noise", "log-prob gap", "DPPO", "correction", "bias", "variance", "weight mean",
         "capped or masked tokens", "rejected sequences", "sampled mean vs exact (SE)"],
        [[f"{row.noise:g}", f"{row.gap:.4f}", "on" if row.dppo else "off", row.correction, f"{row.bias:.3f}",
          f"{row.variance:.2f}", f"{row.weight_mean:.3f}", f"{row.capped_or_masked:.3f}", f"{row.rejected:.3f}",
          f"{row.check_se:.2f}"] for row in rows]))
    print(summary_tables(rows))
    if options.json:
        options.json.write_text(json.dumps({"median": [asdict(row) for row in rows],
                                            "repeats": [[asdict(row) for row in repeat] for repeat in repeats]},
                                           indent=1))
    print(f"seconds: {time.perf_counter() - start:.0f}")


if __name__ == "__main__":
    main()
