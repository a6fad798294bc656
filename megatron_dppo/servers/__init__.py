"""Server side of rollout: what runs inside a rollout server's process, never in the trainer's.

    embedded/          the embedded SGLang-compatible engine for CPU (`python -m megatron_dppo.servers.embedded`)
    vllm_extension.py  the worker extension vLLM mixes into its workers (runs in vLLM's own environment)

Both speak the weight-update wire protocol of megatron_dppo/weight_update_protocol.py. Nothing here imports the
client side (megatron_dppo/rollout/), which starts these servers by module path and talks to them over HTTP.
"""
