"""Weights broadcast by the trainer-side syncer land in the engine by HF name, bit for bit, in buckets.

The fast-path tests run the engine (EmbeddedEngine + its aiohttp app, exactly what `python -m
megatron_dppo.servers.embedded` serves) inside the test process, so they can read its parameters, and drive a
separate sender process step by step over stdin (one process per test: importing transformers costs seconds).
"""

import asyncio
import json
import queue
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import pytest
import torch

from megatron_dppo.platform.network import free_port
from megatron_dppo.rollout.client import RolloutClient, RolloutServerError, SamplingParams, control_request
from megatron_dppo.rollout.launcher import launch_embedded_engine, python_env
from megatron_dppo.rollout.weight_sync import (
    AUTO_FORMAT,
    DEFAULT_FIRST_BUCKET_BYTES,
    PACK_BELOW_BYTES,
    StagingBuffers,
    WeightSyncer,
    prefetch_buckets,
)
from megatron_dppo.servers.embedded.engine import EmbeddedEngine
from megatron_dppo.servers.embedded.routes import build_app
from megatron_dppo.servers.embedded.weights import UPDATE_OUTSIDE_SESSION
from megatron_dppo.weight_update_protocol import (
    FLATTENED_BUCKET,
    RAMP,
    group_into_buckets,
    init_weight_update_group,
    pack_bucket,
    tensor_bucket,
    tensor_nbytes,
    unpack_bucket,
)
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


