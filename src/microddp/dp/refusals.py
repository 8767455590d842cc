"""Names of PyTorch's DistributedDataParallel (and its C++ reducer) that microddp does not have,
and what to do instead: code written for torch's DDP gets a MicroDDPError that says so, not an
AttributeError from deep inside."""

from __future__ import annotations

from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from ..errors import MicroDDPError


class RefusedAttribute(MicroDDPError, AttributeError):
    """A torch DDP attribute microddp does not provide. Also an AttributeError, so that
    `hasattr(ddp, name)` and `getattr(ddp, name, default)` keep their meaning."""


# Attributes torch 2.13's DDP sets in __init__ (not visible on the class).
TORCH_INSTANCE_ATTRIBUTES = (
    "_accum_grad_hooks", "_bucket_config", "_comm_hooks", "_ddp_sink_clone",
    "_delay_all_reduce_all_params", "_delay_all_reduce_params", "_delay_grad_buffer",
    "_delay_grad_views", "_has_rebuilt_buckets", "_join_config", "_lazy_init_ran",
    "_module_parameters", "_use_python_reducer", "batched_grad_copy", "broadcast_bucket_size",
    "bucket_bytes_cap", "bucket_bytes_cap_default", "bucket_bytes_cap_list", "device",
    "device_ids", "device_type", "dim", "find_unused_parameters", "forward_sync_buffers",
    "gradient_as_bucket_view", "is_multi_device_module", "logger", "mixed_precision",
    "modules_buffers", "named_module_buffers", "output_device", "parameters_to_ignore",
    "process_group", "reducer", "require_backward_grad_sync", "require_forward_param_sync",
    "skip_all_reduce_unused_params", "static_graph", "use_side_stream_for_tensor_copies",
)

# Every name of torch's DDP beyond nn.Module's, older ones included (`_module_copies`).
TORCH_NAMES = frozenset(
    {n for n in dir(TorchDDP) if n not in dir(nn.Module) and not n.startswith("__")
     and n != "_abc_impl"} | set(TORCH_INSTANCE_ATTRIBUTES) | {"_module_copies"})

# What to do instead, for the names that code outside torch is known to use.
ADVICE = {
    "_module_copies": "it held one replica per device in torch's old single-process "
                      "multi-device mode (removed in torch 1.12); use ddp.module",
    "logger": "it is torch's C++ logger; read ddp._get_ddp_logging_data() instead",
    "_register_fused_optim": "microddp does not run the optimizer inside backward; call "
                             "optimizer.step() after loss.backward()",
    "_set_sparse_metadata": "microddp finds sparse gradients by their modules (Embedding "
                            "or EmbeddingBag with sparse=True), as torch does without it",
    "_update_process_group": "wrap the module again with "
                             "DistributedDataParallel(module, process_group=new_group)",
    "_use_python_reducer": "it selects torch's reducer for compiled autograd; microddp has "
                           "one reducer",
}


def refusal(name: str, where: str = "DistributedDataParallel") -> RefusedAttribute:
    """The error for torch DDP attribute `name`, with what to do instead."""
    advice = ADVICE.get(name, "it is part of how torch's DDP works inside, which microddp "
                              "does differently; see the compatibility table in "
                              "docs/05-data-parallel.md, or use "
                              "torch.nn.parallel.DistributedDataParallel")
    return RefusedAttribute(f"{where}.{name} exists in PyTorch's DistributedDataParallel but "
                            f"not in microddp's: {advice}")
