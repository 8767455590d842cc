"""`ddp._get_ddp_logging_data()`: torch's dictionary of facts about a DDP model, with torch's keys.

Monitoring code and scripts written for PyTorch's DDP read it (Lightning reads it at teardown),
so the keys and their formats are torch's: ints, or strings with lists joined by ", ".
Keys for which microddp has no fact (CUDA-only ones, or torch's C++ logger's own) are left out,
as torch leaves out what does not apply. Times are nanoseconds, as torch's, measured on the
first 10 iterations and then one in `sample_rate` (100 unless set), as torch samples them;
as in torch, a sampled forward publishes the iteration before it, and `iteration` says which.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
from torch import nn

from ..comms import distributed, given_group, group_rank, group_size

FIRST_SAMPLED = 10  # torch records every one of the first 10 iterations
DEFAULT_SAMPLE_RATE = 100  # torch's kDDPRuntimeLoggingSampleRate
_EVENTS = ("forward_compute_time_start", "backward_compute_time_start",
           "backward_compute_time_end", "backward_comm_time_start", "backward_comm_time_end")
_DTYPE_NAMES = {torch.float32: "float", torch.float64: "double", torch.float16: "c10::Half",
                torch.bfloat16: "c10::BFloat16"}  # torch's C++ type names
_ENV = {"master_addr": "MASTER_ADDR", "master_port": "MASTER_PORT",
        "cuda_visible_devices": "CUDA_VISIBLE_DEVICES",
        "torch_distributed_debug": "TORCH_DISTRIBUTED_DEBUG",
        "gloo_socket_ifname": "GLOO_SOCKET_IFNAME", "gloo_device_transport": "GLOO_DEVICE_TRANSPORT"}


class RuntimeStats:
    """When this iteration's forward, backward computation and communication started and ended,
    and running sums over the sampled iterations (what torch averages)."""

    def __init__(self) -> None:
        self.iterations = 0  # forwards whose backward averages gradients
        self.sample_rate = DEFAULT_SAMPLE_RATE
        self.on = False  # whether the current iteration is sampled
        self.at: dict[str, int] = {}
        self.last: dict[str, int] = {}  # the latest sampled iteration's events and times
        self.sums = {"forward": 0, "compute": 0, "comm": 0, "overlap": 0}
        self.sampled_count = 0
        self.pending: dict = {}  # this iteration's times, until the next forward publishes them
        self.order = ""  # the gradients' ready order in the latest sampled backward

    def sampled(self, n: int) -> bool:
        """torch's rule for the forward that follows `n` earlier ones: the first ten, then one
        in `sample_rate`."""
        return n > 0 and (n <= FIRST_SAMPLED or n % self.sample_rate == 0)

    def forward_started(self) -> None:
        """Start an iteration. As torch's logger: a sampled forward publishes the times of the
        iteration before it under `iteration` (the number of forwards so far), and this
        iteration is timed only if the next forward will publish it."""
        n = self.iterations
        if self.sampled(n) and self.pending:
            for k, v in self.pending.items():
                if k in self.sums:
                    self.sums[k] += v
            self.sampled_count += 1
            order = self.pending.pop("order")
            if order:  # torch keeps the last order logged when a backward fired no hook
                self.order = _joined(order)
            self.last = {**self.pending.pop("events"), "iteration": n,
                         "forward_compute_time": self.pending["forward"],
                         "backward_compute_time": self.pending["compute"],
                         "backward_comm_time": self.pending["comm"],
                         "backward_compute_comm_overlap_time": self.pending["overlap"]}
        self.pending = {}
        self.iterations += 1
        self.on = self.sampled(n + 1)
        self.at = {}
        if self.on:
            self.mark("forward_compute_time_start")

    def mark(self, event: str) -> None:
        """Note when `event` first happened in this iteration, if it is sampled."""
        if self.on and event not in self.at:
            self.at[event] = time.time_ns()

    def backward_done(self, order: list[int]) -> None:
        """Called when the averages are in `.grad`: close the iteration's record. `order` is
        the parameters' indices in the order their gradients became ready."""
        self.mark("backward_comm_time_end")
        if not self.on or any(e not in self.at for e in _EVENTS):
            return
        at = self.at
        times = {"forward": at["backward_compute_time_start"] - at["forward_compute_time_start"],
                 "compute": at["backward_compute_time_end"] - at["backward_compute_time_start"],
                 "comm": at["backward_comm_time_end"] - at["backward_comm_time_start"],
                 "overlap": max(0, at["backward_compute_time_end"]
                                - at["backward_comm_time_start"])}
        self.pending = {**times, "events": dict(at), "order": list(order)}  # the next forward
        # publishes them
        self.on = False

    def averages(self) -> dict[str, int]:
        """Mean nanoseconds per sampled iteration, under torch's `DDPLoggingData` names."""
        if not self.sampled_count:
            return {}
        n = self.sampled_count
        return {"avg_forward_compute_time": self.sums["forward"] // n,
                "avg_backward_compute_time": self.sums["compute"] // n,
                "avg_backward_comm_time": self.sums["comm"] // n,
                "avg_backward_compute_comm_overlap_time": self.sums["overlap"] // n}


def _joined(values) -> str:
    return ", ".join(str(v) for v in values)


def logging_data(ddp: nn.Module) -> dict:
    """The dictionary `_get_ddp_logging_data()` returns (see the module docstring)."""
    reducer, group = ddp.reducer, ddp.process_group
    on = distributed(group) or distributed()  # a given group first: no world formed
    params = reducer.params
    sizes = [b.nbytes for b in reducer.buckets]
    data = {
        "world_size": group_size(group),
        "rank": group_rank(group),
        "module_name": type(ddp.module).__name__,
        "device_ids": _joined(ddp.device_ids) if ddp.device_ids else "",
        "output_device": -1 if ddp.output_device is None else int(
            getattr(ddp.output_device, "index", ddp.output_device) or 0),
        "broadcast_buffers": int(ddp.forward_sync_buffers),
        "bucket_cap_bytes": reducer.caps[1],
        "find_unused_parameters": int(ddp.find_unused_parameters),
        "gradient_as_bucket_view": int(ddp.gradient_as_bucket_view),
        "static_graph": int(ddp.static_graph),
        "backend_name": (group.name() if given_group(group) else str(dist.get_backend(group))
                         if on else "none"),
        "dtypes": _joined(sorted({_DTYPE_NAMES.get(p.dtype, str(p.dtype).replace("torch.", ""))
                                  for p in params})),
        "total_parameter_size_bytes": sum(p.numel() * p.element_size() for p in params),
        "num_parameter_tensors": len(params),
        "is_multi_device_module": int(len({p.device for p in params}) > 1),
        "has_sync_bn": int(any("SyncBatchNorm" in type(m).__name__
                               for m in ddp.module.modules())),
        "num_buckets_reduced": len(reducer.buckets),
        "unused_parameter_size": sum(params[i].numel() * params[i].element_size()
                                     for i in reducer.unused),
        "has_rebuilt_buckets": int(reducer.has_rebuilt),
        "iteration": 0,  # until a sampled forward publishes one (stats.last)
    }
    key = "rebuilt_bucket_sizes" if reducer.has_rebuilt else "bucket_sizes"
    data["bucket_sizes"] = data.get("bucket_sizes", _joined(reducer.first_sizes))
    data[key] = _joined(sizes)
    if reducer.has_rebuilt:
        data["rebuilt_per_bucket_param_indices"] = _joined(
            " ".join(str(i) for i in b.indices) for b in reducer.buckets)
    if reducer.comm_hook is not None:
        data["comm_hook"] = getattr(reducer.comm_hook, "__qualname__", type(reducer.comm_hook)
                                    .__name__)
    if ddp._ever_joined:
        data["join_uneven_inputs"] = 1
    if getattr(ddp, "_error", None) is not None:  # unpickled from an older version: none
        data["has_error"], data["error"] = 1, ddp._error
    for name, var in _ENV.items():
        data[name] = os.environ.get(var, "N/A")
    if data["backend_name"] == "gloo":  # torch's logger asks gloo's backend its thread count
        data["gloo_num_threads"] = _gloo_threads(group)
    if reducer.stats.order:
        data["prev_iteration_grad_ready_order_indices"] = reducer.stats.order
    data.update(reducer.stats.last)
    data.update(reducer.stats.averages())
    return data


def _gloo_threads(group) -> int:
    """The worker threads of the group's gloo backend (its options' `_threads`, 2 unless set)."""
    group = group if group is not None else dist.group.WORLD
    return int(group._get_backend(torch.device("cpu")).options._threads)
