"""The embedded engine's weights: SGLang's weight-update session and group, and loading by HF name.

    /init_weights_update_group (once, gloo) ─► per sync: /begin_weight_update ─► /update_weights_from_distributed per
    bucket (receive, check names and shapes, load: flattened buckets zero-copy, or one broadcast per tensor)
    ─► /end_weight_update;  /update_weights_from_disk: *.safetensors loaded by name
    --weight-noise S: every parameter loaded (at start, by each update) ─► + S · its RMS · seeded noise (WeightNoise)

The group, the bucket layout and unpacking are the wire protocol's (weight_update_protocol.py). The routes call
every load under the scheduler's model lock, so generation never sees a half-loaded bucket.

Invariants:
- an update outside a begin .. end session is refused before anything is received (HTTP 400, SGLang's message), as
  are a second begin and an end without a begin;
- every load clears the prefix cache first (its K/V were computed by the weights being replaced);
- a parameter of in_place_names (a view into one of the decoder's fused q/k/v or gate/up matrices) is loaded by
  writing into it, never by re-pointing it, so the fused matrix holds every load without being rebuilt;
- every received tensor must name a parameter of the model with the same shape, or the update fails and says which
  names were wrong; a refused bucket is still received, so the group stays in step, and malformed metadata (whose
  size cannot be known) makes the engine leave the group instead.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_dppo.platform import collectives
from megatron_dppo.servers.embedded.prefix_cache import PrefixCache
from megatron_dppo.servers.embedded.request_parser import RequestError
from megatron_dppo.weight_update_protocol import (
    destroy_weight_update_group,
    init_weight_update_group,
    tensor_nbytes,
    unpack_bucket,
)

# SGLang 0.5.23's weight-update session refusals (managers/scheduler_components/weight_updater.py), word for word;
# tests/test_rollout_contract.py reads them from the wheel's source.
UPDATE_OUTSIDE_SESSION = ("update_weights_from_distributed must run between begin_weight_update() and "
                          "end_weight_update()")
SESSION_ALREADY_OPEN = "a weight-update session is already open; call end_weight_update() first"
NO_SESSION_OPEN = "no weight-update session is open; call begin_weight_update() first"
SESSION_SELECTORS = ("target", "draft", "all")  # BeginWeightUpdateReqInput.selector
DEFAULT_GROUP = "weight_update_group"  # SGLang's group_name when a request gives none


@dataclass(frozen=True)
class WeightNoise:
    """A controlled disagreement between the engine and the trainer: every parameter the engine loads gets Gaussian
    noise of `relative` times its own RMS added, drawn from a generator seeded by (`seed`, the parameter's HF name).
    The same weights therefore always give the same perturbed copy (a fixed, reproducible engine error, as a
    precision or kernel difference is), and the gap it makes is what the trainer logs as
    logprob_gap_train_vs_rollout."""

    relative: float
    seed: int = 0

    @torch.no_grad()
    def apply(self, model, names) -> None:
        """Perturb the parameters `names` of `model` (buffers are left alone; a tied parameter once)."""
        parameters = dict(model.named_parameters(remove_duplicate=False))
        done = set()
        for name in names:
            parameter = parameters.get(name)
            if parameter is None or id(parameter) in done:
                continue
            done.add(id(parameter))
            generator = torch.Generator().manual_seed((self.seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
            values = parameter.data.float()
            noise = torch.randn(values.shape, generator=generator, dtype=torch.float32)
            parameter.data.copy_(values + self.relative * values.square().mean().sqrt() * noise)


class WeightUpdates:
    """The engine's weight side: the weight-update session, the groups joined, the received bucket buffers, the
    version the weights carry, and loading by HF name into `model` (callers hold the model lock)."""

    def __init__(self, model, prefix_cache: PrefixCache, noise: WeightNoise | None = None,
                 in_place_names: frozenset[str] = frozenset()):
        """model: the HF model generation runs on; prefix_cache: cleared by every load; noise: added to every
        parameter loaded (--weight-noise); in_place_names: parameters a load writes into and never re-points (the
        decoder's fused q/k/v and gate/up parts, views into its fused matrices: decoder.py)."""
        self.model = model
        self.prefix_cache = prefix_cache
        self.noise = noise
        self.in_place_names = in_place_names
        self.session_selector: str | None = None  # the open weight-update session's runners, as SGLang records it
        self.weight_version = "default"
        self.load_format = None
        self.groups: dict[str, object] = {}
        # flattened bucket layout (names, dtypes, shapes) -> the buffer it was received into, which some of its
        # parameters are views into; the next bucket of that layout is received into it again
        self.bucket_buffers: dict[tuple, torch.Tensor] = {}

    def record_version(self, body: dict) -> None:
        """The version an update's body names, once its weights have loaded (none named: the version stays)."""
        if body.get("weight_version") is not None:
            self.weight_version = str(body["weight_version"])

    def _parameters_by_name(self) -> dict[str, torch.Tensor]:
        tensors = dict(self.model.named_parameters(remove_duplicate=False))
        tensors.update(self.model.named_buffers(remove_duplicate=False))
        return tensors

    def join_group(self, body: dict) -> None:
        name = body.get("group_name", DEFAULT_GROUP)
        if name in self.groups:
            raise RequestError(f"weight update group {name!r} already exists; destroy it first")
        backend = body.get("backend", "nccl")
        if backend != "gloo":  # SGLang's default is nccl; this engine's weights live in host memory
            raise RequestError(f"backend {backend!r}: the embedded engine holds its model in host memory, which only "
                               "a gloo group carries; join with backend 'gloo'")
        self.groups[name] = init_weight_update_group(
            backend, body["master_address"], int(body["master_port"]),
            int(body["rank_offset"]), int(body["world_size"]), name,
        )

    def leave_group(self, body: dict) -> None:
        name = body.get("group_name", DEFAULT_GROUP)
        if name not in self.groups:
            raise RequestError(f"no weight update group {name!r}")
        destroy_weight_update_group(self.groups.pop(name))

    def begin_weight_update(self, body: dict) -> None:
        selector = body.get("selector", "all")
        if selector not in SESSION_SELECTORS:
            raise RequestError(f"selector {selector!r} must be one of {list(SESSION_SELECTORS)}")
        if self.session_selector is not None:
            raise RequestError(SESSION_ALREADY_OPEN)
        self.session_selector = selector

    def end_weight_update(self, body: dict) -> None:
        if self.session_selector is None:
            raise RequestError(NO_SESSION_OPEN)
        self.session_selector = None

    def update_from_distributed(self, body: dict) -> None:
        """Receive one bucket from group rank 0 and load it (receive_bucket), then perturb it (--weight-noise)."""
        self.receive_bucket(body)
        self._perturb(body["names"])

    def _perturb(self, names) -> None:
        if self.noise is not None:
            self.noise.apply(self.model, names)

    def receive_bucket(self, body: dict) -> None:
        """Receive one bucket from group rank 0 and load it (flattened_bucket: one broadcast; null: one per tensor).

        Zero-copy: a flattened bucket is received into a new buffer and the parameters it names become views into
        it; the next sync with the same bucket layout broadcasts straight into that buffer, i.e. into the
        parameters. Per-tensor broadcasts go straight into the parameters. A tensor whose dtype differs from its
        parameter's, that names a buffer, whose parameter is on a GPU (--device cuda: the gloo group carries host
        tensors), or whose parameter is a part of one of the decoder's fused matrices (in_place_names: a
        per-tensor broadcast still goes straight into it) is copied (and converted) instead. Names and shapes are
        checked before anything is loaded; a refused bucket is still received, so the group stays in step. Outside a
        begin/end session nothing is received (SGLang's rule): the trainer's broadcast is left to its teardown."""
        self.prefix_cache.clear()  # K/V computed by the weights this update replaces
        if self.session_selector is None:
            raise RequestError(UPDATE_OUTSIDE_SESSION)
        name = body.get("group_name", DEFAULT_GROUP)
        if name not in self.groups:
            raise RequestError(f"weight update group {name!r} does not exist; call /init_weights_update_group")
        group = self.groups[name]
        names, dtypes, shapes = body["names"], body["dtypes"], body["shapes"]
        load_format = body.get("load_format")
        problem = self._metadata_problem(names, dtypes, shapes, load_format)
        if problem:
            # The size of the trainer's broadcast cannot be known from malformed metadata, so this engine cannot
            # stay in step with the group: leave it, and say how to recover, rather than hang or load garbage.
            destroy_weight_update_group(self.groups.pop(name))
            raise RequestError(f"malformed weight update ({problem}); the weight update group {name!r} was "
                               "destroyed: call /init_weights_update_group again and resend the weights")
        if load_format == "flattened_bucket":
            layout = tuple(zip(names, dtypes, map(tuple, shapes), strict=True))
            flat = self.bucket_buffers.get(layout)
            if flat is None:
                flat = torch.empty(sum(tensor_nbytes(dtype, shape) for dtype, shape in zip(dtypes, shapes)),
                                   dtype=torch.uint8)
            collectives.broadcast(group, flat, 0, f"weight bucket {names[0]} .. {names[-1]}").wait()
            living = self.load_named_tensors(unpack_bucket(flat, names, dtypes, shapes), adopt=True)
            if layout not in self.bucket_buffers and living:
                self.bucket_buffers = {key: value for key, value in self.bucket_buffers.items()
                                       if not set(names) & {entry[0] for entry in key}}
                self.bucket_buffers[layout] = flat
            return
        if load_format is None:
            targets = self._parameters_by_name()
            received = []
            for tensor_name, dtype, shape in zip(names, dtypes, shapes, strict=True):
                target = targets.get(tensor_name)
                direct = (target is not None and target.dtype == getattr(torch, dtype) and target.device.type == "cpu"
                          and list(target.shape) == list(shape) and target.is_contiguous())
                tensor = target.data if direct else torch.empty(shape, dtype=getattr(torch, dtype))
                received.append((tensor_name, tensor))
            try:
                self._check_fit(received, targets)  # before receiving: a refused update changes nothing
                refused = None
            except RequestError as error:
                refused = error
                received = [(n, torch.empty(shape, dtype=getattr(torch, dtype)))
                            for n, dtype, shape in zip(names, dtypes, shapes)]
            # every receive posted at once: gloo sends a tensor once its receive is posted, so posting them one at a
            # time would leave the link idle between tensors
            works = [collectives.broadcast(group, tensor, 0, f"weight {tensor_name}")
                     for tensor_name, tensor in received]
            for work in works:
                work.wait()
            if refused is not None:
                raise refused
            self.load_named_tensors([(n, t) for n, t in received if t.data_ptr() != targets[n].data_ptr()])
            return

    @staticmethod
    def _metadata_problem(names, dtypes, shapes, load_format) -> str | None:
        if load_format not in (None, "flattened_bucket"):
            return f"load_format {load_format!r} is not supported; use null or 'flattened_bucket'"
        if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)):
            return "names, dtypes and shapes must be lists"
        if not len(names) == len(dtypes) == len(shapes):
            return f"{len(names)} names, {len(dtypes)} dtypes and {len(shapes)} shapes"
        unknown = sorted({d for d in dtypes if not isinstance(getattr(torch, str(d), None), torch.dtype)})
        if unknown:
            return f"unknown dtypes {unknown}"
        if any(not isinstance(shape, list) or any(not isinstance(n, int) or n < 0 for n in shape) for shape in shapes):
            return "every shape must be a list of non-negative integers"
        return None

    @staticmethod
    def _check_fit(named_tensors: list[tuple[str, torch.Tensor]], targets: dict[str, torch.Tensor]) -> None:
        unknown = [name for name, _ in named_tensors if name not in targets]
        mismatched = [f"{name} {list(t.shape)} vs {list(targets[name].shape)}" for name, t in named_tensors
                      if name in targets and t.shape != targets[name].shape]
        if unknown or mismatched:
            raise RequestError(f"weights do not fit the model: unknown names {unknown[:8]}, "
                               f"shape mismatches {mismatched[:8]}")

    @torch.no_grad()
    def load_named_tensors(self, named_tensors: list[tuple[str, torch.Tensor]], adopt: bool = False) -> int:
        """Load by HF name. adopt=True makes a parameter of the same dtype a view of the given tensor instead of
        copying into it (the caller hands its buffer over), except the in-place names (copied into); a parameter that
        is that very view already (a bucket received again into its buffer) is left as it is. Returns how many of
        the tensors the parameters now live in."""
        targets = self._parameters_by_name()
        self._check_fit(named_tensors, targets)
        parameters = dict(self.model.named_parameters(remove_duplicate=False))
        living = 0
        for name, tensor in named_tensors:
            target = targets[name]
            if (target.data_ptr() == tensor.data_ptr() and target.dtype == tensor.dtype
                    and target.device == tensor.device):
                living += 1  # received in place
            elif (adopt and name in parameters and name not in self.in_place_names and target.dtype == tensor.dtype
                    and target.device == tensor.device):
                parameters[name].data = tensor  # tied embeddings are one Parameter: both names follow
                living += 1
            else:
                target.copy_(tensor)
        return living

    def load_from_disk(self, body: dict) -> None:
        from safetensors.torch import load_file

        self.prefix_cache.clear()  # K/V computed by the weights this load replaces
        files = sorted(Path(body["model_path"]).glob("*.safetensors"))
        if not files:
            raise RequestError(f"model_path {body['model_path']} has no *.safetensors files")
        tensors = [item for file in files for item in load_file(file).items()]
        self.load_named_tensors(tensors)
        self._perturb([name for name, _ in tensors])
        self.load_format = body.get("load_format")
