"""Rollout, the trainer's side: SGLang-compatible client, launcher, vLLM backend and weight sync (docs/rollout.md).

The servers it starts (the embedded engine, vLLM's worker extension) live in megatron_dppo/servers/, which it names
by module path only and never imports.
"""

from megatron_dppo.rollout.client import Completion, RolloutClient, RolloutServerError, SamplingParams

__all__ = ["Completion", "RolloutClient", "RolloutServerError", "SamplingParams"]
