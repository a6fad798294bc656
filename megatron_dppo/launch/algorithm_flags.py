"""The algorithm's flags (arguments.py adds them to the trainer's parser): --algorithm, DPPO's two levels, its
prompt-level sampling design and in-step probe, the other pruners (CPPO, D3S), the DAPO filter and dynamic sampling,
advantages, the loss, the prompt history.

    argv ─► add_flags (parse) ─► errors (one line per bad setting) ─► pipeline/experience.py pruner_options: the
         registry name and config fields of --algorithm's pruner (algo/pruning.py)

Like arguments.py, it imports no torch: the names of algo/history.py's PROMPT_SCORES and algo/sampling_designs.py's
SAMPLING_DESIGNS are written out here, and tests/test_pruning.py holds them equal.
"""

import argparse

from megatron_dppo.flags import (
    ABOVE_ONE,
    AT_LEAST_ONE,
    COUNT,
    COUNT_OR_NONE,
    FRACTION,
    NON_NEGATIVE,
    POSITIVE,
    RATE,
    RATE_OR_AUTO,
    changed_flags,
)

ALGORITHMS = ("grpo", "dppo", "cppo", "d3s")
PROMPT_SCORES = ("auto", "success_rate", "zero_variance", "mean_abs_advantage", "reward_std", "unsolved_rate")
SAMPLING_DESIGNS = ("systematic", "bernoulli")
# Clip ranges (eps_low, eps_high): DAPO's clip-higher for token-level ratios; a sequence-level (GSPO) ratio is the
# geometric mean of the token ratios, so it moves far less and GSPO's paper clips it at (3e-4, 4e-4).
TOKEN_CLIP, SEQUENCE_CLIP = (0.2, 0.28), (3e-4, 4e-4)


