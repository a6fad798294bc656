"""Rollout: SGLang-compatible client, embedded CPU engine, launcher and weight sync (see docs/rollout.md)."""

from megatron_dppo.rollout.client import Completion, RolloutClient, RolloutServerError, SamplingParams

__all__ = ["Completion", "RolloutClient", "RolloutServerError", "SamplingParams"]
