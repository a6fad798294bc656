"""Every request the rollout client and weight syncer send is valid for SGLang's own request classes and routes.

SGLang's server cannot be imported without CUDA, so its sources are read with `ast` from the installed wheel
(sglang==0.5.23, `pip install --no-deps sglang==0.5.23`): request dataclasses in srt/managers/io_struct.py,
the JSON schema classes in api/v1/api_types.py, route decorators in srt/entrypoints/http_server.py, and the rules
its scheduler enforces: the weight-update session (srt/managers/scheduler_components/weight_updater.py) and
`sampling_seed` acting only under --enable-deterministic-inference (srt/sampling/sampling_batch_info.py). The
embedded engine is held to the same rules, so a protocol change in SGLang fails here.
"""

import ast
import importlib.util
import re
from pathlib import Path

import pytest
import torch

from megatron_dppo.rollout.client import SamplingParams, seeded_batch_payload
from megatron_dppo.rollout.weight_sync import WeightSyncer
from megatron_dppo.weight_update_protocol import pack_bucket

INSTALL_HINT = "install it with: pip install --no-deps sglang==0.5.23 (part of the test extra)"


def sglang_dir() -> Path:
    spec = importlib.util.find_spec("sglang")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        pytest.fail(f"the sglang wheel is not installed, so the contract cannot be checked; {INSTALL_HINT}")
    return Path(spec.submodule_search_locations[0])


def class_fields(path: Path, class_name: str) -> dict[str, bool]:
    """Annotated fields of a class (including BaseReq's), mapped to whether they are required."""
    tree = ast.parse(path.read_text())
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
    if class_name not in classes:
        pytest.fail(f"{class_name} not found in {path}; the installed sglang is not 0.5.23? {INSTALL_HINT}")
    fields = {}
    node = classes[class_name]
    for base in node.bases:
        if isinstance(base, ast.Name) and base.id in classes:
            fields.update(class_fields(path, base.id))
    for statement in node.body:
        if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
            fields[statement.target.id] = statement.value is None
    return fields


