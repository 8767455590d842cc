"""What PyTorch users and frameworks (Lightning, Accelerate, the Transformers Trainer) do with a
DDP object beyond forward and backward: pickle or deep-copy it, call `_set_static_graph()`,
read `_get_ddp_logging_data()`, and reach for torch's other attributes. A mixin of
`DistributedDataParallel` (ddp.py), with torch's meanings; names it does not provide raise a
MicroDDPError saying what to do instead (refusals.py).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel.scatter_gather import gather as _gather
from torch.nn.parallel.scatter_gather import scatter_kwargs

from ..comms import distributed, group_rank
from ..errors import MicroDDPError
from .comm_hooks import BUILTIN
from .logging_data import logging_data
from .refusals import TORCH_NAMES, refusal
from .sync import BROADCAST_BUCKET_BYTES
from .torch_errors import DDPValueError, torch_says

_BUILTIN_HOOKS = {"ALLREDUCE": "allreduce", "FP16_COMPRESS": "fp16_compress"}


class TorchDDPApi:
    """torch's DDP methods and attributes that frameworks use; see the module docstring."""

    # -- pickling, as torch: drop the reducer (hooks and buckets), rebuild it on load --------
    def __getstate__(self) -> dict:
        group = self.process_group
        if group is not None and distributed() and group != dist.group.WORLD:
            raise MicroDDPError("a DistributedDataParallel model can be pickled (torch.save, "
                                "copy.deepcopy) only when it uses the default process group, "
                                "as with torch's; save ddp.module instead, or its state_dict()")
        state = dict(self.__dict__)
        for name in ("reducer", "_sparse", "_join", "_torch_join", "process_group"):
            state.pop(name, None)
        return state

    def __setstate__(self, state: dict) -> None:
        nn.Module.__setstate__(self, state)
        self.process_group, self._join, self._torch_join = None, None, None
        self._build_reducer()  # a fresh one, as torch's: a comm hook must be registered again

    # -- static graph ------------------------------------------------------------------------
    def _set_static_graph(self) -> None:
        """torch's older way to say static_graph=True; only before the first forward."""
        if self.static_graph:
            warnings.warn("static_graph is already True; _set_static_graph() has nothing to do",
                          stacklevel=2)
            return
        if self.reducer.stats.iterations:
            raise self._logged(MicroDDPError(
                "_set_static_graph() should be called before training loop starts: before the "
                "first forward (the first iteration is the one that learns the graph); call it "
                "right after wrapping, or pass static_graph=True"))
        if self.find_unused_parameters:
            warnings.warn("find_unused_parameters=True is not needed with _set_static_graph(): "
                          "the first iteration finds the unused parameters, which must then "
                          "stay the same in every iteration", stacklevel=2)
        self.static_graph = True
        self._build_reducer()

    # -- logging -----------------------------------------------------------------------------
    def _logged(self, error: Exception) -> Exception:
        """`error`, also kept for _get_ddp_logging_data's has_error and error (torch's
        _log_and_throw records what its DDP raises the same way)."""
        self._error = str(error)
        return error

    def _get_ddp_logging_data(self) -> dict:
        """torch's dictionary of facts and average times (see logging_data.py for the keys)."""
        return logging_data(self)

    def _set_ddp_runtime_logging_sample_rate(self, sample_rate: int) -> None:
        """Time the first 10 iterations, then one in `sample_rate` (torch's rule)."""
        if not isinstance(sample_rate, int) or sample_rate < 1:
            raise self._logged(DDPValueError(torch_says(
                "DDP runtime logging sample rate should be equal or greater than 1.",
                f"It must be an integer of at least 1, got {sample_rate!r}.")))
        self.reducer.stats.sample_rate = sample_rate

    # -- torch's other attributes, with torch's meaning ---------------------------------------
    @property
    def bucket_bytes_cap(self) -> int:
        """The cap of every bucket after the first, in bytes (torch's attribute)."""
        return self.reducer.caps[1]

    @property
    def bucket_bytes_cap_default(self) -> bool:
        """Whether the caller left bucket_cap_mb at its default."""
        return self._bucket_cap_default

    bucket_bytes_cap_list = None  # torch 2.13's per-bucket caps, refused at construction
    broadcast_bucket_size = BROADCAST_BUCKET_BYTES
    mixed_precision = None
    batched_grad_copy = False
    skip_all_reduce_unused_params = False
    use_side_stream_for_tensor_copies = False
    is_multi_device_module = False  # refused at construction
    _delay_all_reduce_all_params = False

    @property
    def _delay_all_reduce_params(self) -> list:
        return []

    @property
    def parameters_to_ignore(self) -> set:
        """Always empty: ignoring parameters is refused at construction."""
        return set()  # refused at construction

    @property
    def device_type(self) -> str:
        """`cpu` or `cuda`: the type of the module's device."""
        return self.device.type

    @property
    def _has_rebuilt_buckets(self) -> bool:
        return self.reducer.has_rebuilt

    @property
    def _module_parameters(self) -> list[nn.Parameter]:
        return list(self.reducer.params)

    @property
    def modules_buffers(self) -> list[torch.Tensor]:
        """The module's buffers, the ones forward broadcasts."""
        return list(self.module.buffers())

    @property
    def named_module_buffers(self) -> list[tuple[str, torch.Tensor]]:
        """The module's buffers with their names."""
        return list(self.module.named_buffers())

    @property
    def _distributed_rank(self) -> int:
        return group_rank(self.process_group)

    def will_sync_module_buffers(self) -> bool:
        """Whether this forward broadcasts buffers (torch's name for will_sync_buffers)."""
        return self.will_sync_buffers()

    @staticmethod
    def _get_data_parallel_params(module: nn.Module, named_params: bool = False) -> Iterator:
        return iter(module.named_parameters() if named_params else module.parameters())

    @staticmethod
    def _set_params_and_buffers_to_ignore_for_model(module: nn.Module, names) -> None:
        raise refusal("_set_params_and_buffers_to_ignore_for_model",
                      "DistributedDataParallel") from None

    def _check_reducer_finalized(self) -> None:
        """Raise if a forward prepared a backward that has not averaged its gradients yet."""
        if self.reducer.expect:
            raise MicroDDPError("the last forward's gradients have not been averaged: no "
                                "backward ran after it (or it did not reach the parameters); "
                                "call loss.backward() after each forward that syncs")

    def _remove_autograd_hooks(self) -> None:
        """Remove the reducer's gradient hooks: backward no longer averages anything."""
        for h in self.reducer.handles:
            h.remove()
        self.reducer.handles.clear()

    def _set_ddp_sink_clone(self, val: bool) -> None:
        """Accepted: microddp never clones forward outputs, whatever this says."""
        self._ddp_sink_clone = bool(val)

    def _register_builtin_comm_hook(self, comm_hook_type) -> None:
        """torch's built-in hook types (dist.BuiltinCommHookType), or one of microddp's by
        name ("ring", "shm": see dp/comm_hooks.py)."""
        if isinstance(comm_hook_type, str) and comm_hook_type in BUILTIN:
            self.register_comm_hook(None, comm_hook_type)
            return
        name = getattr(comm_hook_type, "name", str(comm_hook_type))
        if name not in _BUILTIN_HOOKS:
            raise MicroDDPError(f"unknown built-in comm hook type {comm_hook_type!r}; torch's "
                                f"are {', '.join(_BUILTIN_HOOKS)}, microddp's "
                                f"{', '.join(BUILTIN)}")
        self.register_comm_hook(None, _BUILTIN_HOOKS[name])

    def scatter(self, inputs, kwargs, device_ids):
        """Split inputs along `dim` for each device, as torch's DDP does."""
        return scatter_kwargs(inputs, kwargs, device_ids, dim=self.dim)

    def to_kwargs(self, inputs, kwargs, device_id):
        """Move inputs and keyword arguments to the device `device_id`, in torch's nested form."""
        device = torch.device(self.device_type, device_id)
        inputs, kwargs = to_device((tuple(inputs or ()), dict(kwargs or {})), device)
        return (inputs,), (kwargs,)

    def gather(self, outputs, output_device):
        """Gather outputs onto `output_device` along `dim`, as torch's DDP does."""
        return _gather(outputs, output_device, dim=self.dim)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)  # nn.Module's: parameters, buffers, submodules
        except AttributeError:
            if name in TORCH_NAMES:
                raise refusal(name) from None
            raise


def to_device(obj, device: torch.device):
    """`obj` with every tensor in it (in lists, tuples, dicts) moved to `device`."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(o, device) for o in obj)
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    return obj
