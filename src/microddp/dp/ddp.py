"""`microddp.DistributedDataParallel`: a drop-in replacement for PyTorch's, built from scratch.

    model = microddp.DDP(FullMLP(128))     # instead of torch.nn.parallel.DistributedDataParallel
    loss_fn(model(x), y).backward()         # gradients are averaged over ranks when this returns

Construction checks that every rank built the same model (names, shapes, dtypes) and copies
rank 0's parameters and buffers everywhere. Each forward broadcasts buffers (BatchNorm running
statistics) from rank 0; each backward runs the overlapped, bucketed Reducer (reducer.py).
Same constructor names, defaults and results as PyTorch's, bit for bit.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join as TorchJoin
from torch.distributed.algorithms.join import Joinable, _JoinConfig

from ..collectives.hierarchical import choose as choose_hierarchy
from ..comms import distributed, given_group
from ..errors import MicroDDPError
from .buckets import DEFAULT_BUCKET_CAP_MB, FIRST_BUCKET_BYTES, MiB, check_bucket_cap
from .comm_hooks import BUILTIN, CommHook, check_hook
from .compiled import as_active, not_traced
from .join import Join, TorchJoinHook
from .reducer import Reducer
from .sparse import SparseGrads, sparse_parameters
from .sync import (
    broadcast_coalesced,
    global_rank,
    sync_module_states,
    verify_same_model,
)
from .torch_api import TorchDDPApi, to_device
from .unused import output_tensors


def _mb(bucket_cap_mb: float | None) -> float | None:
    """As the ranks compare it: 25 and 25.0 are the same size."""
    return None if bucket_cap_mb is None else float(bucket_cap_mb)


class DistributedDataParallel(TorchDDPApi, nn.Module, Joinable):
    """Replicate `module` on every rank and average its gradients during backward."""

    def __init__(self, module: nn.Module, device_ids: list | None = None, output_device=None,
                 dim: int = 0, broadcast_buffers: bool | None = None, init_sync: bool = True,
                 process_group=None, bucket_cap_mb: float | None = None,
                 find_unused_parameters: bool = False, check_reduction: bool = False,
                 gradient_as_bucket_view: bool = False, static_graph: bool = False,
                 forward_sync_buffers: bool | None = None, **torch_only) -> None:
        super().__init__()
        _refuse(torch_only)
        if not isinstance(module, nn.Module):
            raise MicroDDPError(f"DistributedDataParallel wraps an nn.Module, got "
                                f"{type(module).__name__}")
        if getattr(module, "_ddp_params_and_buffers_to_ignore", None):
            raise MicroDDPError("the module has parameters or buffers marked to be ignored by "
                                "DDP (_set_params_and_buffers_to_ignore_for_model), which "
                                "microddp does not support; freeze such parameters "
                                "(requires_grad=False) before wrapping, or use torch's DDP")
        self.module = module
        self._input_device = _device_ids(module, device_ids)
        self.device_ids = (None if self._input_device is None  # torch keeps indices
                           else [d.index for d in self._input_device])
        self.output_device, self.dim = output_device, dim
        # torch 2.13's rule: forward_sync_buffers (buffers from rank 0 before each forward)
        # replaces broadcast_buffers, which also decided whether buffers are copied at start.
        if forward_sync_buffers is not None:
            if broadcast_buffers is not None:
                warnings.warn("both broadcast_buffers and forward_sync_buffers were given; "
                              "broadcast_buffers is ignored (as in torch)", stacklevel=2)
            self.forward_sync_buffers, init_buffers = bool(forward_sync_buffers), True
        else:
            self.forward_sync_buffers = init_buffers = (
                True if broadcast_buffers is None else bool(broadcast_buffers))
        self.process_group = process_group
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view, self.static_graph = gradient_as_bucket_view, static_graph
        self.require_backward_grad_sync = True  # False inside no_sync()
        self.require_forward_param_sync = True  # buffers are synced after a syncing forward
        self._join: Join | None = None  # inside `with ddp.join()`
        # Inside torch's `with Join([model, ...])`: it sets _join_config, asks join_hook()
        self._join_config = _JoinConfig.construct_disabled_join_config()
        self._torch_join: Join | None = None
        self._ever_joined = False  # for _get_ddp_logging_data's join_uneven_inputs
        self._error: str | None = None  # the last error raised as torch's DDP logs it
        self._ddp_sink_clone = True  # torch's flag; microddp never clones outputs anyway
        self._has_buffers = any(True for _ in module.buffers())
        # Parameters frozen now get no hook: if one is unfrozen later, its gradient would stay
        # local and the replicas drift apart (torch's DDP lets them, silently).
        self._frozen = [(n, p) for n, p in module.named_parameters() if not p.requires_grad]
        if not any(p.requires_grad for p in module.parameters()):
            raise MicroDDPError("the module has no parameter that requires a gradient, so there "
                                "is nothing to average; wrap a trainable module")
        check_bucket_cap(bucket_cap_mb)
        cap = int((DEFAULT_BUCKET_CAP_MB if bucket_cap_mb is None else bucket_cap_mb) * MiB)
        first = FIRST_BUCKET_BYTES if bucket_cap_mb is None else cap
        self._caps, self._bucket_cap_default = (cap, first), bucket_cap_mb is None
        _refuse_off_gpu(module, process_group, init_buffers or self.forward_sync_buffers)
        if init_sync:  # as in torch, init_sync=False means no collective here at all
            # Buffers are compared only where they will be overwritten with rank 0's: with
            # broadcast_buffers=False they may be rank-local, of any shape.
            buffers = init_buffers or self.forward_sync_buffers
            # bucket sizes too: different caps put different parameters in one bucket's
            # all-reduce, a wrong average on some ranks rather than an error
            verify_same_model(module, process_group, buffers=buffers,
                              settings={"bucket_cap_mb": _mb(bucket_cap_mb)})
            sync_module_states(module, self.src_rank(), process_group, buffers=init_buffers)
            choose_hierarchy(process_group)  # ranks on several hosts: all-reduce by host first
        self._build_reducer()

    def _build_reducer(self) -> None:
        """A new Reducer for the current settings (at wrapping, unpickling, _set_static_graph);
        a comm hook registered on the old one carries over, except on unpickling (as torch)."""
        old = self.__dict__.get("reducer")
        sparse = sparse_parameters(self.module)
        names, params = _reducer_params(self.module, skip=sparse)
        # Sparse gradients go beside the buckets (sparse.py); None when there are none.
        sparse_names, sparse_params = _reducer_params(self.module, keep=sparse)
        self._sparse = (SparseGrads(sparse_params, sparse_names, self.process_group)
                        if sparse_params else None)
        with torch.enable_grad():
            self.reducer = Reducer(params, names, self.process_group, self._caps[0],
                                   self._caps[1], self.find_unused_parameters,
                                   self.gradient_as_bucket_view, self.static_graph)
        if old is not None:
            self.reducer.comm_hook, self.reducer.comm_state = old.comm_hook, old.comm_state

    @property
    def broadcast_buffers(self) -> bool:
        """torch's older name for `forward_sync_buffers`."""
        return self.forward_sync_buffers

    @broadcast_buffers.setter
    def broadcast_buffers(self, value: bool) -> None:
        """Set whether forward broadcasts buffers from rank 0 (torch's attribute name)."""
        self.forward_sync_buffers = value

    def src_rank(self, group_rank: int = 0) -> int:
        """The global rank of group rank `group_rank`: where parameters and buffers come from."""
        return global_rank(self.process_group, group_rank)

    @property
    def device(self) -> torch.device:
        """The device of the module's parameters."""
        return next(self.module.parameters()).device

    @not_traced  # under torch.compile, the module is compiled, not this (compiled.py)
    def forward(self, *inputs, **kwargs):
        """Run the module, first syncing buffers and preparing the reducer for this iteration's
        backward."""
        self.reducer.release_retired()
        grad_sync = torch.is_grad_enabled() and self.require_backward_grad_sync
        if self._frozen and torch.is_grad_enabled():
            _refuse_unfrozen(self._frozen)
        src = self.src_rank()
        if self._join is not None:  # tell ranks that ran out of data what to shadow
            src = self._join.notify(grad_sync)
        elif self._join_config.enable and self._torch_join is not None:
            work = TorchJoin.notify_join_context(self)  # torch's Join's own "I am active"
            if work is not None:
                work.wait()
            src = self._torch_join.notify(grad_sync)
        if torch.is_grad_enabled():
            self.reducer.rebuild_buckets()
        if self.will_sync_buffers():
            broadcast_coalesced(list(self.module.buffers()), src, self.process_group,
                                keep_versions=True)
        if self._input_device:
            inputs, kwargs = to_device((inputs, kwargs), self._input_device[0])
        if grad_sync:
            self.reducer.stats.forward_started()
        with as_active(self):  # torch.compile splits the module's graph by bucket
            output = self.module(*inputs, **kwargs)
        self.require_forward_param_sync = grad_sync
        if grad_sync:
            self.reducer.prepare_for_backward(list(output_tensors(output)))
            if self._sparse is not None:
                self._sparse.prepare_for_backward()
        # A forward that does not sync (no_sync, no_grad) leaves the reducer as it was, as in
        # torch: an earlier syncing forward's backward still averages its gradients.
        return output

    def will_sync_buffers(self) -> bool:
        """Whether this forward broadcasts the module's buffers from the source rank."""
        return (self.require_forward_param_sync and self.forward_sync_buffers
                and self._has_buffers)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; the first backward after the block averages them all.

        Put the forward inside the block too: whether a backward syncs is decided at forward.
        """
        before = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = before

    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False) -> Join:
        """Context manager for uneven inputs: a rank that runs out of batches keeps answering
        the others' collectives (with zero gradients) until every rank is done."""
        self._ever_joined = True
        return Join(self, divide_by_initial_world_size, enable, throw_on_early_termination)

    def join_hook(self, **kwargs) -> TorchJoinHook:
        """For torch's generic `Join([model, optimizer, ...])` context manager (Joinable)."""
        self._torch_join = Join(self, kwargs.get("divide_by_initial_world_size", True))
        self._ever_joined = True
        return TorchJoinHook(self._torch_join)

    @property
    def join_device(self) -> torch.device:
        """The device a join's bookkeeping tensors live on (torch's Joinable API)."""
        return self.device

    @property
    def join_process_group(self):
        """The group a join talks over (torch's Joinable API)."""
        return dist.group.WORLD if self.process_group is None else self.process_group

    def register_comm_hook(self, state: object, hook: CommHook | str) -> None:
        """Replace how a bucket is averaged: `hook(state, bucket)` returns a Future of the
        averaged flat tensor (PyTorch's contract; its built-in hooks work here too)."""
        if isinstance(hook, str):
            if hook not in BUILTIN:
                raise MicroDDPError(f"unknown built-in hook {hook!r}; choose one of "
                                    f"{', '.join(BUILTIN)}")
            hook = BUILTIN[hook]
        try:
            check_hook(hook)  # torch's TypeError/ValueError, and microddp's advice
        except MicroDDPError as e:
            raise self._logged(e) from None
        if self._sparse is not None:
            raise MicroDDPError(f"parameter '{self._sparse.names[0]}' has sparse gradients "
                                "(sparse=True), which microddp averages without comm hooks; "
                                "build the embedding with sparse=False to use a hook")
        if self.reducer.comm_hook is not None:
            raise self._logged(MicroDDPError(
                "register_comm_hook or register_builtin_comm_hook can only be called once. This "
                "model already has a comm hook; wrap the module again to use another one"))
        self.reducer.comm_hook, self.reducer.comm_state = hook, state