def routes(path: Path) -> set[tuple[str, str]]:
    """(path, METHOD) pairs from @app.get/@app.post/@app.api_route decorators."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.AsyncFunctionDef | ast.FunctionDef):
            continue
        for decorator in node.decorator_list:
            if not (isinstance(decorator, ast.Call) and isinstance(decorator.func, ast.Attribute)):
                continue
            kind = decorator.func.attr
            if not decorator.args or not isinstance(decorator.args[0], ast.Constant):
                continue
            route = decorator.args[0].value
            if kind in ("get", "post", "put"):
                found.add((route, kind.upper()))
            elif kind == "api_route":
                for keyword in decorator.keywords:
                    if keyword.arg == "methods":
                        found |= {(route, method.value) for method in keyword.value.elts}
    return found


def assert_valid(payload: dict, fields: dict[str, bool], what: str) -> None:
    unknown = sorted(set(payload) - set(fields))
    missing = sorted(name for name, required in fields.items() if required and name not in payload)
    assert not unknown, f"{what}: fields {unknown} are not in SGLang's request class"
    assert not missing, f"{what}: required fields {missing} missing"


# Every (route, method) the client, weight syncer and launcher call.
ROUTES_USED = [
    ("/generate", "POST"), ("/health_generate", "GET"), ("/health", "GET"), ("/model_info", "GET"),
    ("/flush_cache", "GET"), ("/pause_generation", "POST"), ("/continue_generation", "POST"),
    ("/init_weights_update_group", "POST"), ("/begin_weight_update", "POST"),
    ("/update_weights_from_distributed", "POST"), ("/end_weight_update", "POST"),
    ("/destroy_weights_update_group", "POST"), ("/update_weights_from_disk", "POST"),
]


def test_routes_used_by_client_syncer_and_engine_exist_in_sglang_http_server():
    server_routes = routes(sglang_dir() / "srt/entrypoints/http_server.py")
    assert ("/generate", "POST") in server_routes  # the parser reads the decorators at all
    missing = [route for route in ROUTES_USED if route not in server_routes]
    assert not missing, f"routes not served by SGLang 0.5.23: {missing}"

    from megatron_dppo.servers.embedded.routes import build_app

    class NoEngine:  # build_app only stores the engine; routes are registered without touching it
        pass

    engine_routes = {(r.resource.canonical, r.method) for r in build_app(NoEngine()).router.routes()
                     if r.method != "HEAD"}
    extra = sorted(route for route in engine_routes if route[1] != "*" and route not in server_routes)
    assert not extra, f"the embedded engine serves routes SGLang does not: {extra}"
    assert set(ROUTES_USED) - {("/flush_cache", "GET")} <= engine_routes


def test_generate_payload_fits_generate_req_input_and_the_v1_json_schema():
    root = sglang_dir()
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=16, stop_token_ids=[2, 3], seed=5)
    payload = seeded_batch_payload([[5, 6, 7]], first_prompt_index=0, params=params, n=4)
    assert_valid(payload, class_fields(root / "srt/managers/io_struct.py", "GenerateReqInput"), "/generate")
    assert_valid(payload, class_fields(root / "api/v1/api_types.py", "GenerateRequest"), "/generate schema")
    for sampling in payload["sampling_params"]:
        # api_types.SamplingParams rejects unknown keys, so every key must be one of its fields.
        assert_valid(sampling, class_fields(root / "api/v1/api_types.py", "SamplingParams"), "sampling_params")
        assert_valid(sampling, class_fields(root / "srt/sampling/sampling_params.py", "SamplingParams"),
                     "sampling_params (srt)")
        assert sampling["n"] == 1 and sampling["stop_token_ids"] == [2, 3]
    assert payload["input_ids"] == [[5, 6, 7]] * 4 and payload["return_logprob"] is True


def test_weight_sync_payloads_fit_sglang_request_classes():
    io_struct = sglang_dir() / "srt/managers/io_struct.py"
    syncer = WeightSyncer(["http://127.0.0.1:1"], backend="gloo", pause_mode="retract")
    bucket = pack_bucket([("model.norm.weight", torch.ones(4)), ("lm_head.weight", torch.ones(2, 4))])
    checks = [
        (syncer.init_group_payload(29500, 1, 2), "InitWeightsUpdateGroupReqInput"),
        (syncer.begin_payload(), "BeginWeightUpdateReqInput"),
        ({}, "EndWeightUpdateReqInput"),
        (syncer.update_payload(bucket, "3"), "UpdateWeightsFromDistributedReqInput"),
        (syncer.destroy_group_payload(), "DestroyWeightsUpdateGroupReqInput"),
        (syncer.pause_payload(), "PauseGenerationReqInput"),
        ({}, "ContinueGenerationReqInput"),
        ({"model_path": "/ckpt", "weight_version": "3"}, "UpdateWeightFromDiskReqInput"),
    ]
    for payload, class_name in checks:
        assert_valid(payload, class_fields(io_struct, class_name), class_name)
    assert class_fields(io_struct, "UpdateWeightsFromDistributedReqInput")["names"]  # required: parser works


def test_flattened_bucket_layout_matches_sglang_tensor_bucket_reader():
    """SGLang's receiver allocates sum(numel * itemsize) uint8 bytes and slices tensors back to back."""
    source = (sglang_dir() / "srt/weight_sync/tensor_bucket.py").read_text()
    assert "torch.empty(offset, dtype=torch.uint8" in source and "offset % dtype.itemsize" in source
    tensors = [("a", torch.arange(3, dtype=torch.float32)), ("b", torch.ones(2, 2, dtype=torch.bfloat16))]
    bucket = pack_bucket(tensors)
    assert bucket.dtypes == ["float32", "bfloat16"] and all(isinstance(getattr(torch, d), torch.dtype)
                                                             for d in bucket.dtypes)
    assert bucket.nbytes == 3 * 4 + 4 * 2


def test_vllm_api_seeds_each_request_as_sglang_seeds_its_samples_and_no_server_is_a_clear_error():
    """The request layout without a server (tests/test_vllm_backend.py runs it against a real vLLM): vLLM seeds
    sample i of a request with seed + i, so prompt p's request carries the seed of its sample 0."""
    from megatron_dppo.platform.network import free_port
    from megatron_dppo.rollout.client import RolloutClient, RolloutServerError
    from megatron_dppo.rollout.vllm import VLLMCompletionsAPI

    params = SamplingParams(max_new_tokens=4, seed=3, stop_token_ids=[2])
    payload = VLLMCompletionsAPI().request([1, 2], params, n=2, prompt_index=5)
    assert payload["prompt"] == [1, 2] and payload["n"] == 2 and payload["stop_token_ids"] == [2]
    assert [payload["seed"] + i for i in range(2)] == [params.sample_seed(5, i, 2) for i in range(2)]
    assert "seed" not in VLLMCompletionsAPI().request([1], SamplingParams(), n=1, prompt_index=0)
    url = f"http://127.0.0.1:{free_port()}"
    client = RolloutClient([url], api=VLLMCompletionsAPI(), max_retries=1, retry_backoff_s=0.01)
    with pytest.raises(RolloutServerError, match=f"prompt 0 failed after 2 attempts.*{url}: ClientConnectorError"):
        client.generate([[1, 2]], SamplingParams(max_new_tokens=4))


