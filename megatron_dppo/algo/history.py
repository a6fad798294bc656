"""Per-prompt history for DPPO's prompt level: what past visits of a prompt (and of its difficulty stratum) say
about its next group, known BEFORE rollout.

after rewards:  history.update(prompt_ids, scores, mean_response_lengths, rewards=[P, G], difficulties=[P])
after a probe:  history.update_probe(prompt_ids, passes, probe_size)   (groups the probe did not continue)
before rollout: history.lookup(prompt_ids)                         → score EMA, mean response length, seen
                history.success_rate_posterior(ids, difficulties)  → (a, b) [P]: Beta belief about each success rate
                history.zero_variance_probability(ids, difficulties) → z [P]: P(the next group's rewards are all equal)
                history.expected_lengths(ids, difficulties)          → [P] mean response length: the prompt's, else its
                                                                       stratum's, else the pool's

The zero-variance predictor (`zero_variance`, the default before the success-rate one): per prompt, an EMA over
its visits of the indicator "the group was zero-variance" (decay `ema_decay` per visit; a zero-variance group has
advantage 0 and no policy gradient). It is shrunk towards a prior with the weight of `prior_strength` visits:

    z_i = (prior_strength · z_stratum + Σ_v decay^age(v) · zero_variance_v) / (prior_strength + Σ_v decay^age(v))

z_stratum is the zero-variance share of the prompt's difficulty stratum (the synthetic task's cell, MATH's level
and type), an EMA over the stratum's recent groups, and the pool's share where the stratum has none yet. A prompt
never seen gets the prior alone: that is what is known about it before its first rollout. Before anything has been
rolled out there is no prior, and z is NaN (the prompt level then keeps every prompt). bench/prompt_prediction.py
measured it on GRPO runs: docs/algorithms.md.

The success-rate predictor (`success_rate`; the default `auto` uses it while every reward is 0 or 1, and the
zero-variance one after a graded reward): per prompt, discounted counts of passing and failing samples (decay
`ema_decay` per visit, each sample weighing `sample_weight`: the policy moves between visits, so a visit's 8 samples
say less about the next group than 8 fresh ones would; an in-step probe's samples included), on top of a Beta prior
fitted to its stratum's recent groups (algo/beta_binomial.py prior_matching: their mean success fraction and their
zero-variance share): a stratum of mostly all-wrong and all-right prompts gets a U-shaped prior,
so an unseen prompt there is predicted zero-variance as often as such prompts are. The prompt's success rate
p ~ Beta(a_stratum + passes, b_stratum + fails), and

    z_i = E[p^G] + E[(1 - p)^G]          (success_rate_posterior, then beta_binomial.all_equal_probability)

uses how often the prompt passed, not only whether its groups varied: a prompt that passed 1 of 8 and one that
passed 4 of 8 are told apart.

The other scores (mean_abs_advantage, reward_std, unsolved_rate) are an EMA per prompt of a per-visit score; a
prompt never seen has none. The state is plain tensors and numbers: state_dict() into a checkpoint,
load_state_dict() back, so a resumed run predicts exactly as the straight one.
"""

import math

import torch

from megatron_dppo.algo.advantages import check_rewards, reject_rewards
from megatron_dppo.algo.beta_binomial import prior_matching
from megatron_dppo.errors import UserInputError

PROMPT_SCORES = ("auto", "success_rate", "zero_variance", "mean_abs_advantage", "reward_std", "unsolved_rate")
# the scores that predict a prompt's next group from its pass counts or zero-variance indicators (every prompt has one
# once anything was rolled out: its stratum's prior); the others are an EMA of a per-visit score
PREDICTIVE_SCORES = ("auto", "success_rate", "zero_variance")
STRATUM_DECAY = 0.98  # per group of the stratum: its prior follows the last ~50 groups, as the policy changes
POOL = "\0pool"  # the stratum key that pools every group (the prior of a stratum with no groups yet)