def add_flags(parser: argparse.ArgumentParser) -> None:
    algo = parser.add_argument_group("algorithm (--dppo-* and the other pruners)")
    algo.add_argument("--algorithm", choices=ALGORITHMS, default="dppo")
    # Defaults here equal the config dataclasses of algo/pruning.py and algo/dapo_filter.py and docs/algorithms.md's
    # table (a test holds them equal); they are written out so that parsing (and --dry-run) does not import torch.
    algo.add_argument("--dppo-prompt-prune-rate", type=RATE_OR_AUTO, default="auto",
                      help="expected fraction of the drawn prompts pruned before rollout; auto: the pool's recent "
                           "zero-variance share (about as many prompts are rolled out as are expected to teach)")
    algo.add_argument("--dppo-completion-prune-rate", type=RATE, default=0.0,
                      help="expected fraction of the completion candidates pruned after rewards (default 0, off: "
                           "the screening on docs/results.md found it does not pay on this task)")
    algo.add_argument("--dppo-mode", choices=("stochastic", "deterministic"), default="stochastic",
                      help="stochastic: unbiased (keep with probability p, weight 1/p); deterministic: the paper's "
                           "Algorithm 1 (biased)")
    algo.add_argument("--dppo-keep-policy", choices=("uniform", "proportional"), default="proportional",
                      help="keep probability 1 - rate for every candidate, or proportional to its score")
    algo.add_argument("--dppo-prompt-p-min", type=FRACTION, default=0.2,
                      help="floor of a prompt's keep probability (its importance weight is at most 1 / floor)")
    algo.add_argument("--dppo-completion-p-min", type=FRACTION, default=0.05)
    algo.add_argument("--dppo-candidates", choices=("all", "below_mean"), default="below_mean",
                      help="which items may be pruned: all, or those scoring <= the mean (of the batch for prompts, "
                           "of the group for completions)")
    algo.add_argument("--dppo-prompt-score", choices=PROMPT_SCORES, default="auto",
                      help="how the prompt level ranks prompts before rollout: auto, success_rate while every "
                           "reward is 0 or 1 and zero_variance once one is not; success_rate, the expected Σ A² of the "
                           "group under the history's Beta belief about the prompt's success rate (pass/fail "
                           "rewards; a stratum prior for unseen prompts); zero_variance, sqrt(1 - z), z an EMA-"
                           "predicted probability that the group's rewards are all equal; or an EMA of mean |A| or "
                           "reward std (0 for all-correct and all-wrong groups), or of unsolved_rate = 1 - mean "
                           "reward (0 only for solved prompts; rewards in [0, 1])")
    algo.add_argument("--dppo-prompt-sampling", choices=SAMPLING_DESIGNS, default="systematic",
                      help="how the prompt level draws the prompts it keeps: systematic, a fixed-size design that "
                           "keeps exactly --rollout-batch-size of the refill's draw, each with its keep probability; "
                           "bernoulli, an independent coin each (the count varies from step to step)")
    algo.add_argument("--dppo-probe-samples", type=COUNT_OR_NONE, default=0,
                      help="the in-step probe: roll out this many samples of each of --dppo-probe-prompts prompts "
                           "first, then continue exactly --rollout-batch-size groups, those whose probe varied "
                           "first; a continued group weighs 1 / its probability of being continued; 0: off")
    algo.add_argument("--dppo-probe-prompts", type=COUNT_OR_NONE, default=0,
                      help="prompts the probe rolls out per step (0: twice --rollout-batch-size)")
    algo.add_argument("--dppo-probe-p-min", type=FRACTION, default=0.1,
                      help="floor of a probed group's probability of being continued (its weight is at most "
                           "1 / floor)")
    algo.add_argument("--dppo-refill", action=argparse.BooleanOptionalAction, default=True,
                      help="draw B / (1 - prompt prune rate) prompts so that about B are rolled out (the freed rollout "
                           "slots go to other prompts; the normaliser is the drawn batch's, so it stays unbiased)")
    algo.add_argument("--dppo-refill-max", type=AT_LEAST_ONE, default=4.0,
                      help="the refill draws at most this many times --rollout-batch-size prompts")
    algo.add_argument("--dppo-importance-weights", action=argparse.BooleanOptionalAction, default=True,
                      help="weight kept prompts by 1 / keep probability and normalise by the drawn batch (unbiased); "
                           "--no-dppo-importance-weights trains the kept prompts as if they were the batch (biased)")
    algo.add_argument("--cppo-prune-rate", type=RATE, default=0.5)
    algo.add_argument("--cppo-scope", choices=("per_group", "batch"), default="per_group")
    algo.add_argument("--cppo-refill", action="store_true", help="draw batch / (1 - P) prompts (CPPO's allocation)")
    algo.add_argument("--d3s-sample-fraction", type=FRACTION, nargs=2, default=(0.25, 0.75),
                      metavar=("INIT", "FINAL"),
                      help="fraction of samples D3S keeps at the run's start and end (linear over its progress)")
    algo.add_argument("--d3s-token-fraction", type=FRACTION, nargs=2, default=(0.5, 1.0), metavar=("INIT", "FINAL"),
                      help="fraction of the kept samples' tokens D3S keeps at the run's start and end")
    algo.add_argument("--dapo-filter", action=argparse.BooleanOptionalAction, default=False,
                      help="drop groups whose rewards are all equal (the normaliser still counts them)")
    algo.add_argument("--dapo-oversample", type=AT_LEAST_ONE, default=1.0,
                      help="draw this many times the batch; when more groups are varied than the batch holds, a "
                           "random batch-size subset trains, each weighted by varied / batch size (with "
                           "--dapo-dynamic-sampling: the size of each round, in batches)")
    algo.add_argument("--dapo-dynamic-sampling", action="store_true",
                      help="DAPO's dynamic sampling (--algorithm grpo): generate rounds of prompts until the batch "
                           "holds --rollout-batch-size groups with varied rewards, and train those as the batch "
                           "(biased; DPPO's --dppo-refill is the unbiased way to fill the batch)")
    algo.add_argument("--dapo-max-rounds", type=COUNT, default=10,
                      help="--dapo-dynamic-sampling: at most this many rounds per step (a shorter batch trains then)")
    algo.add_argument("--advantage-estimator", choices=("grpo", "dr_grpo", "rloo"), default="grpo")
    algo.add_argument("--loss-agg-mode", default="token-mean",
                      choices=("seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"))
    algo.add_argument("--eps-clip", type=RATE, default=None,
                      help=f"lower clip range (default {TOKEN_CLIP[0]} for token-level ratios, {SEQUENCE_CLIP[0]} for "
                           "--importance-level sequence, as GSPO's paper)")
    algo.add_argument("--eps-clip-high", type=NON_NEGATIVE, default=None,
                      help=f"upper clip range (default {TOKEN_CLIP[1]} token level, {SEQUENCE_CLIP[1]} sequence level)")
    algo.add_argument("--eps-clip-c", type=ABOVE_ONE, default=None, help="dual-clip constant (e.g. 3)")
    algo.add_argument("--kl-coef", type=NON_NEGATIVE, default=0.0, help="> 0 loads a frozen reference model")
    algo.add_argument("--kl-type", choices=("k1", "k2", "k3", "low_var_kl"), default="low_var_kl")
    algo.add_argument("--entropy-coef", type=NON_NEGATIVE, default=0.0)
    algo.add_argument("--importance-level", choices=("token", "sequence"), default="token", help="sequence: GSPO")
    algo.add_argument("--ppo-epochs", type=COUNT, default=1, help="update passes over each rollout batch")
    algo.add_argument("--history-ema-decay", type=RATE, default=0.5,
                      help="per-visit decay of a prompt's history (0: its latest visit alone)")
    algo.add_argument("--history-prior-strength", type=POSITIVE, default=2.0,
                      help="weight, in visits, of a prompt's difficulty-stratum prior in its zero-variance prediction")
    algo.add_argument("--history-sample-weight", type=FRACTION, default=0.25,
                      help="weight of one sample in a prompt's success counts against its stratum's prior (the "
                           "success-rate score): below 1 since the policy moves between visits (bench/"
                           "prompt_prediction.py's replay of GRPO runs: Brier 0.157 at 0.25 against 0.167 at 1)")