def test_seeded_batch_payload_fits_generate_req_input_with_one_sampling_seed_per_sample():
    root = sglang_dir()
    params = SamplingParams(temperature=1.0, max_new_tokens=8, stop_token_ids=[2], seed=7)
    payload = seeded_batch_payload([[5, 6], [7]], first_prompt_index=3, params=params, n=2)
    assert_valid(payload, class_fields(root / "srt/managers/io_struct.py", "GenerateReqInput"), "/generate batch")
    assert payload["input_ids"] == [[5, 6], [5, 6], [7], [7]]
    seeds = [sampling["sampling_seed"] for sampling in payload["sampling_params"]]
    assert len(set(seeds)) == 4 and seeds == [params.sample_seed(p, s, 2) for p in (3, 4) for s in (0, 1)]
    for sampling in payload["sampling_params"]:
        assert sampling["n"] == 1
        assert_valid(sampling, class_fields(root / "api/v1/api_types.py", "SamplingParams"), "seeded sampling_params")
        assert_valid(sampling, class_fields(root / "srt/sampling/sampling_params.py", "SamplingParams"),
                     "seeded sampling_params (srt)")


def test_continued_samples_payload_fits_generate_req_input_with_their_own_seed_and_token_budget():
    """Partial rollouts continue a sample from its prompt + response so far, with the seed it was drawn with and the
    tokens it may still add: SGLang's batched GenerateReqInput takes that per entry; vLLM gets one request each."""
    from megatron_dppo.rollout.client import SequenceRequest, batch_payload
    from megatron_dppo.rollout.vllm import VLLMCompletionsAPI, continuation_seed

    root = sglang_dir()
    params = SamplingParams(temperature=1.0, max_new_tokens=64, stop_token_ids=[2], seed=7)
    requests = [SequenceRequest([5, 6, 9, 9], 11, 8), SequenceRequest([7], 12, 3)]
    payload = batch_payload(requests, params)
    assert_valid(payload, class_fields(root / "srt/managers/io_struct.py", "GenerateReqInput"), "/generate batch")
    assert payload["input_ids"] == [[5, 6, 9, 9], [7]]
    assert [(s["sampling_seed"], s["max_new_tokens"]) for s in payload["sampling_params"]] == [(11, 8), (12, 3)]
    for sampling in payload["sampling_params"]:
        assert_valid(sampling, class_fields(root / "api/v1/api_types.py", "SamplingParams"), "continued sampling")
        assert_valid(sampling, class_fields(root / "srt/sampling/sampling_params.py", "SamplingParams"),
                     "continued sampling (srt)")
    vllm = VLLMCompletionsAPI().request([5, 6, 9, 9], SamplingParams(max_new_tokens=8, seed=7), 1, 0, seed=11)
    assert vllm["prompt"] == [5, 6, 9, 9] and vllm["max_tokens"] == 8 and vllm["n"] == 1
    assert vllm["seed"] == continuation_seed(11, [5, 6, 9, 9]) != 11  # a chunk's own seed (docs/rollout.md)


def method(path: Path, class_name: str, method_name: str) -> ast.FunctionDef:
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == method_name:
                    return item
    pytest.fail(f"{class_name}.{method_name} not found in {path}; the installed sglang is not 0.5.23? {INSTALL_HINT}")


def session_refusal(function: ast.FunctionDef, operator: type) -> str:
    """The message of the method's first statement, `if self._session is [not] None: return Output(success=False,
    message=...)`: the refusal that comes before the method does anything else."""
    first = function.body[1] if isinstance(function.body[0], ast.Expr) else function.body[0]  # after the docstring
    test = first.test if isinstance(first, ast.If) else None
    assert (isinstance(test, ast.Compare) and ast.unparse(test.left) == "self._session"
            and isinstance(test.ops[0], operator) and ast.unparse(test.comparators[0]) == "None"), \
        f"{function.name} no longer starts by checking the weight-update session: {ast.unparse(first)[:200]}"
    returned = first.body[0].value
    keywords = {keyword.arg: keyword.value for keyword in returned.keywords}
    assert ast.literal_eval(keywords["success"]) is False
    return ast.literal_eval(keywords["message"])