def score_prompts(rewards: torch.Tensor, advantages: torch.Tensor, score: str = "mean_abs_advantage") -> torch.Tensor:
    """One score per prompt [num_prompts] from its full group (the EMA scores; zero_variance records the indicator).

    mean_abs_advantage: mean |A|; reward_std: the std of its rewards (0 when G = 1); both are 0 for an all-correct
    AND for an all-wrong group. unsolved_rate: 1 - mean reward, for rewards in [0, 1]: 0 only for a prompt the
    policy already solves every time, so a prompt it has not solved yet (which may become learnable as the policy
    improves) is not scored as worthless. zero_variance: 1 for a group whose rewards are all equal, else 0.
    """
    check_rewards(rewards)
    if score in PREDICTIVE_SCORES:  # the indicator; the success-rate belief counts passes too (update's rewards)
        return zero_variance_groups(rewards).to(rewards.dtype)
    if score == "mean_abs_advantage":
        return advantages.abs().mean(dim=1)
    if score == "reward_std":
        return rewards.std(dim=1) if rewards.shape[1] > 1 else torch.zeros(rewards.shape[0], dtype=rewards.dtype)
    if score == "unsolved_rate":
        reject_rewards((rewards < 0) | (rewards > 1), rewards, "rewards outside [0, 1]",
                       "prompt score 'unsolved_rate' needs rewards in [0, 1]; use --dppo-prompt-score "
                       "mean_abs_advantage for this reward")
        return 1.0 - rewards.mean(dim=1)
    raise ValueError(f"unknown prompt score {score!r}: choose one of {PROMPT_SCORES}")


def zero_variance_groups(rewards: torch.Tensor) -> torch.Tensor:
    """[P] bool: the groups whose rewards are all equal (advantage 0 under every estimator)."""
    return (rewards == rewards[:, :1]).all(dim=1)


def pass_fail(rewards: torch.Tensor) -> bool:
    """Whether every reward is 0 or 1: the success-rate predictor counts passes."""
    return bool(((rewards == 0) | (rewards == 1)).all())


