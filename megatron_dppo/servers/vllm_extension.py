"""What runs inside the vLLM server's own Python environment: our worker extension.

    python -m vllm.entrypoints.openai.api_server <vLLM server flags>   (behind the launcher's tether)
    ─► vLLM's OpenAI-compatible server, which mixes WeightSyncExtension into its workers
       (`--worker-extension-cls megatron_dppo.servers.vllm_extension.WeightSyncExtension`)

The trainer calls the extension through POST /collective_rpc (rollout/vllm.py), one JSON string argument per call:

    dppo_join_weight_group ─► dppo_begin_weight_update ─► dppo_receive_bucket x N ─► dppo_end_weight_update
    (rank offset + this         (vLLM's layerwise reload:     (one broadcast into a uint8     (vLLM finishes each
     worker's rank in the        layers back to checkpoint     buffer, unpacked by name,      layer's post-load step,
     trainer's gloo/NCCL group)  format, loaders deferred)     model.load_weights)            records the version)

This module imports torch, vLLM, weight_update_protocol's bucket helpers and platform.collectives; nothing of
Megatron or of the client side (rollout/), and the trainer's process never imports it.
"""

from __future__ import annotations

import json

from megatron_dppo.platform import collectives
from megatron_dppo.weight_update_protocol import init_weight_update_group, tensor_nbytes, unpack_bucket


class WeightSyncExtension:
    """Mixed into vLLM's worker class (so `self` is the worker: vllm_config, model_runner, device).

    vLLM refuses an extension attribute that its worker already has (it has start_weight_update, update_weights,
    ...), hence the dppo_ prefix. Each method takes one JSON string, as /collective_rpc promises only string
    arguments, and returns a dict (what the route passes through as JSON)."""

    def _dppo_vllm_config_context(self):
        from vllm.config import set_current_vllm_config

        return set_current_vllm_config(self.vllm_config)

    def dppo_join_weight_group(self, request: str) -> dict:
        """Join the trainer's group at rank_offset + this worker's rank across vLLM's data-parallel replicas."""
        fields = json.loads(request)
        parallel = self.vllm_config.parallel_config
        rank = fields["rank_offset"] + parallel.data_parallel_index * parallel.world_size + parallel.rank
        self._dppo_group = init_weight_update_group(fields["backend"], fields["master_address"],
                                                    fields["master_port"], rank, fields["world_size"],
                                                    fields["group_name"], fields.get("timeout_s", 120.0))
        self._dppo_version = getattr(self, "_dppo_version", None)
        return {"rank": rank}

    def dppo_leave_weight_group(self, request: str) -> dict:
        import torch.distributed

        group = getattr(self, "_dppo_group", None)
        if group is not None:
            torch.distributed.destroy_process_group(group)
            self._dppo_group = None
        return {"left": group is not None}

    def dppo_begin_weight_update(self, request: str) -> dict:
        """vLLM's own reload lifecycle (as its NCCL weight-transfer engine uses it): every layer goes back to its
        checkpoint-format parameters and defers its post-load processing until all its weights have arrived."""
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        with self._dppo_vllm_config_context():
            initialize_layerwise_reload(self.model_runner.get_model())
        return {}

    def dppo_receive_bucket(self, request: str) -> dict:
        """Receive one flat bucket (weight_update_protocol.pack_bucket's layout) broadcast by group rank 0 and load
        it by HF name through the model's own load_weights (which fuses q/k/v, gate/up and skips tied heads)."""
        import torch

        fields = json.loads(request)
        group = getattr(self, "_dppo_group", None)
        if group is None:
            raise RuntimeError("dppo_receive_bucket before dppo_join_weight_group: join the weight-sync group first")
        nbytes = sum(tensor_nbytes(dtype, shape) for dtype, shape in zip(fields["dtypes"], fields["shapes"]))
        flat = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        collectives.broadcast(group, flat, 0, f"weight bucket {fields['names'][0]} .. {fields['names'][-1]}").wait()
        tensors = unpack_bucket(flat, fields["names"], fields["dtypes"], fields["shapes"])
        tensors += self._dppo_tied_head(tensors)
        with self._dppo_vllm_config_context():
            loaded = self.model_runner.get_model().load_weights(weights=tensors)
        return {"tensors": len(tensors), "loaded": len(loaded) if loaded is not None else None}

    def _dppo_tied_head(self, tensors: list) -> list:
        """The embedding again under the LM head's name when the two are tied and the head's name is not sent (HF
        checkpoints of tied models leave it out). vLLM's reload re-processes only the layers that receive weights,
        and its CPU build keeps a packed copy of the head's weight for its GEMM: a tied head that received nothing
        would keep computing logits with the old weights."""
        if not getattr(self.model_runner.model_config.hf_config, "tie_word_embeddings", False):
            return []
        names = {name for name, _ in tensors}
        if "lm_head.weight" in names:
            return []
        return [("lm_head.weight", tensor) for name, tensor in tensors if name == "model.embed_tokens.weight"]

    def dppo_end_weight_update(self, request: str) -> dict:
        """Finish the reload (each layer's process_weights_after_loading, e.g. the CPU GEMM weight packing) and
        record the version these weights carry."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        fields = json.loads(request)
        with self._dppo_vllm_config_context():
            finalize_layerwise_reload(self.model_runner.get_model(), self.model_runner.model_config)
        self._dppo_version = fields["weight_version"]
        return {"weight_version": self._dppo_version}

    def dppo_weight_version(self, request: str) -> dict:
        return {"weight_version": getattr(self, "_dppo_version", None)}