def test_sglang_refuses_updates_outside_begin_end_before_receiving_and_the_embedded_engine_refuses_alike(tmp_path):
    """SGLang 0.5.23 answers a distributed update outside a /begin_weight_update .. /end_weight_update session with
    HTTP 400 before receiving a byte, and refuses a second begin and an end without begin. The embedded engine
    refuses the same calls with the same messages, also before receiving (no group exists here: it would fail
    differently if it tried), and loads after a begin."""
    from megatron_dppo.servers.embedded.engine import EmbeddedEngine
    from megatron_dppo.servers.embedded.request_parser import RequestError
    from megatron_dppo.servers.embedded.weights import NO_SESSION_OPEN, SESSION_ALREADY_OPEN, UPDATE_OUTSIDE_SESSION
    from tests.test_rollout_engine import save_tiny_model

    updater = sglang_dir() / "srt/managers/scheduler_components/weight_updater.py"
    manager = "SchedulerWeightUpdaterManager"
    update = method(updater, manager, "update_weights_from_distributed")
    assert session_refusal(update, ast.Is) == UPDATE_OUTSIDE_SESSION
    assert session_refusal(method(updater, manager, "begin_weight_update"), ast.IsNot) == SESSION_ALREADY_OPEN
    assert session_refusal(method(updater, manager, "end_weight_update"), ast.Is) == NO_SESSION_OPEN
    source = ast.unparse(update)
    assert source.index("self._session is None") < source.index("receive_weights_from_distributed")
    server = ast.parse((sglang_dir() / "srt/entrypoints/http_server.py").read_text())
    for route in ("begin_weight_update", "end_weight_update", "update_weights_from_distributed"):
        handler = next(node for node in ast.walk(server) if isinstance(node, ast.AsyncFunctionDef)
                       and node.name == route)
        assert "HTTPStatus.BAD_REQUEST" in ast.unparse(handler), f"SGLang's /{route} no longer answers 400"

    engine = EmbeddedEngine(save_tiny_model(tmp_path / "model"))
    body = {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[64]], "group_name": "g",
            "load_format": "flattened_bucket"}
    with pytest.raises(RequestError, match=f"^{re.escape(UPDATE_OUTSIDE_SESSION)}$"):
        engine.weights.update_from_distributed(body)
    with pytest.raises(RequestError, match=f"^{re.escape(NO_SESSION_OPEN)}$"):
        engine.weights.end_weight_update({})
    engine.weights.begin_weight_update({"selector": "all"})
    with pytest.raises(RequestError, match=f"^{re.escape(SESSION_ALREADY_OPEN)}$"):
        engine.weights.begin_weight_update({})
    with pytest.raises(RequestError, match="weight update group 'g' does not exist"):
        engine.weights.update_from_distributed(body)  # inside the session the update goes on to the group
    engine.weights.end_weight_update({})
    with pytest.raises(RequestError, match=f"^{re.escape(UPDATE_OUTSIDE_SESSION)}$"):
        engine.weights.update_from_distributed(body)


def test_sglang_uses_sampling_seed_only_under_deterministic_inference_and_so_does_the_embedded_engine(tmp_path):
    """SGLang builds its per-row seeds only when --enable-deterministic-inference is on, and then seeds every row
    (42 when the request gives none); otherwise sampling_seed is ignored. The embedded engine follows the same rule
    with its flag of the same name."""
    from megatron_dppo.servers.embedded.engine import EmbeddedEngine
    from megatron_dppo.servers.embedded.request_parser import DEFAULT_SAMPLING_SEED, SequenceParams
    from tests.test_rollout_engine import save_tiny_model

    source = (sglang_dir() / "srt/sampling/sampling_batch_info.py").read_text()
    tree = ast.parse(source)
    seed_assignment = next(node for node in ast.walk(tree) if isinstance(node, ast.Assign)
                           and ast.unparse(node.targets[0]) == "sampling_seed")
    rule = seed_assignment.value
    assert isinstance(rule, ast.IfExp) and ast.unparse(rule.test) == "enable_deterministic"
    assert ast.unparse(rule.orelse) == "None", "SGLang now seeds without deterministic inference"
    defaults = [node.value for node in ast.walk(rule.body) if isinstance(node, ast.Constant)
                and isinstance(node.value, int) and not isinstance(node.value, bool)]
    assert DEFAULT_SAMPLING_SEED in defaults, f"SGLang's default seed is no longer {DEFAULT_SAMPLING_SEED}"
    assert "get_exec().deterministic.enable_deterministic_inference" in source

    model_dir = save_tiny_model(tmp_path / "model")
    seeded, _ = SequenceParams.from_sglang({"sampling_seed": 7})
    unseeded, _ = SequenceParams.from_sglang({})
    plain = EmbeddedEngine(model_dir).request_parser
    deterministic = EmbeddedEngine(model_dir, deterministic_inference=True).request_parser
    assert plain.sampling_seed(seeded) is None and plain.sampling_seed(unseeded) is None
    assert deterministic.sampling_seed(seeded) == 7 and deterministic.sampling_seed(unseeded) == 42