# Options of torch 2.13's DistributedDataParallel that microddp does not implement.
_TORCH_ONLY = ("delay_all_reduce_named_params", "param_to_hook_all_reduce", "mixed_precision",
               "device_mesh", "skip_all_reduce_unused_params", "bucket_cap_mb_list",
               "batched_grad_copy")


def _refuse(kwargs: dict) -> None:
    """A clear error for options torch has and we do not, or that neither has (a typo)."""
    for name, value in kwargs.items():
        if name not in _TORCH_ONLY:
            raise MicroDDPError(f"DistributedDataParallel got an unexpected argument {name!r}; "
                                "its arguments are torch's: see help(microddp.DDP)")
        if value not in (None, False):
            raise MicroDDPError(f"DistributedDataParallel: {name} is an option of torch's DDP "
                                "that microddp does not implement; drop it, or use "
                                "torch.nn.parallel.DistributedDataParallel")


def _refuse_unfrozen(frozen: list[tuple[str, nn.Parameter]]) -> None:
    thawed = [name for name, p in frozen if p.requires_grad]
    if thawed:
        raise MicroDDPError(
            f"parameter '{thawed[0]}'" + (f" (and {len(thawed) - 1} more)" if len(thawed) > 1
                                          else "")
            + " did not require a gradient when the model was wrapped, so its gradient would "
            "not be averaged and the replicas would drift apart; wrap the model again after "
            "changing requires_grad (torch's DDP has the same rule, unchecked)")


