"""CPU mode for megatron-core: run TP/PP/DP, the pipeline schedule, DDP + optimizer and dist_checkpointing on gloo.

megatron-core has no CPU path (about 175 `torch.cuda.current_device()` calls in 0.16.1, literal `device="cuda"`
in the schedules, CUDA tensor-type asserts in the optimizer). This module is the one place that knows it. It is
switched on only when no CUDA device is used (`enable_cpu_mode()` refuses to run where CUDA is available), and
nothing outside `megatron_dppo/platform/` special-cases the CPU.

Assumptions it covers, each measured on megatron-core 0.16.1 (see docs/cpu_mode.md):
1. RNG tracker: `model_parallel_cuda_manual_seed` needs CUDA RNG states. We use the public
   `initialize_rng_tracker(inference_rng_tracker=True)`, whose `fork()` is a no-op; TP-consistent dropout RNG is
   lost, which is harmless because RL runs with dropout 0 (and `build_transformer_config` sets it to 0).
   Weights initialised with `use_cpu_initialization=True` come from the global CPU generator.
2. `torch.cuda.current_device` returns 0 (its real type) and every device argument that names CUDA (`"cuda"`,
   `"cuda:0"`, `torch.device("cuda")`, or a bare int) is rewritten to the CPU by a `TorchFunctionMode`; this covers
   the literal `device="cuda"` in schedules.py, the p2p receive buffers, the DDP grad buffers, RoPE's `inv_freq` move
   and the gather buffers of the TP mappings.
3. `Tensor.cuda()` and `Tensor.pin_memory()` return the tensor itself; a `pin_memory=True` argument becomes False.
4. `torch.cuda.synchronize`, `torch.cuda.Event` (timing through `time.perf_counter`), `torch.cuda.nvtx` ranges,
   `torch.cuda.empty_cache`, `torch.cuda.Stream`/`current_stream`/`stream` become host-side equivalents: on the CPU
   all work is synchronous, so a synchronisation point has nothing to wait for.
5. Grad clipping (`clip_grads.py`) and the (distributed) optimizer assert `param.type() == 'torch.cuda.FloatTensor'`
   (or Half/BFloat16). Inside the mode, `Tensor.type()` with no argument reports the CUDA type name of a CPU tensor.
   The tensor itself is untouched; only the string differs.
6. Activation recompute (`tensor_parallel.checkpoint`, Megatron-LM's --recompute-granularity) saves and restores the
   CUDA generator's state around each recomputed forward (`_get_cuda_rng_state` / `_set_cuda_rng_state`), which a
   torch without CUDA refuses ("Torch not compiled with CUDA enabled"). On the CPU there is no CUDA generator: the
   host's is the one random source, and the checkpoint saves and restores it itself (`torch.get_rng_state`). The
   two functions become: get = an empty state, set = nothing to set. A recomputed forward therefore draws exactly
   what the first one drew (tests/test_recompute.py: equal losses and gradients).

The mode is a process-wide state: it is entered once on the calling thread and stays on. It costs one Python
dispatch per torch call, which measured as unmeasurable at the sizes we run on the CPU.
"""

import contextlib
import threading
import time

import torch
from torch.overrides import TorchFunctionMode

_enabled = False
_lock = threading.Lock()


def _is_cuda_device(device) -> bool:
    if isinstance(device, int) and not isinstance(device, bool):
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


def _to_cpu(device):
    return torch.device("cpu") if _is_cuda_device(device) else device


class _CudaOnCpuMode(TorchFunctionMode):
    """Rewrites CUDA device requests to the CPU and reports CUDA tensor types (assumptions 2, 3 and 5)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
        if func in (torch.Tensor.cuda, torch.Tensor.pin_memory):
            return args[0]
        if "device" in kwargs:
            kwargs["device"] = _to_cpu(kwargs["device"])
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func is torch.Tensor.to and len(args) > 1:
            args = (args[0], *(_to_cpu(a) if _is_cuda_device(a) else a for a in args[1:]))
        return func(*args, **kwargs)


class _HostEvent:
    """Stands in for `torch.cuda.Event`: on the CPU the event is reached when `record` returns."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        self._time = None

    def record(self, stream=None):
        self._time = time.perf_counter()

    def synchronize(self):
        pass

    def wait(self, stream=None):
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end_event: "_HostEvent") -> float:
        return (end_event._time - self._time) * 1000.0


class _HostStream:
    """Stands in for `torch.cuda.Stream`: one synchronous host stream."""

    def __init__(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def wait_stream(self, other):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        event = event or _HostEvent()
        event.record()
        return event


def _no_op(*args, **kwargs):
    return None


def _no_cuda_rng_state(*args, **kwargs) -> torch.Tensor:
    """The CUDA generator's state where none exists (assumption 6): empty; the host generator's is saved apart."""
    return torch.empty(0, dtype=torch.uint8)


def enable_cpu_mode() -> None:
    """Switch megatron-core to the CPU (idempotent). Raises if a CUDA device is available: use the GPU path there."""
    global _enabled
    with _lock:
        if _enabled:
            return
        if torch.cuda.is_available():
            raise RuntimeError(
                "enable_cpu_mode() was called on a machine with a CUDA device; the CPU mode is only for machines "
                "without one. Run with the GPU path (platform='cuda') instead."
            )
        from megatron.core.tensor_parallel import random as megatron_random

        megatron_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
        megatron_random._get_cuda_rng_state = _no_cuda_rng_state
        megatron_random._set_cuda_rng_state = _no_op
        torch.cuda.current_device = lambda: 0
        torch.cuda.synchronize = _no_op
        torch.cuda.empty_cache = _no_op
        torch.cuda.Event = _HostEvent
        torch.cuda.Stream = _HostStream
        torch.cuda.current_stream = lambda device=None: _HostStream()
        torch.cuda.default_stream = lambda device=None: _HostStream()
        torch.cuda.stream = lambda stream=None: contextlib.nullcontext()
        torch.cuda.nvtx.range_push = _no_op
        torch.cuda.nvtx.range_pop = _no_op
        _CudaOnCpuMode().__enter__()
        _enabled = True


def cpu_mode_enabled() -> bool:
    return _enabled
