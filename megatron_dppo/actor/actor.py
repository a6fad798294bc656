"""The actor: a TP/PP/DP-sharded GPTModel with Megatron's DDP, optimizer and LR schedule, behind four calls.

    forward(micro_batches, loss_fn)      forward only (old / reference log-probs)
    train_step(micro_batches, loss_fn)   zero grads → forward+backward (loss × loss scale) → DP reduce → unscale
                                         → (fp16 overflow: skip, scale down) → clip → optimizer step → LR step
    hf_tensors()                         the weights as HF-named tensors on the export source rank (weight sync)
    sharded_state_dict() / load(...)     Megatron distributed checkpoint state

Built as Megatron-LM builds a model (`get_model`, then DDP and the optimizer):

    build_gpt_model (this rank's stage) → load HF weights → place_model: to the device, Float16Module for bf16/fp16
        → DistributedDataParallel → get_megatron_optimizer (fp32 main copies of every bf16/fp16 parameter)

`self.model` is the bare FusedOutputGPTModel (its names, shape and sharded state: checkpoints, export, weight sync);
`self.ddp` is what the schedule runs: DDP(Float16Module(model)), Float16Module(model) for the frozen reference,
or the model itself in fp32 when nothing wraps it.

--fp16 trains as Megatron-LM does: the optimizer's dynamic grad scaler multiplies the loss before backward
(`config.grad_scale_func = optimizer.scale_loss`, set here as Megatron-LM's training loop sets it), the optimizer
divides the gradients by the scale and checks them for inf/NaN before clipping, and a step with overflowing gradients
is skipped (the scale goes down, the LR schedule does not advance) and reported as skipped.
"""

from dataclasses import dataclass

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron_dppo.actor.export import iter_hf_tensors
from megatron_dppo.actor.model import (
    Recompute,
    build_gpt_model,
    build_transformer_config,
    load_hf_weights,
    place_model,
)
from megatron_dppo.actor.step import LossFn, finalize_grads_without_token_scaling, run_micro_batches
from megatron_dppo.convert.hf_checkpoint import HFCheckpoint
from megatron_dppo.convert.mapping import ModelShape
from megatron_dppo.platform import current_device

# How --use-distributed-optimizer saves its state: Megatron-LM's default, each rank's buffers as they are, which resume
# under the same TP/PP (any DP). megatron-core 0.16's own default, fully_sharded_model_space, refuses to save
# ("ShardedTensor.flattened_range is not supported"). The other optimizers ignore it.
OPTIMIZER_CHECKPOINT_FORMAT = {"distrib_optim_sharding_type": "dp_reshardable"}


@dataclass
class OptimConfig:
    lr: float = 1e-6
    min_lr: float = 0.0
    lr_warmup_iters: int = 0
    lr_decay_iters: int = 1
    lr_decay_style: str = "constant"
    clip_grad: float = 1.0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    use_distributed_optimizer: bool = False
    initial_loss_scale: float = 2.0**16  # --fp16's dynamic loss scale at the start (Megatron-LM's flag)