def test_bucket_limits_ramp_by_1_5_from_first_bucket_bytes_whole_tensors_and_an_oversized_tensor_travels_alone():
    assert DEFAULT_FIRST_BUCKET_BYTES == 32 * 1024**2 and RAMP == 1.5
    kib = 1024
    tensors = [(f"t{i}", torch.randn(kib // 4)) for i in range(60)]  # 1 KiB each
    tensors.insert(19, ("big", torch.randn(8 * kib)))  # 32 KiB, over the 20 KiB limit
    groups = list(group_into_buckets(tensors, bucket_bytes=20 * kib, first_bucket_bytes=4 * kib))
    # limits 4, 6, 9, 13.5, 20, 20 ... KiB; "big" arrives when the 13.5 KiB bucket is empty, so it is that bucket
    assert [sum(t.numel() * t.element_size() for _, t in group) // kib for group in groups] == [4, 6, 9, 32, 20, 20, 1]
    assert [name for group in groups for name, _ in group] == [name for name, _ in tensors]  # whole, in order, once
    assert [name for name, _ in groups[3]] == ["big"]

    # The prefetcher yields the same buckets, packed; it starts packing before anyone iterates. Run twice with one
    # StagingBuffers: the second sync packs every multi-tensor bucket into one of the two buffers the first left.
    staging = StagingBuffers()
    pooled: list[torch.Tensor] = []
    for sync in range(2):
        prefetcher = prefetch_buckets(tensors, bucket_bytes=20 * kib, timeout_s=30, staging=staging,
                                      first_bucket_bytes=4 * kib)
        deadline = time.monotonic() + 30
        while prefetcher.ready.empty() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not prefetcher.ready.empty(), "the first bucket must be packed before iteration starts"
        with prefetcher:
            buckets = 0
            for bucket, group in zip(prefetcher, groups, strict=True):
                assert bucket.names == [name for name, _ in group]
                for (_, want), (_, got) in zip(group, unpack_bucket(bucket.flat, bucket.names, bucket.dtypes,
                                                                    bucket.shapes)):
                    assert torch.equal(got, want)
                if len(group) == 1:  # one contiguous tensor: sent as its own bytes, no staging buffer
                    assert bucket.staging is None and bucket.flat.data_ptr() == group[0][1].data_ptr()
                else:  # one torch.cat into a staging buffer
                    assert bucket.flat.data_ptr() == bucket.staging.data_ptr()
                    assert sync == 0 or any(bucket.staging is buffer for buffer in pooled)
                buckets += 1
        assert buckets == len(groups)
        pooled = [staging.free.get_nowait() for _ in range(staging.free.qsize())]
        assert len(pooled) == 2 and all(buffer.numel() >= 20 * kib for buffer in pooled)
        for buffer in pooled:
            staging.give(buffer)

    # The per-tensor format: nothing packed, each tensor sent from its own memory; with no pack to wait for, the
    # ramped groups are merged up to bucket_bytes (4 + 6 + 9 KiB; "big" alone; 20; 20; 1), each bucket a request
    with prefetch_buckets(tensors, bucket_bytes=20 * kib, timeout_s=30, first_bucket_bytes=4 * kib,
                          pack=False) as prefetcher:
        buckets = list(prefetcher)
    assert [bucket.nbytes // kib for bucket in buckets] == [19, 32, 20, 20, 1]
    assert [name for bucket in buckets for name in bucket.names] == [name for name, _ in tensors]
    sources = dict(tensors)
    for bucket in buckets:
        assert bucket.flat is None and bucket.staging is None
        assert [t.data_ptr() for t in bucket.broadcasts] == [sources[name].data_ptr() for name in bucket.names]


def test_auto_format_packs_buckets_of_small_tensors_and_sends_large_ones_per_tensor():
    kib = 1024
    syncer = WeightSyncer(["http://127.0.0.1:1"], load_format=AUTO_FORMAT, bucket_bytes=8 * PACK_BELOW_BYTES,
                          first_bucket_bytes=24 * kib)
    tensors = [*((f"norm{i}", torch.ones(kib)) for i in range(6)), ("proj", torch.ones(PACK_BELOW_BYTES // 2)),
               ("norm", torch.ones(kib))]  # 6 x 4 KiB (the 24 KiB first bucket), a 2 MiB tensor alone, 4 KiB
    with prefetch_buckets(tensors, syncer.bucket_bytes, 30, first_bucket_bytes=syncer.first_bucket_bytes,
                          pack=syncer._packs) as prefetcher:
        buckets = list(prefetcher)
    assert [bucket.names for bucket in buckets] == [[f"norm{i}" for i in range(6)], ["proj"], ["norm"]]
    assert [syncer.update_payload(bucket, "1")["load_format"] for bucket in buckets] == [
        FLATTENED_BUCKET, None, FLATTENED_BUCKET]
    assert buckets[1].broadcasts[0].data_ptr() == tensors[6][1].data_ptr()  # sent from its own memory
    # the default stays SGLang's flattened buckets; None is per tensor throughout
    assert WeightSyncer(["http://127.0.0.1:1"])._packs(tensors[6:7])
    assert not WeightSyncer(["http://127.0.0.1:1"], load_format=None)._packs(tensors[:6])


def run_scripted_sender(model_dir: str, url: str) -> None:
    """A trainer process that runs one JSON step per stdin line and answers each with a `RESULT {...}` line.

    {"op": "sync", "seed", "version", "bucket_bytes", "per_tensor"}: sync perturbed_model(seed), in the per-tensor
        format (load_format null) when "per_tensor" is true, else in flattened buckets;
    {"op": "send", "names", "shapes", "per_tensor", "session"}: send one fp32 bucket of zeros described by
        names/shapes, inside a begin/end session when "session" is true (as sync does), else bare;
    {"op": "stop"}: leave the group and exit."""
    syncer = WeightSyncer([url], timeout_s=60)
    for line in sys.stdin:
        step = json.loads(line)
        if step["op"] == "stop":
            break
        syncer.load_format = None if step.get("per_tensor", False) else FLATTENED_BUCKET
        try:
            if step["op"] == "sync":
                syncer.bucket_bytes = step["bucket_bytes"]
                stats = syncer.sync(perturbed_model(model_dir, step["seed"]).state_dict().items(), step["version"])
                result = {"ok": True, "buckets": stats.buckets}
            else:
                if syncer.group is None:
                    syncer.init_group()
                zeros = [(name, torch.zeros(shape)) for name, shape in zip(step["names"], step["shapes"])]
                bucket = tensor_bucket(zeros) if syncer.load_format is None else pack_bucket(zeros)
                if step.get("session", True):
                    syncer._begin_update()
                try:
                    syncer._send_bucket(bucket, "refused")
                finally:
                    if step.get("session", True):
                        syncer._end_update(raise_errors=False)
                result = {"ok": True}
        except RolloutServerError as error:
            result = {"ok": False, "error": str(error)}
        print("RESULT " + json.dumps(result), flush=True)
    syncer.destroy_group()


@contextmanager
def scripted_sender(model_dir: str, url: str, log_path):
    """Start run_scripted_sender; yields `step(**fields) -> result dict`."""
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [sys.executable, "-c", "import sys; from tests.test_weight_sync import run_scripted_sender; "
             "run_scripted_sender(sys.argv[1], sys.argv[2])", model_dir, url],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, env=python_env())
        lines: queue.Queue = queue.Queue()

        def read_stdout() -> None:
            for line in process.stdout:
                lines.put(line)
            lines.put(None)  # the sender exited

        threading.Thread(target=read_stdout, name="sender-stdout", daemon=True).start()

        def step(**fields) -> dict:
            process.stdin.write(json.dumps(fields) + "\n")
            process.stdin.flush()
            while True:
                try:
                    line = lines.get(timeout=120)
                except queue.Empty:
                    line = None
                if line is None:
                    raise AssertionError(f"sender gave no answer to {fields}:\n{log_path.read_text()[-3000:]}")
                if line.startswith("RESULT "):
                    return json.loads(line.removeprefix("RESULT "))

        try:
            yield step
            process.stdin.write(json.dumps({"op": "stop"}) + "\n")
            process.stdin.close()
            assert process.wait(timeout=60) == 0, log_path.read_text()[-3000:]
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()


@contextmanager
def served_engine(model_dir: str, dtype: str = "float32"):
    """The embedded engine's app served from a thread of this process; yields (engine, url)."""
    from aiohttp import web

    engine = EmbeddedEngine(model_dir, dtype=dtype)
    port = free_port()
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(build_app(engine))
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
    thread = threading.Thread(target=loop.run_forever, name="engine-app", daemon=True)
    thread.start()
    try:
        yield engine, f"http://127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=30)
        loop.close()


TIED = ("model.embed_tokens.weight", "lm_head.weight")


def assert_engine_holds(engine: EmbeddedEngine, model_dir: str, seed: int) -> None:
    """Every tensor of the engine equals the trainer's perturbed_model(seed) converted to the engine's dtype."""
    got = engine.model.state_dict()
    want = perturbed_model(model_dir, seed).state_dict()
    assert set(got) == set(want) and set(TIED) <= set(got)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor.to(got[name].dtype)), f"{name} differs after syncing seed {seed}"
    assert torch.equal(got[TIED[0]], got[TIED[1]])  # tied embeddings: both names hold the synced tensor


def assert_generation_matches_trainer(url: str, model_dir: str, seed: int, version: str) -> None:
    completions = RolloutClient([url]).generate([[1, 2, 3]], SamplingParams(max_new_tokens=6), n=2)
    trainer = perturbed_model(model_dir, seed)
    for completion in completions:
        assert len(completion.output_ids) == 6 and completion.weight_version == version
        torch.testing.assert_close(torch.tensor(completion.output_logprobs),
                                   sequence_logprobs(trainer, [1, 2, 3], completion.output_ids), atol=1e-5, rtol=0)


def living_in_bucket_buffers(engine: EmbeddedEngine) -> set[str]:
    """Names of the parameters that are views into a remembered bucket buffer at their own offset."""
    parameters = dict(engine.model.named_parameters(remove_duplicate=False))
    living = set()
    for layout, buffer in engine.weights.bucket_buffers.items():
        offset = 0
        for name, dtype, shape in layout:
            if name in parameters and parameters[name].data_ptr() == buffer.data_ptr() + offset:
                living.add(name)
            offset += tensor_nbytes(dtype, shape)
    return living


def assert_fused_parts_are_views(engine: EmbeddedEngine) -> None:
    """Every fused matrix of the decoder (q/k/v, gate/up) is current without a rebuild: its parts are the model's
    parameters, views at their rows, and the weights were loaded into them."""
    matrices = [matrix for layer in engine.decoder.layers for projection in layer.projections()
                for matrix in projection.matrices() if len(matrix.modules) > 1]
    assert matrices and all(matrix.current() for matrix in matrices)


def test_zero_copy_resync_layout_change_per_tensor_format_and_refused_updates_tear_the_group_down(tmp_path):
    model_dir = save_tiny_model(tmp_path / "model")
    with served_engine(model_dir) as (engine, url), scripted_sender(model_dir, url, tmp_path / "sender.log") as step:
        # first sync: buckets become the parameters' storage; tied names equal; generation follows the new weights
        first = step(op="sync", seed=1, version="1", bucket_bytes=64 * 1024)
        assert first["ok"] and first["buckets"] > 1, first
        assert_engine_holds(engine, model_dir, 1)
        assert_generation_matches_trainer(url, model_dir, 1, "1")
        parameters = dict(engine.model.named_parameters(remove_duplicate=False))
        fused = engine.decoder.fused_parameter_names  # q/k/v and gate/up: views into the decoder's fused matrices
        assert fused and all(name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "q_proj.bias",
                                            "k_proj.bias", "v_proj.bias", "gate_proj.weight", "up_proj.weight"))
                             for name in fused)
        living = living_in_bucket_buffers(engine)
        # every other parameter lives in the buffer its bucket was received into (a tied one in its last name's)
        others = set(parameters) - fused - set(TIED)
        assert others and others <= living and not fused & living
        assert_fused_parts_are_views(engine)
        storage = {name: parameters[name].data_ptr() for name in set(parameters) - set(TIED)}

        # same layout again: received straight into the parameters (their storage does not move), exact
        assert step(op="sync", seed=2, version="2", bucket_bytes=64 * 1024)["ok"]
        assert_engine_holds(engine, model_dir, 2)
        assert {name: p.data_ptr() for name, p in engine.model.named_parameters(remove_duplicate=False)
                if name in storage} == storage
        assert_fused_parts_are_views(engine)

        # Refused updates: a bucket outside a begin/end session (SGLang's rule, refused before any byte is received),
        # and buckets naming unknown tensors or wrong shapes (flattened and per-tensor). Each answers HTTP 400 with
        # the reason, loads nothing, and the syncer tears the group down instead of leaving its broadcast pending;
        # the session is closed all the same, and the next update builds a new group.
        refusals = [(dict(names=["model.norm.weight"], shapes=[[64]], session=False), UPDATE_OUTSIDE_SESSION),
                    (dict(names=["model.norm.weight", "model.no_such.weight"], shapes=[[64], [8]]),
                     "unknown names ['model.no_such.weight']"),
                    (dict(names=["model.norm.weight"], shapes=[[65]]), "shape mismatches ['model.norm.weight"),
                    (dict(names=["model.no_such.weight"], shapes=[[8]], per_tensor=True),
                     "unknown names ['model.no_such.weight']"),
                    (dict(names=["model.norm.weight"], shapes=[[2, 32]], per_tensor=True),
                     "shape mismatches ['model.norm.weight")]
        for refusal, reason in refusals:
            result = step(op="send", **refusal)
            assert not result["ok"] and "HTTP 400" in result["error"] and reason in result["error"], result
            assert "was torn down" in result["error"], result
            assert not engine.weights.groups and engine.weights.session_selector is None
        assert_engine_holds(engine, model_dir, 2)
        assert control_request(url, "/model_info", None, "GET")["weight_version"] == "2"

        # new layout (smaller buckets), then the per-tensor format, then the new layout again (zero-copy again)
        assert step(op="sync", seed=3, version="3", bucket_bytes=24 * 1024)["buckets"] > first["buckets"]
        assert_engine_holds(engine, model_dir, 3)
        assert step(op="sync", seed=4, version="4", bucket_bytes=24 * 1024, per_tensor=True)["ok"]
        assert_engine_holds(engine, model_dir, 4)
        assert step(op="sync", seed=5, version="5", bucket_bytes=24 * 1024)["ok"]
        assert_engine_holds(engine, model_dir, 5)
        assert_fused_parts_are_views(engine)
        assert_generation_matches_trainer(url, model_dir, 5, "5")


def test_bfloat16_engine_receives_fp32_and_holds_exactly_the_bfloat16_conversion_in_both_formats(tmp_path):
    model_dir = save_tiny_model(tmp_path / "model")
    with served_engine(model_dir, dtype="bfloat16") as (engine, url), \
            scripted_sender(model_dir, url, tmp_path / "sender.log") as step:
        for seed, per_tensor in ((1, False), (2, True), (3, False)):
            assert step(op="sync", seed=seed, version=str(seed), bucket_bytes=64 * 1024, per_tensor=per_tensor)["ok"]
            assert all(p.dtype == torch.bfloat16 for p in engine.model.parameters())
            assert_engine_holds(engine, model_dir, seed)  # == fp32 tensor.to(bfloat16), tied names equal
        completions = RolloutClient([url]).generate([[1, 2, 3]], SamplingParams(max_new_tokens=6), n=2)
        assert all(len(c.output_ids) == 6 and c.weight_version == "3" for c in completions)


def test_malformed_update_metadata_leaves_the_group_with_a_clear_error_instead_of_hanging(tmp_path):
    """Names, dtypes and shapes that disagree (or an unknown dtype) leave the broadcast's size unknowable: the engine
    must answer a clear error and leave the group (so the trainer re-initialises it), never wait or load garbage."""
    from megatron_dppo.servers.embedded.request_parser import RequestError

    engine = EmbeddedEngine(save_tiny_model(tmp_path / "model"))
    engine.weights.begin_weight_update({})  # inside a session, as the syncer sends every update
    before = {name: tensor.clone() for name, tensor in engine.model.state_dict().items()}
    bad_bodies = [
        {"names": ["model.norm.weight"], "dtypes": ["float32", "float32"], "shapes": [[64]]},
        {"names": ["model.norm.weight"], "dtypes": ["float99"], "shapes": [[64]]},
        {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[64]], "load_format": "bogus"},
    ]
    for body in bad_bodies:
        engine.weights.groups["g"] = init_weight_update_group("gloo", "127.0.0.1", free_port(), 0, 1, "g")
        with pytest.raises(RequestError, match="malformed weight update.*destroyed.*init_weights_update_group"):
            engine.weights.update_from_distributed({**body, "group_name": "g", "load_format": body.get("load_format")})
        assert "g" not in engine.weights.groups
    for name, tensor in engine.model.state_dict().items():
        assert torch.equal(tensor, before[name])


def test_syncer_refuses_an_in_place_pause_whose_running_batch_sglang_would_never_flush():
    from megatron_dppo.rollout.weight_sync import WeightSyncer

    with pytest.raises(ValueError, match="pause_mode='in_place' must be abort or retract"):
        WeightSyncer(["http://127.0.0.1:1"], pause_mode="in_place")
