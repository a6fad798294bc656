"""Weights broadcast by the trainer-side syncer land in the engine by HF name, bit for bit, in buckets."""

import subprocess
import sys

import torch

from megatron_dppo.rollout.client import RolloutClient, SamplingParams, control_request
from megatron_dppo.rollout.launcher import launch_embedded_engine, python_env
from megatron_dppo.rollout.weight_sync import WeightSyncer, group_into_buckets, pack_bucket, unpack_bucket
from tests.test_rollout_engine import save_tiny_model, sequence_logprobs

PROBES = [[1, 2, 3, 4, 5, 6], [7, 8, 9], [40, 41, 42, 43, 44, 45, 46, 47]]


def perturbed_model(model_dir: str, seed: int):
    """The 'trainer' model: the on-disk weights plus seeded noise, so a sync is visible in every tensor."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
    return model


def run_sender(model_dir: str, url: str, out_path: str, version: str, seed: int) -> None:
    """A plain-python trainer process: sync perturbed weights, save the probe log-probs it expects."""
    model = perturbed_model(model_dir, seed)
    syncer = WeightSyncer([url], bucket_bytes=64 * 1024, timeout_s=60)
    stats = syncer.sync(model.state_dict().items(), version)
    syncer.destroy_group()
    probe_logprobs = [sequence_logprobs(model, probe[:1], probe[1:]) for probe in PROBES]
    torch.save({"probe_logprobs": probe_logprobs, "buckets": stats.buckets, "bytes": stats.bytes}, out_path)


def engine_probe_logprobs(url: str) -> list[torch.Tensor]:
    body = control_request(url, "/generate", {"input_ids": PROBES, "sampling_params": {"max_new_tokens": 0},
                                              "return_logprob": True, "logprob_start_len": 0})
    return [torch.tensor([entry[0] for entry in output["meta_info"]["input_token_logprobs"][1:]]) for output in body]


def test_pack_unpack_round_trips_mixed_dtypes_and_buckets_respect_size_and_alignment():
    tensors = [("a", torch.randn(5)), ("b", torch.randn(3, 3).to(torch.bfloat16)), ("c", torch.randn(7)),
               ("d", torch.arange(6, dtype=torch.int64).reshape(2, 3)), ("e", torch.randn(100))]
    buckets = list(group_into_buckets(tensors, bucket_bytes=64))
    assert [name for bucket in buckets for name, _ in bucket] == list("abcde")  # order kept, each once
    for bucket in buckets:
        assert sum(t.numel() * t.element_size() for _, t in bucket) <= 64 or len(bucket) == 1
        packed = pack_bucket(bucket)
        for (name, original), (got_name, got) in zip(bucket, unpack_bucket(packed.flat, packed.names,
                                                                            packed.dtypes, packed.shapes)):
            assert name == got_name and got.dtype == original.dtype and torch.equal(got, original)
    # bf16 (9 elements = 18 bytes) followed by fp32 would be unaligned: "c" must open a new bucket
    assert any(bucket[0][0] == "c" for bucket in buckets)


def test_sender_process_syncs_perturbed_weights_into_engine_logprobs_match_and_version_advances(tmp_path):
    model_dir = save_tiny_model(tmp_path / "model")
    with launch_embedded_engine(model_dir, startup_timeout_s=120) as engine:
        before = engine_probe_logprobs(engine.url)
        out_path = tmp_path / "sender.pt"
        sender = subprocess.run(
            [sys.executable, "-c", "import sys; from tests.test_weight_sync import run_sender; "
             "run_sender(*sys.argv[1:4], sys.argv[4], int(sys.argv[5]))",
             model_dir, engine.url, str(out_path), "7", "123"],
            capture_output=True, text=True, timeout=180, env=python_env())
        assert sender.returncode == 0, sender.stdout[-3000:] + sender.stderr[-3000:]
        expected = torch.load(out_path)
        assert expected["buckets"] > 1  # 64 KiB buckets: the tiny model needs several

        after = engine_probe_logprobs(engine.url)
        for got, want, old in zip(after, expected["probe_logprobs"], before):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
            assert (got - old).abs().max() > 1e-3  # the sync changed the model
        assert control_request(engine.url, "/model_info", None, "GET")["weight_version"] == "7"

        completions = RolloutClient([engine.url]).generate([[1, 2, 3]], SamplingParams(max_new_tokens=8), n=2)
        assert all(len(c.output_ids) == 8 and c.weight_version == "7" for c in completions)
        trainer = perturbed_model(model_dir, 123)
        for completion in completions:
            torch.testing.assert_close(torch.tensor(completion.output_logprobs),
                                       sequence_logprobs(trainer, [1, 2, 3], completion.output_ids),
                                       atol=1e-5, rtol=0)