class Actor:
    def __init__(self, shape: ModelShape, tp: int, pp: int, dtype: str, optim: OptimConfig | None,
                 hf_checkpoint: HFCheckpoint | None = None, sequence_parallel: bool = False,
                 transformer_impl: str | None = None, device: torch.device | str | None = None,
                 recompute: Recompute | None = None):
        """`optim=None` builds a frozen model (the reference policy): no DDP, no optimizer. `device`: where the model
        runs, by default this rank's (`platform.current_device()`). `recompute`: Megatron-LM's activation recompute
        (training steps only; the forward-only pass keeps no activations anyway)."""
        self.shape = shape
        self.device = torch.device(device or current_device())
        config = build_transformer_config(shape, tp, pp, dtype, sequence_parallel, transformer_impl,
                                          **(recompute or Recompute()).config_fields())
        self.model = build_gpt_model(shape, config)
        if hf_checkpoint is not None:
            load_hf_weights(self.model, hf_checkpoint)
        self.optimizer = self.scheduler = None
        self.ddp = place_model(self.model, self.device)
        if optim is None:
            for param in self.model.parameters():
                param.requires_grad_(False)
            return
        self.ddp = DistributedDataParallel(
            config, DistributedDataParallelConfig(
                use_distributed_optimizer=optim.use_distributed_optimizer, grad_reduce_in_fp32=True,
                overlap_grad_reduce=False), self.ddp)
        config.finalize_model_grads_func = finalize_grads_without_token_scaling
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam", lr=optim.lr, min_lr=optim.min_lr, weight_decay=optim.weight_decay,
                adam_beta1=optim.adam_beta1, adam_beta2=optim.adam_beta2, adam_eps=optim.adam_eps,
                clip_grad=optim.clip_grad, params_dtype=config.params_dtype, bf16=config.bf16, fp16=config.fp16,
                initial_loss_scale=optim.initial_loss_scale,
                use_distributed_optimizer=optim.use_distributed_optimizer),
            [self.ddp])
        # Megatron's schedule multiplies the loss by this before backward; without it fp16 gradients would stay
        # divided by the loss scale the optimizer unscales by (1 for bf16 and fp32, which have no scaler)
        config.grad_scale_func = self.optimizer.scale_loss
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=0.0 if optim.lr_warmup_iters else optim.lr, max_lr=optim.lr, min_lr=optim.min_lr,
            lr_warmup_steps=optim.lr_warmup_iters, lr_decay_steps=max(optim.lr_decay_iters, optim.lr_warmup_iters + 1),
            lr_decay_style=optim.lr_decay_style, start_wd=optim.weight_decay, end_wd=optim.weight_decay,
            wd_incr_steps=1, wd_incr_style="constant")

    def forward(self, micro_batches, loss_fn: LossFn) -> list[dict]:
        """Forward only; loss_fn's output dicts on the last pipeline stage."""
        self.model.eval()
        with torch.no_grad():
            return run_micro_batches([self.ddp], micro_batches, loss_fn, forward_only=True)

    def train_step(self, micro_batches, loss_fn: LossFn) -> tuple[float | None, list[dict]]:
        """One optimizer step over all micro-batches; returns (grad norm before clipping, loss_fn outputs). The norm
        is None for a step the fp16 grad scaler skipped (overflowing gradients; the only way Megatron's optimizer
        refuses a step): the weights are kept and, as in Megatron-LM, the LR schedule does not advance."""
        self.model.train()
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        outputs = run_micro_batches([self.ddp], micro_batches, loss_fn, forward_only=False)
        success, grad_norm, _ = self.optimizer.step()
        if not success:
            return None, outputs
        self.scheduler.step(increment=1)
        return float(grad_norm or 0.0), outputs

    @property
    def loss_scale(self) -> float:
        """The loss scale of the next step (1 without fp16's grad scaler)."""
        return float(self.optimizer.get_loss_scale())

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def hf_tensors(self):
        return iter_hf_tensors(self.model)

    def sharded_state_dict(self) -> dict:
        model_state = self.model.sharded_state_dict()
        state = {"model": model_state}
        if self.optimizer is not None:
            self._give_unstepped_adam_a_state()
            state["optimizer"] = self.optimizer.sharded_state_dict(model_state, metadata=OPTIMIZER_CHECKPOINT_FORMAT)
        return state

    def _megatron_optimizers(self) -> list:
        return getattr(self.optimizer, "chained_optimizers", [self.optimizer])

    def _torch_adams_of_distributed_optimizers(self) -> list[torch.optim.Optimizer]:
        """The torch Adam inside each distributed optimizer (the CPU's and a GPU's without TE or Apex; their fused
        Adams count steps per group, which megatron-core's distributed checkpoints handle)."""
        return [optimizer.optimizer for optimizer in self._megatron_optimizers()
                if isinstance(optimizer, DistributedOptimizer)
                and isinstance(optimizer.optimizer, torch.optim.Adam | torch.optim.AdamW)]

    def _give_unstepped_adam_a_state(self) -> None:
        """Adam creates a parameter's state at its first step; megatron-core 0.16.1 can neither save nor load an Adam
        that never stepped (every update so far skipped: no kept samples, or fp16 overflows): the distributed
        optimizer asserts on torch Adam's missing step counts, and both optimizers describe a checkpoint without the
        moments a later load asks for. Each parameter without a state gets the one Adam's first step would create:
        zero moments (megatron-core's own `init_state_fn`, as its loaders call it) and, for torch Adam, step 0. Before
        a save, so that the checkpoint holds it, and before a load, as placeholders the load overwrites (as
        megatron-core's own loaders load over dummy values); a later step computes what it would have from none."""
        for optimizer in self._megatron_optimizers():
            if optimizer.init_state_fn is not None:
                optimizer.init_state_fn(optimizer.optimizer, optimizer.config)
            if isinstance(optimizer.optimizer, torch.optim.Adam | torch.optim.AdamW):
                for state in optimizer.optimizer.state.values():
                    state.setdefault("step", torch.zeros((), dtype=torch.float32))

    def _step_zero_where_unsaved(self, loaded: dict) -> None:
        """megatron-core 0.16.1 saves the shared step count of an optimizer without --use-distributed-optimizer only
        when it is non-zero (`if step:` in Float16OptimizerWithFloat16Params' and FP32Optimizer's
        sharded_state_dict), so the checkpoint of an Adam that never stepped has none, and torch Adam refuses states
        without one: they load with step 0, the count that was saved."""
        optimizers = self._megatron_optimizers()
        parts = [loaded] if len(optimizers) == 1 else [loaded[index] for index in sorted(loaded)]
        for optimizer, part in zip(optimizers, parts):
            if isinstance(optimizer, DistributedOptimizer) or not isinstance(
                    optimizer.optimizer, torch.optim.Adam | torch.optim.AdamW):
                continue
            state = part["optimizer"]["state"] if "optimizer" in part else part["state"]
            if "common_step" not in state:
                for param_state in state.values():
                    param_state.setdefault("step", torch.zeros((), dtype=torch.float32))

    def _restore_adam_step_counts(self) -> None:
        """megatron-core 0.16.1's distributed optimizer, loading into torch Adam, sets every parameter's `step` to one
        shared tensor holding the saved count, then copies the request's own step values (the placeholders) over
        it; torch Adam would also add 1 to that shared tensor once per parameter. Each parameter gets its own count
        again, the one the checkpoint saved with its group, as in an uninterrupted run."""
        for adam in self._torch_adams_of_distributed_optimizers():
            for group in adam.param_groups:
                for param in group["params"]:
                    adam.state[param]["step"] = torch.tensor(float(group["step"]), dtype=torch.float32)

    def restorable_state(self) -> dict[str, torch.Tensor]:
        """Copies of every tensor a resume restores and the next step trains on, by name: the model's weights and,
        per parameter, the optimizer's fp32 main copy, Adam's moments and step count, and the loss scaler's state.
        Adam's step count is where the optimizer keeps it: torch Adam's per parameter (`state[p]['step']`,
        `<group>.param<j>.step`), TE's and Apex's FusedAdam's per parameter group (`param_groups[i]['step']`,
        `<group>.step`, read where the group's parameters keep no count of their own: megatron-core's loader also
        writes the saved count into torch Adam's groups, where torch Adam never reads or advances it).
        What two runs' checkpoints restore is compared through it (tests/workers/optimizer_state_checks.py,
        tools/gpu_check.py); a checkpoint also stores what is never restored (the distributed optimizer's flat
        buffers keep uninitialised bytes in the alignment gaps between parameters)."""
        state = {f"model.{name}": param.detach().clone() for name, param in self.model.named_parameters()}
        for index, optimizer in enumerate(self._megatron_optimizers() if self.optimizer is not None else []):
            torch_optimizer = optimizer.optimizer
            for group_index, group in enumerate(torch_optimizer.param_groups):
                counted_per_param = any("step" in torch_optimizer.state.get(param, {}) for param in group["params"])
                if "step" in group and not counted_per_param:
                    state[f"optimizer{index}.group{group_index}.step"] = torch.as_tensor(
                        group["step"], dtype=torch.float64).clone()
                for param_index, param in enumerate(group["params"]):
                    where = f"optimizer{index}.group{group_index}.param{param_index}"
                    state[f"{where}.main_param"] = param.detach().clone()
                    for key, value in torch_optimizer.state[param].items():
                        state[f"{where}.{key}"] = torch.as_tensor(value).clone()
            if getattr(optimizer, "grad_scaler", None) is not None:
                for key, value in optimizer.grad_scaler.state_dict().items():
                    state[f"optimizer{index}.grad_scaler.{key}"] = torch.as_tensor(value).clone()
        return state

    def load_sharded(self, checkpoint, with_optimizer: bool) -> None:
        """Load model (and optimizer) state from a Megatron checkpoint: the model's saved under any TP/PP, the
        optimizer's as actor/checkpoint.py says (the distributed optimizer's under its own TP/PP only)."""
        from megatron_dppo.actor.checkpoint import load_module_state, load_sharded

        model_state = self.model.sharded_state_dict()
        request = {"model": model_state}
        if with_optimizer:
            self._give_unstepped_adam_a_state()
            request["optimizer"] = self.optimizer.sharded_state_dict(model_state, is_loading=True,
                                                                     metadata=OPTIMIZER_CHECKPOINT_FORMAT)
        loaded = load_sharded(checkpoint, request)
        load_module_state(self.model, loaded["model"])
        if with_optimizer:
            self._step_zero_where_unsaved(loaded["optimizer"])
            self.optimizer.load_state_dict(loaded["optimizer"])
            self._restore_adam_step_counts()
        elif self.optimizer is not None:
            self.optimizer.reload_model_params()  # the optimizer's main copies must follow the new weights