def _reducer_params(module: nn.Module, skip: set = frozenset(), keep: set | None = None
                    ) -> tuple[list[str], list[nn.Parameter]]:
    """Trainable parameters in module order, each once even if tied (shared) between layers;
    without those in `skip`, and only those in `keep` if given."""
    names, params, seen = [], [], set()
    for mod_name, mod in module.named_modules():
        for name, p in mod.named_parameters(recurse=False):
            if p.requires_grad and p not in seen and p not in skip and (
                    keep is None or p in keep):
                seen.add(p)
                names.append(f"{mod_name}.{name}" if mod_name else name)
                params.append(p)
    return names, params


def _device_ids(module: nn.Module, device_ids) -> list[torch.device] | None:
    devices = {p.device for p in module.parameters()}
    if device_ids is None:
        return None
    if any(d.type == "cpu" for d in devices):
        raise MicroDDPError("device_ids must be None for a module on the CPU; "
                            "move the module to its GPU first, or drop device_ids")
    if len(device_ids) != 1 or len(devices) > 1:
        raise MicroDDPError(f"device_ids={device_ids!r}: one process drives exactly one device; "
                            "pass device_ids=[local_rank] for a module on that GPU")
    d = device_ids[0]
    want = torch.device("cuda", d) if isinstance(d, int) else torch.device(d)
    have = next(iter(devices), want)
    if want != have and (want.index is not None or want.type != have.type):
        raise MicroDDPError(f"device_ids={device_ids!r}, but the module is on {have}: inputs "
                            f"would go to {want} and meet the weights on another device; pass "
                            f"device_ids=[{have.index}], or move the module to {want} first")
    return [have if want.index is None else want]


def _refuse_off_gpu(module: nn.Module, group, buffers: bool) -> None:
    """NCCL moves CUDA tensors only: a module left on the CPU would fail in the first
    broadcast with the backend's error, not one that says to move it."""
    if given_group(group) or not distributed() or str(dist.get_backend(group)) != "nccl":
        return
    tensors = list(module.parameters()) + (list(module.buffers()) if buffers else [])
    off = sorted({str(t.device) for t in tensors if t.device.type != "cuda"})
    if off:
        raise MicroDDPError(f"the process group uses NCCL, which moves CUDA tensors only, but "
                            f"the module has tensors on {', '.join(off)}; move it to this "
                            "rank's GPU first: module.to(microddp.get_world().device)")
