"""Every way torch's `ProcessGroup` collectives can be called, turned into the one form the
`microddp` group works with: a list of tensors and an options object.

torch's C++ ProcessGroup has several overloads per collective (`pg.allreduce([t], opts)`,
`pg.allreduce([t], op)`, `pg.allreduce(t)`, `pg.broadcast(t, root)`, `pg.allgather(outs, t)`,
`pg.reduce_scatter(out, ins, op)`, `pg.barrier(timeout)`); a Python subclass that overrides a
method replaces all of them at once, so the subclass must accept each form itself. torch's
dispatch (`dist.all_reduce` & co.) always uses the first: lists and options. The options
classes come from torch's C extension: `dist.AllgatherOptions` is not exported in torch 2.13.
"""

from __future__ import annotations

from datetime import timedelta

import torch
from torch._C._distributed_c10d import (
    AllgatherOptions,
    AllreduceOptions,
    BarrierOptions,
    BroadcastOptions,
    ReduceScatterOptions,
)


def _listed(tensors) -> list:
    """A lone tensor as a list of one, as torch's single-tensor overloads do."""
    return [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)


def _timed(opts, timeout: timedelta | None):
    if timeout is not None:
        opts.timeout = timeout
    return opts


def allreduce(tensors, opts=None, op=None, timeout=None) -> tuple[list, AllreduceOptions]:
    """From allreduce(tensors, opts), allreduce(tensors, op, timeout), allreduce(tensor, op,
    timeout), with their keyword names."""
    if isinstance(opts, AllreduceOptions):
        return _listed(tensors), opts
    out = AllreduceOptions()
    op = opts if opts is not None else op
    if op is not None:
        out.reduceOp = op
    return _listed(tensors), _timed(out, timeout)


def broadcast(tensors, opts=None, root=None, timeout=None) -> tuple[list, BroadcastOptions]:
    """From broadcast(tensors, opts) and broadcast(tensor, root, timeout)."""
    if isinstance(opts, BroadcastOptions):
        return _listed(tensors), opts
    out = BroadcastOptions()
    root = opts if opts is not None else root
    out.rootRank, out.rootTensor = (0 if root is None else int(root)), 0
    return _listed(tensors), _timed(out, timeout)


def allgather(outputs, inputs, opts=None, timeout=None) -> tuple[list, list, AllgatherOptions]:
    """From allgather(output lists, inputs, opts) and allgather(outputs, input, timeout)."""
    if isinstance(inputs, torch.Tensor):  # the second form: one input, one list of outputs
        outputs, inputs = [list(outputs)], [inputs]
    if isinstance(opts, timedelta):
        opts, timeout = None, opts
    opts = opts if isinstance(opts, AllgatherOptions) else _timed(AllgatherOptions(), timeout)
    return [list(o) for o in outputs], list(inputs), opts


def reduce_scatter(outputs, inputs, opts=None, op=None, timeout=None
                   ) -> tuple[list, list, ReduceScatterOptions]:
    """From reduce_scatter(outputs, input lists, opts) and reduce_scatter(output, inputs, op,
    timeout)."""
    if isinstance(outputs, torch.Tensor):  # the second form: one output, one list of inputs
        outputs, inputs = [outputs], [list(inputs)]
    if isinstance(opts, ReduceScatterOptions):
        return list(outputs), [list(i) for i in inputs], opts
    out = ReduceScatterOptions()
    op = opts if opts is not None else op
    if op is not None:
        out.reduceOp = op
    return list(outputs), [list(i) for i in inputs], _timed(out, timeout)


def barrier(opts=None, timeout=None) -> BarrierOptions:
    """From barrier(opts) and barrier(timeout)."""
    if isinstance(opts, BarrierOptions):
        return opts
    return _timed(BarrierOptions(), opts if isinstance(opts, timedelta) else timeout)
