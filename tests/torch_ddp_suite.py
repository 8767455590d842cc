"""Run the DDP tests of the torch wheel's own distributed_test.py, with torch's DDP or with
microddp's class swapped in (issue 50). Nothing is copied: the tests are torch's, imported
from torch.testing._internal, and run by torch's own multi-process harness (a fresh process
per rank, gloo, a file:// rendezvous), as PyTorch's CI runs them.

    BACKEND=gloo WORLD_SIZE=2 MICRODDP_SWAP=1 python tests/torch_ddp_suite.py NAME [NAME ...]

prints one line per test: `NAME ok|FAIL|ERROR|skipped: reason`. MICRODDP_SWAP=1 replaces
`torch.nn.parallel.DistributedDataParallel` (what the tests build, as `nn.parallel.` and as
distributed_test's own import) with `microddp.DistributedDataParallel` in every rank: the
ranks re-import this module, so the swap is made at import. tests/test_torch_ddp_suite.py
runs it; `names()` is which tests count as DDP tests.
"""

from __future__ import annotations

import inspect
import os
import re
import sys
import tempfile
import unittest

os.environ.setdefault("BACKEND", "gloo")
os.environ.setdefault("WORLD_SIZE", "2")
if "TEMP_DIR" not in os.environ:  # torch's harness wants it before the import below
    os.environ["TEMP_DIR"] = tempfile.mkdtemp(prefix="torch_ddp_suite_")
    os.makedirs(os.path.join(os.environ["TEMP_DIR"], "barrier"), exist_ok=True)

import torch  # noqa: E402

if os.environ.get("MICRODDP_SWAP") == "1":
    import torch.testing._internal.distributed.distributed_test as _suite_module  # noqa: E402

    import microddp  # noqa: E402

    torch.nn.parallel.DistributedDataParallel = microddp.DistributedDataParallel
    _suite_module.DistributedDataParallel = microddp.DistributedDataParallel

from torch.testing._internal.distributed.distributed_test import (  # noqa: E402
    DistributedTest,
    TestDistBackend,
)


class TorchDDPSuite(TestDistBackend, DistributedTest._DistTestBase):
    """torch's distributed tests on this process's BACKEND and WORLD_SIZE."""

    def setUp(self):
        super().setUp()
        self._spawn_processes()


# Decorators that skip a test on a machine without GPUs or NCCL: such tests are not run here.
_NEEDS_GPU = re.compile(r"skip_if_lt_x_gpu|skip_if_no_gpu|require_n_gpus|requires_nccl\b|"
                        r"backend_feature\[\"gpu\"\]|BACKEND != \"nccl\"|"
                        r"BACKEND not in \(\"nccl\"|ddp_has_finalized")


def names() -> list[str]:
    """The DDP tests of distributed_test.py that can run on gloo without a GPU: a test whose
    name says DDP (ddp, DistributedDataParallel) or that builds one (directly or through the
    file's DDP helpers), and whose decorators ask for no GPU and no NCCL."""
    out = []
    for name, fn in inspect.getmembers(DistributedTest._DistTestBase, inspect.isfunction):
        if not name.startswith("test_"):
            continue
        try:
            source = inspect.getsource(inspect.unwrap(fn))
        except (OSError, TypeError):
            continue
        if not (re.search(r"ddp|DistributedDataParallel", name, re.I)
                or re.search(r"DistributedDataParallel\(|_test_DDP|_test_ddp", source)):
            continue
        decorators = source.split("def test_", 1)[0]
        if _NEEDS_GPU.search(decorators) or _NEEDS_GPU.search(name):
            continue
        out.append(name)
    return sorted(out)


def main(argv: list[str]) -> int:
    wanted = argv or names()
    suite = unittest.TestSuite(TorchDDPSuite(n) for n in wanted)
    result = unittest.TextTestRunner(stream=open(os.devnull, "w"), verbosity=0).run(suite)
    failed = {t._testMethodName: "FAIL" for t, _ in result.failures}
    failed |= {t._testMethodName: "ERROR" for t, _ in result.errors}
    skipped = {t._testMethodName: why for t, why in result.skipped}
    for name in wanted:
        if name in failed:
            print(f"{name} {failed[name]}")
        elif name in skipped:
            print(f"{name} skipped: {skipped[name].splitlines()[0][:100]}")
        else:
            print(f"{name} ok")
    for test, trace in result.failures + result.errors:
        print(f"--- {test._testMethodName}\n{trace[-1500:]}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    if argv := sys.argv[1:]:
        if argv == ["--list"]:
            print("\n".join(names()))
            raise SystemExit(0)
    raise SystemExit(main(sys.argv[1:]))