class PromptHistory:
    """Per prompt id: EMAs of a score, of the zero-variance indicator and of the mean response length; per difficulty
    stratum: the zero-variance share and mean response length of its recent groups (the prior of unseen prompts)."""

    def __init__(self, ema_decay: float = 0.5, prior_strength: float = 2.0, sample_weight: float = 0.25):
        if not 0.0 <= ema_decay < 1.0:
            raise ValueError(f"ema_decay must be in [0, 1), got {ema_decay}: 0 keeps only the latest visit")
        if not prior_strength > 0.0:
            raise ValueError(f"prior_strength must be > 0, got {prior_strength}: it is the prior's weight in visits")
        if not 0.0 < sample_weight <= 1.0:
            raise ValueError(f"sample_weight must be in (0, 1], got {sample_weight}: a sample's weight in its prompt's "
                             "success counts")
        self.ema_decay, self.prior_strength, self.sample_weight = ema_decay, prior_strength, sample_weight
        self._scores: dict[int, float] = {}
        self._lengths: dict[int, float] = {}
        self._visits: dict[int, int] = {}
        # per prompt: Σ decay^age · zero_variance and Σ decay^age (the discounted visit count)
        self._zero_variance: dict[int, tuple[float, float]] = {}
        # per stratum: discounted (groups, zero-variance groups, Σ mean response length)
        self._strata: dict[str, tuple[float, float, float]] = {}
        # per prompt: discounted (passing, failing) samples; per stratum: discounted (groups, Σ k/G)
        self._passes: dict[int, tuple[float, float]] = {}
        self._strata_success: dict[str, tuple[float, float, float]] = {}
        self.group_size = 0  # G of the groups folded into the strata's success means
        self.rewards_pass_fail = True  # False once a reward other than 0 or 1 was folded

    def __len__(self) -> int:
        return len(self._scores)

    def update(self, prompt_ids, scores, mean_response_lengths=None, rewards=None, difficulties=None,
               weights=None) -> None:
        """Fold one visit of each prompt: its score into the score EMA, its mean response length (optional, per
        prompt), and, given its rewards [P, G], whether its group was zero-variance, per prompt and per stratum
        (`difficulties`, one string per prompt; default: one stratum for all). `weights` (default 1) are the
        prompts' inverse keep probabilities: a stratum's share then estimates that of every drawn prompt, not only
        of those the prompt level kept (Horvitz-Thompson)."""
        prompt_ids = [int(prompt_id) for prompt_id in prompt_ids]
        scores = torch.as_tensor(scores, dtype=torch.float64).reshape(-1).tolist()
        lengths = (
            [None] * len(prompt_ids)
            if mean_response_lengths is None
            else torch.as_tensor(mean_response_lengths, dtype=torch.float64).reshape(-1).tolist()
        )
        zero_variance = [None] * len(prompt_ids) if rewards is None else zero_variance_groups(
            torch.as_tensor(rewards)).tolist()
        difficulties = [""] * len(prompt_ids) if difficulties is None else [str(d) for d in difficulties]
        weights = [1.0] * len(prompt_ids) if weights is None else torch.as_tensor(weights).reshape(-1).tolist()
        if rewards is not None and mean_response_lengths is None:
            raise ValueError("history.update got rewards without mean_response_lengths: the stratum statistics need "
                             "both (pass the groups' mean response lengths)")
        if not len(prompt_ids) == len(scores) == len(lengths) == len(zero_variance) == len(difficulties) == len(
                weights):
            raise ValueError(
                f"history.update got {len(prompt_ids)} prompt ids, {len(scores)} scores, {len(lengths)} lengths, "
                f"{len(zero_variance)} reward rows, {len(difficulties)} difficulties and {len(weights)} weights: pass "
                "one of each per prompt"
            )
        passes = [None] * len(prompt_ids)
        if rewards is not None:
            rewards = torch.as_tensor(rewards, dtype=torch.float64)
            self.rewards_pass_fail = self.rewards_pass_fail and pass_fail(rewards)
            if self.rewards_pass_fail and rewards.numel():
                self.group_size = rewards.shape[1]
                passes = rewards.sum(dim=1).tolist()
        for prompt_id, score, length, zero, difficulty, weight, passed in zip(
                prompt_ids, scores, lengths, zero_variance, difficulties, weights, passes):
            if not math.isfinite(score):
                raise ValueError(f"score of prompt id {prompt_id} is {score}: history scores must be finite")
            self._scores[prompt_id] = self._fold(self._scores.get(prompt_id), score)
            if length is not None:
                self._lengths[prompt_id] = self._fold(self._lengths.get(prompt_id), length)
            self._visits[prompt_id] = self._visits.get(prompt_id, 0) + 1
            if zero is not None:
                total, visits = self._zero_variance.get(prompt_id, (0.0, 0.0))
                self._zero_variance[prompt_id] = (self.ema_decay * total + zero, self.ema_decay * visits + 1.0)
                for stratum in {difficulty, POOL}:
                    groups, zeros, length_sum = self._strata.get(stratum, (0.0, 0.0, 0.0))
                    self._strata[stratum] = (STRATUM_DECAY * groups + weight, STRATUM_DECAY * zeros + weight * zero,
                                             STRATUM_DECAY * length_sum + weight * length)
            if passed is not None:
                self._fold_passes(prompt_id, passed, self.group_size)
                for stratum in {difficulty, POOL}:
                    groups, total = self._strata_success.get(stratum, (0.0, 0.0))
                    self._strata_success[stratum] = (STRATUM_DECAY * groups + weight,
                                                     STRATUM_DECAY * total + weight * passed / self.group_size)

    def update_probe(self, prompt_ids, passes, probe_size: int) -> None:
        """Fold an in-step probe's samples of prompts whose groups were not continued: `passes` [P] of `probe_size`
        pass/fail samples each. Their counts only: a stopped group's zero-variance indicator, length and score are
        unknown, and the stratum's means are of whole groups."""
        for prompt_id, passed in zip([int(i) for i in prompt_ids], torch.as_tensor(passes).reshape(-1).tolist()):
            self._fold_passes(prompt_id, float(passed), probe_size)

    def _fold_passes(self, prompt_id: int, passed: float, samples: int) -> None:
        old_passes, old_fails = self._passes.get(prompt_id, (0.0, 0.0))
        self._passes[prompt_id] = (self.ema_decay * old_passes + self.sample_weight * passed,
                                   self.ema_decay * old_fails + self.sample_weight * (samples - passed))

    def _fold(self, old: float | None, new: float) -> float:
        return new if old is None else self.ema_decay * old + (1.0 - self.ema_decay) * new

    def lookup(self, prompt_ids) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(scores, mean response lengths, seen) [num_prompts] each; NaN where nothing is recorded."""
        prompt_ids = [int(prompt_id) for prompt_id in prompt_ids]
        scores = torch.tensor([self._scores.get(i, math.nan) for i in prompt_ids], dtype=torch.float64)
        lengths = torch.tensor([self._lengths.get(i, math.nan) for i in prompt_ids], dtype=torch.float64)
        return scores, lengths, ~torch.isnan(scores)

    def _stratum(self, difficulty: str) -> tuple[float, float, float] | None:
        """The stratum's discounted (groups, zero-variance groups, length sum), the pool's where it has none."""
        return self._strata.get(str(difficulty)) or self._strata.get(POOL)

    def zero_variance_probability(self, prompt_ids, difficulties=None) -> torch.Tensor:
        """[P] float64: each prompt's predicted probability that its next group is zero-variance (module docstring);
        NaN while no group at all has been recorded."""
        difficulties = [""] * len(prompt_ids) if difficulties is None else difficulties
        probabilities = []
        for prompt_id, difficulty in zip(prompt_ids, difficulties):
            stratum = self._stratum(difficulty)
            if stratum is None:
                probabilities.append(math.nan)
                continue
            prior = stratum[1] / stratum[0]
            total, weight = self._zero_variance.get(int(prompt_id), (0.0, 0.0))
            probabilities.append((self.prior_strength * prior + total) / (self.prior_strength + weight))
        return torch.tensor(probabilities, dtype=torch.float64)

    def success_rate_posterior(self, prompt_ids, difficulties=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(a, b) [P] float64 each: the Beta belief about each prompt's success rate, its stratum's prior (the pool's
        where the stratum has no groups yet) plus its discounted passes and fails; NaN while no whole group has been
        recorded. Raises where a folded reward was not pass/fail (the prediction counts passes)."""
        if not self.rewards_pass_fail:
            raise UserInputError("--dppo-prompt-score success_rate counts passing samples, but a reward other than 0 "
                                 "or 1 was recorded: use --dppo-prompt-score auto or zero_variance for a graded "
                                 "reward")
        difficulties = [""] * len(prompt_ids) if difficulties is None else difficulties
        priors = {}
        a, b = [], []
        for prompt_id, difficulty in zip(prompt_ids, difficulties):
            key = str(difficulty) if str(difficulty) in self._strata_success else POOL
            if key not in priors:
                success, groups = self._strata_success.get(key), self._strata.get(key)
                priors[key] = (math.nan, math.nan) if success is None or success[0] <= 0 else prior_matching(
                    success[1] / success[0], groups[1] / groups[0], self.group_size)
            passed, failed = self._passes.get(int(prompt_id), (0.0, 0.0))
            a.append(priors[key][0] + passed)
            b.append(priors[key][1] + failed)
        return torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)

    def expected_lengths(self, prompt_ids, difficulties=None) -> torch.Tensor:
        """[P] float64: the prompt's mean response length EMA, else its stratum's recent mean, else the pool's; NaN
        where nothing is known (before any rollout)."""
        difficulties = [""] * len(prompt_ids) if difficulties is None else difficulties
        _, lengths, _ = self.lookup(prompt_ids)
        for index, (length, difficulty) in enumerate(zip(lengths.tolist(), difficulties)):
            stratum = self._stratum(difficulty)
            if math.isnan(length) and stratum is not None and stratum[2] > 0:
                lengths[index] = stratum[2] / stratum[0]
        return lengths

    def zero_variance_share(self) -> float:
        """The pool's recent zero-variance share (NaN before any group): the refill's estimate of the prune rate."""
        pool = self._strata.get(POOL)
        return math.nan if pool is None else pool[1] / pool[0]

    def visits(self, prompt_id: int) -> int:
        return self._visits.get(int(prompt_id), 0)

    def state_dict(self) -> dict:
        ids = sorted(self._scores)
        strata = sorted(self._strata)
        return {
            "ema_decay": self.ema_decay,
            "prior_strength": self.prior_strength,
            "sample_weight": self.sample_weight,
            "prompt_ids": torch.tensor(ids, dtype=torch.int64),
            "scores": torch.tensor([self._scores[i] for i in ids], dtype=torch.float64),
            "mean_response_lengths": torch.tensor([self._lengths.get(i, math.nan) for i in ids], dtype=torch.float64),
            "visits": torch.tensor([self._visits[i] for i in ids], dtype=torch.int64),
            "zero_variance": torch.tensor([self._zero_variance.get(i, (math.nan, math.nan)) for i in ids],
                                          dtype=torch.float64).reshape(len(ids), 2),
            "strata": strata,
            "strata_counts": torch.tensor([self._strata[s] for s in strata], dtype=torch.float64).reshape(-1, 3),
            "passes_prompt_ids": torch.tensor(sorted(self._passes), dtype=torch.int64),
            "passes": torch.tensor([self._passes[i] for i in sorted(self._passes)],
                                   dtype=torch.float64).reshape(-1, 2),
            "success_strata": sorted(self._strata_success),
            "success_strata_means": torch.tensor([self._strata_success[s] for s in sorted(self._strata_success)],
                                                 dtype=torch.float64).reshape(-1, 2),
            "group_size": self.group_size,
            "rewards_pass_fail": self.rewards_pass_fail,
        }

    def load_state_dict(self, state: dict) -> None:
        missing = {"ema_decay", "prior_strength", "prompt_ids", "scores", "mean_response_lengths", "visits",
                   "zero_variance", "strata", "strata_counts"} - set(state)
        if missing:
            raise ValueError(f"prompt history state lacks {sorted(missing)}: it was not written by state_dict() of "
                             "this version")
        self.ema_decay, self.prior_strength = float(state["ema_decay"]), float(state["prior_strength"])
        ids = state["prompt_ids"].tolist()
        self._scores = dict(zip(ids, state["scores"].tolist()))
        self._lengths = {i: v for i, v in zip(ids, state["mean_response_lengths"].tolist()) if not math.isnan(v)}
        self._visits = dict(zip(ids, state["visits"].tolist()))
        self._zero_variance = {i: tuple(pair) for i, pair in zip(ids, state["zero_variance"].tolist())
                               if not math.isnan(pair[0])}
        self._strata = {s: tuple(counts) for s, counts in zip(state["strata"], state["strata_counts"].tolist())}
        # the success counts came later: a checkpoint without them starts them afresh (the predictor then relies on
        # the strata's new groups)
        self._passes = {i: tuple(pair) for i, pair in zip(state.get("passes_prompt_ids", torch.zeros(0)).tolist(),
                                                           state.get("passes", torch.zeros(0, 2)).tolist())}
        self._strata_success = {s: tuple(m) for s, m in zip(state.get("success_strata", []),
                                                            state.get("success_strata_means",
                                                                      torch.zeros(0, 2)).tolist())}
        self.group_size = int(state.get("group_size", 0))
        self.sample_weight = float(state.get("sample_weight", self.sample_weight))
        self.rewards_pass_fail = bool(state.get("rewards_pass_fail", True))
