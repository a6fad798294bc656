"""Rank 0's weight syncer keeps a host copy of the synced weights only where a restarted server could get them from
nothing else (launch/run.py, keeps_host_copy): with TP = PP = 1 and synchronous rollouts the model on rank 0 still
holds the synced version while the servers generate, so a restarted server is re-synced from it, with no copy (for
Qwen3-4B, 8 GB of host memory and a device-to-host copy of every byte at every sync saved). Under TP or PP > 1 or
--async the copy stays; servers started elsewhere are never restarted from here."""

import pytest
import torch

from megatron_dppo.launch.arguments import parse_args
from megatron_dppo.launch.run import keeps_host_copy, start_rollout
from tests.test_rollout_engine import save_tiny_model, sequence_logprobs
from tests.test_weight_sync import PROBES, engine_probe_logprobs, perturbed_model


@pytest.mark.parametrize("flags, copy", [
    ([], False),
    (["--rollout-backend", "sglang"], False),
    (["--tensor-model-parallel-size", "2"], True),
    (["--pipeline-model-parallel-size", "2"], True),
    (["--async"], True),
    (["--rollout-backend", "external", "--rollout-urls", "http://node2:30000", "--tensor-model-parallel-size", "2"],
     False),
])
def test_a_host_copy_is_kept_only_where_rank_0_cannot_export_the_synced_weights_alone(flags, copy, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert keeps_host_copy(parse_args(["--dry-run", *flags])) is copy


def test_a_restarted_server_is_resynced_from_the_model_without_a_host_copy(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    model_dir = save_tiny_model(tmp_path / "model")
    trainer = perturbed_model(model_dir, seed=5)  # the "trained" weights, as rank 0's model exports them
    exports = []

    def synced_weights():
        exports.append(1)
        return iter(trainer.state_dict().items())

    args = parse_args(["--rollout-backend", "embedded", "--rollout-timeout-s", "60"])
    pool, client, syncer = start_rollout(args, model_dir, synced_weights)
    try:
        assert not syncer.keep_host_copy
        syncer.sync(synced_weights(), version=1)
        assert syncer.host_copy == []
        (url,) = pool.urls
        engine = pool.handles[url]
        engine.process.kill()
        engine.process.wait()
        pool.ensure_alive(url)
        assert engine.restarts == 1 and len(exports) == 2  # the restart exported the model's weights again
        for got, probe in zip(engine_probe_logprobs(url), PROBES):  # and the server holds them, not the file's
            torch.testing.assert_close(got, sequence_logprobs(trainer, probe[:1], probe[1:]), atol=1e-5, rtol=0)
        syncer.destroy_group()
    finally:
        pool.stop()
