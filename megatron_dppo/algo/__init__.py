"""GRPO-family algorithms in pure PyTorch: advantages, the policy loss, pruners and the prompt history."""

from megatron_dppo.algo.advantages import ESTIMATORS, compute_advantages
from megatron_dppo.algo.dapo_filter import DAPOConfig, DAPOFilter, GroupDecision
from megatron_dppo.algo.history import PROMPT_SCORES, PromptHistory, score_prompts
from megatron_dppo.algo.losses import (
    AGGREGATIONS,
    KL_TYPES,
    FullBatchInfo,
    LossConfig,
    loss_normalizer,
    packed_policy_loss,
    policy_loss,
)
from megatron_dppo.algo.pruning import (
    PRUNERS,
    CompletionDecision,
    CPPOConfig,
    D3SConfig,
    DPPOConfig,
    PromptDecision,
    Pruner,
    build_pruner,
    full_batch_counts,
    max_variance_subset,
    proportional_keep_probs,
)

__all__ = [
    "AGGREGATIONS", "ESTIMATORS", "KL_TYPES", "PROMPT_SCORES", "PRUNERS", "CPPOConfig", "CompletionDecision",
    "D3SConfig", "DAPOConfig", "DAPOFilter", "DPPOConfig", "FullBatchInfo", "GroupDecision", "LossConfig",
    "PromptDecision", "PromptHistory", "Pruner", "build_pruner", "compute_advantages", "full_batch_counts",
    "loss_normalizer", "max_variance_subset", "packed_policy_loss", "policy_loss", "proportional_keep_probs",
    "score_prompts",
]