def errors(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[str]:
    """DPPO's options given to another --algorithm, floors above their keep fractions, the probe's needs, and D3S
    without a run length to schedule over."""
    errors = []
    dppo_flags = changed_flags(args, parser, "--dppo-prompt-prune-rate", "--dppo-completion-prune-rate", "--dppo-mode",
                               "--dppo-prompt-score", "--dppo-prompt-sampling", "--dppo-probe-samples",
                               "--no-dppo-refill", "--no-dppo-importance-weights")
    if dppo_flags and args.algorithm != "dppo":
        errors.append(f"{dppo_flags[0]} only applies to --algorithm dppo, but --algorithm is {args.algorithm}: "
                      f"drop {dppo_flags[0]} or use --algorithm dppo")
    if args.algorithm == "dppo" and args.dppo_keep_policy == "proportional":
        for level in ("prompt", "completion"):
            p_min, rate = getattr(args, f"dppo_{level}_p_min"), getattr(args, f"dppo_{level}_prune_rate")
            if rate != "auto" and rate > 0 and p_min > 1 - rate:
                errors.append(f"--dppo-{level}-p-min {p_min} exceeds the keep fraction 1 - --dppo-{level}-prune-rate "
                              f"{rate}: the floor alone would keep more than asked; lower --dppo-{level}-p-min or "
                              f"--dppo-{level}-prune-rate (or use --dppo-keep-policy uniform)")
    errors += probe_errors(args, parser)
    if args.algorithm == "d3s" and args.train_iters is None and args.time_budget_s is None:
        errors.append("--algorithm d3s relaxes its sample and token fractions over the run: give its length with "
                      "--train-iters or --time-budget-s")
    return errors


def probe_errors(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[str]:
    """The probe's flags without the probe, and the probe where it cannot run."""
    if not args.dppo_probe_samples:
        given = changed_flags(args, parser, "--dppo-probe-prompts", "--dppo-probe-p-min")
        return [f"{given[0]} applies to the in-step probe: add --dppo-probe-samples K or drop it"] if given else []
    found = []
    if args.dppo_probe_samples >= args.n_samples_per_prompt:
        found.append(f"--dppo-probe-samples {args.dppo_probe_samples} must be below --n-samples-per-prompt "
                     f"{args.n_samples_per_prompt}: the probe rolls out the first samples of a group")
    if args.dppo_mode != "stochastic" or args.dppo_prompt_score not in ("auto", "success_rate"):
        found.append("--dppo-probe-samples continues groups by the success-rate belief and weighs them by 1 / "
                     "P(continue): it needs --dppo-mode stochastic and --dppo-prompt-score auto or success_rate")
    probed = args.dppo_probe_prompts or 2 * args.rollout_batch_size
    if probed < args.rollout_batch_size:
        found.append(f"--dppo-probe-prompts {probed} is below --rollout-batch-size {args.rollout_batch_size}: the "
                     "probe continues a batch's worth of the groups it probed; probe at least that many")
    for flag, dest in (("--partial-rollout", "partial_rollout"), ("--dapo-dynamic-sampling", "dapo_dynamic_sampling"),
                       ("--async", "async_rollout")):
        if getattr(args, dest, False):
            found.append(f"--dppo-probe-samples rolls a step out in two rounds of its own: drop {flag}")
    return found
