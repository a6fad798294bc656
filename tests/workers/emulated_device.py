"""A second device on the CPU: proves that every tensor reaching the model or the loss was moved to the model's device.

On a GPU the actor's micro-batches arrive on the host and must be moved to CUDA before the model (TE attention
takes its device from `cu_seqlens`) and the loss (which meets CUDA logits) see them. On the CPU the host and the
model's device are the same, so nothing fails when a tensor skips the move. This stand-in tells them apart:

- `EmulatedDevice` (a TorchFunctionMode, entered around the code under test) makes the result of a move,
  `tensor.to(device)` or `tensor.cuda()`, and of a factory called with `device=...`, an `OnDevice` tensor, as those
  calls make a CUDA tensor on a GPU; `tensor.cpu()` gives a host tensor back.
- `OnDevice` (a tensor subclass) propagates through every op. Inside `strict()`, an op that takes an OnDevice tensor
  together with a host tensor of one or more dimensions raises DeviceMixError, as CUDA refuses such a mix (it accepts
  0-dim host tensors beside device ones, and so does this check).
- `watch_model(model)` checks at the model's boundary that every tensor argument (PackedSeqParams' fields included)
  is OnDevice; the model then runs on plain tensors and its output comes back OnDevice, as CUDA hidden states would.
  A parameter the loss meets beside that output (the output layer's weight) is a device tensor on a GPU too:
  `parameter_on_device(param)` is the view of it the loss gets.
- An autograd Function's output that shares the storage of a device input (an alias, as a Function returning its
  input unchanged gives back under no_grad) stays a device tensor while `EmulatedDevice` is on.
"""

import contextlib
import dataclasses
import threading

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

_state = threading.local()


class DeviceMixError(RuntimeError):
    pass


def _tensors(value) -> list[torch.Tensor]:
    """Every tensor in `value`, looking into containers and into dataclass fields (PackedSeqParams)."""
    found = []
    for leaf in tree_leaves(value):
        if isinstance(leaf, torch.Tensor):
            found.append(leaf)
        elif dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            found += _tensors([getattr(leaf, field.name) for field in dataclasses.fields(leaf)])
    return found


def _plain(tensor: torch.Tensor) -> torch.Tensor:
    with torch._C.DisableTorchFunctionSubclass():
        return tensor.as_subclass(torch.Tensor)


def _on_device(value):
    if isinstance(value, torch.Tensor) and not isinstance(value, OnDevice):
        with torch._C.DisableTorchFunctionSubclass():
            return value.as_subclass(OnDevice)
    if isinstance(value, tuple | list):
        return type(value)(_on_device(item) for item in value)
    return value


class OnDevice(torch.Tensor):
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(_state, "strict", False):
            tensors = _tensors((args, kwargs))
            host = [tuple(t.shape) for t in tensors if not isinstance(t, OnDevice) and t.dim() > 0]
            if host and any(isinstance(t, OnDevice) for t in tensors):
                raise DeviceMixError(f"{getattr(func, '__name__', func)}: host tensors of shapes {host} meet "
                                     "device tensors (on a GPU: 'Expected all tensors to be on the same device')")
        return super().__torch_function__(func, types, args, kwargs)


def _names_a_device(args, kwargs) -> bool:
    if kwargs.get("device") is not None:
        return True
    return any(isinstance(arg, torch.device | str) or (isinstance(arg, int) and not isinstance(arg, bool))
               for arg in args[1:])


def _keeping_aliases_on_device(apply):
    """`Function.apply` whose outputs that share the storage of a device input are device tensors: a Function that
    returns its input unchanged (Megatron's copy-to-TP-region) gives back a plain alias of it under no_grad, the same
    memory, which on a GPU is on the device."""

    def apply_on_device(cls, *args, **kwargs):
        result = apply(cls, *args, **kwargs)
        storages = {arg.untyped_storage().data_ptr() for arg in args if isinstance(arg, OnDevice)}
        keep = lambda out: _on_device(out) if isinstance(out, torch.Tensor) and out.untyped_storage().data_ptr() \
            in storages else out  # noqa: E731
        return type(result)(keep(out) for out in result) if isinstance(result, tuple) else keep(result)

    return classmethod(apply_on_device)


class EmulatedDevice(TorchFunctionMode):
    def __enter__(self):
        self._apply = torch.autograd.Function.__dict__["apply"]
        torch.autograd.Function.apply = _keeping_aliases_on_device(self._apply.__func__)
        return super().__enter__()

    def __exit__(self, *exc):
        torch.autograd.Function.apply = self._apply
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if func is torch.Tensor.cpu:
            return _plain(result)
        if func is torch.Tensor.cuda or (func is torch.Tensor.to and _names_a_device(args, kwargs)) or (
                func is not torch.Tensor.to and kwargs.get("device") is not None):
            return _on_device(result)
        return result


@contextlib.contextmanager
def strict():
    """Inside: an op mixing host and device tensors raises DeviceMixError."""
    _state.strict = True
    try:
        yield
    finally:
        _state.strict = False


def require_on_device(what: str, value) -> None:
    host = [tuple(t.shape) for t in _tensors(value) if not isinstance(t, OnDevice)]
    if host:
        raise DeviceMixError(f"{what}: tensors of shapes {host} were not moved to the model's device")


def parameter_on_device(param: torch.Tensor) -> torch.Tensor:
    """An OnDevice view of a model parameter, as the loss meets it on a GPU; gradients still reach the parameter."""
    return _on_device(param)


def watch_model(model: torch.nn.Module) -> None:
    """Check the inputs of every forward of `model` are on the device; its output is a device tensor."""

    def check_inputs(module, args, kwargs):
        require_on_device("model input", (args, kwargs))
        unwrap = {id(t): _plain(t) for t in _tensors((args, kwargs))}
        swap = lambda leaf: unwrap.get(id(leaf), leaf)  # noqa: E731
        kwargs = {key: (dataclasses.replace(value, **{f.name: swap(getattr(value, f.name))
                                                      for f in dataclasses.fields(value)})
                        if dataclasses.is_dataclass(value) else swap(value)) for key, value in kwargs.items()}
        return tuple(swap(arg) for arg in args), kwargs

    model.register_forward_pre_hook(check_inputs, with_kwargs=True)
    model.register_forward_hook(lambda module, args, output: _on_device(output))
