"""The `microddp predict` command: arguments, presets, and the printed table.

The model itself, and what it assumes, is in predict.py (its docstring is this command's
--help description).
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import replace
from pathlib import Path

from ..errors import MicroDDPError
from ..pipeline import BUILDERS as PIPELINE_SCHEDULES
from ..predict import step as _model_module
from ..predict.step import (
    ALGORITHMS,
    HARDWARE,
    MODELS,
    Hardware,
    Model,
    across_hosts,
    fullmlp,
    load_calibration,
    scaling,
    table,
    verdict,
)

__doc__ = _model_module.__doc__  # what `microddp predict --help` describes

EPILOG = """\
examples:
  microddp predict --model bert-large --hardware a100-ib --batch 32
  microddp predict --params 1.5e9 --tokens 2048 --hardware h100-ib --world 8 64 512 4096
  microddp predict --model resnet50 --hardware 10gbe --algorithm tree --no-overlap
  microddp predict --calibrate                 # measure this host, then predict FullMLP on it
  microddp predict --calibrate --verify 2 4    # ... and compare with measured step times
  microddp predict --stages 4 --microbatches 8 --dim 128 --depth 16 --batch 64 --hardware cpu-loopback
  microddp predict --compare docs/measured/pipeline-sleep.json   # a `bench pipeline` run
  microddp predict --zero --params 7.5e9 --world 64  # ZeRO paper, Fig. 1: GB per rank
  microddp predict --hosts 2 --local-ranks 2 --hardware cpu-loopback --inter-hardware 10gbe
                                               # flat vs hierarchical all-reduce across hosts
  microddp predict --mesh-world 64 --dim 2048 --depth 24 --heads 16 --seq 1024 --batch 512
                                               # every dp x pp x tp mesh of a GPT, ranked
  microddp predict --tp 2 --pp 2 --dim 32 --depth 2 --heads 4 --seq 32 --batch 16 --hardware cpu-loopback
  microddp predict --cp 2 --tp 2 --dim 32 --depth 2 --heads 4 --seq 32 --batch 16 --hardware cpu-loopback
a sample is one input of --batch: a preset's tokens per sample are in its note (--list); with
--params, one token unless --tokens or --flops-per-sample says otherwise.
presets are assumptions, not measurements: override any figure with --flops, --bandwidth,
--latency; list them with --list.
"""


MAX_PARAMS = 1e16  # 10,000x the largest models trained so far; beyond it the table is noise


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of `microddp predict`: model, hardware, world sizes, batch, overlap."""
    p.add_argument("--model", choices=sorted(MODELS),
                   help="a model preset (default: FullMLP of --dim and --depth)")
    p.add_argument("--params", type=float, help="parameter count (instead of --model); a sample "
                   "is then one token (6 x params FLOPs) unless --tokens or --flops-per-sample "
                   "says otherwise (default: --model, else FullMLP)")
    p.add_argument("--tokens", type=float, help="with --params: tokens per sample (sequence "
                   "length), so a sample costs 6 x params x tokens FLOPs (default 1)")
    p.add_argument("--flops-per-sample", type=float, help="with --params: training FLOPs per "
                   "sample (default 6 x params x tokens)")
    p.add_argument("--dim", type=int, default=512,
                   help="FullMLP width when no model is given (default 512)")
    p.add_argument("--depth", type=int, default=8,
                   help="FullMLP depth when no model is given (default 8)")
    p.add_argument("--hardware", default=None, help="hardware preset (see --list) or "
                   "'calibrated' for the figures saved by --calibrate (default a100-ib; with "
                   "--calibrate, calibrated)")
    p.add_argument("--flops", type=float, help="sustained FLOP/s per device (default: the "
                   "preset's)")
    p.add_argument("--bandwidth", type=float, help="link bytes/s per device, 1/beta (default: "
                   "the preset's)")
    p.add_argument("--latency", type=float, help="seconds per message, alpha (default: the "
                   "preset's)")
    p.add_argument("--memory", type=float, help="memory bytes/s (default: the preset's)")
    p.add_argument("--batch", type=float, default=32, help="samples per rank (weak scaling) "
                   "or global batch with --strong (default 32)")
    p.add_argument("--strong", action="store_true", help="fixed global batch (strong scaling)")
    p.add_argument("--world", type=int, nargs="+", help="world sizes (default 1, 2, 4 .. 4096)")
    p.add_argument("--algorithm", choices=ALGORITHMS, default=None,
                   help="all-reduce algorithm; shm: through shared memory, ranks of one host "
                   "(default ring; with --hardware calibrated, the one measured)")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="bucket size in MB (default 25)")
    p.add_argument("--grad-bytes", type=int, default=4, help="bytes per gradient value (4 fp32, "
                   "2 bf16; default 4)")
    p.add_argument("--no-overlap", action="store_true", help="all-reduce after backward only")
    p.add_argument("--local-ranks", type=int, default=1, help="ranks sharing one host's compute "
                   "(default 1)")
    p.add_argument("--hosts", type=int, default=None,
                   help="instead of a step: flat vs hierarchical all-reduce over this many hosts "
                        "of --local-ranks ranks, --hardware inside a host, --inter-hardware "
                        "between hosts (default: none, predict a step)")
    p.add_argument("--inter-hardware", default="10gbe",
                   help="with --hosts: the link between hosts, a preset (default 10gbe)")
    p.add_argument("--calibrate", action="store_true", help="measure this host's compute rate, "
                   "latency and bandwidth, and what a pipeline's actions and messages cost "
                   "(one rank per core, three rounds: a minute or more), save them to "
                   "--calibration, then predict with them")
    p.add_argument("--verify", type=int, nargs="*", help="with --calibrate: measure real step "
                   "times at these local world sizes and compare (default: none)")
    p.add_argument("--calibration", default=str(Path.home() / ".cache/microddp/calibration.json"),
                   metavar="FILE", help="where --calibrate saves its figures and --hardware "
                   "calibrated reads them (default ~/.cache/microddp/calibration.json)")
    p.add_argument("--list", action="store_true", help="list the presets and exit")
    pp = p.add_argument_group("pipelines (instead of data parallelism)")
    pp.add_argument("--stages", type=int, help="predict a pipeline of this many ranks "
                    "(default: none, predict data parallelism); --batch is then one step's")
    pp.add_argument("--microbatches", type=int, default=8, help="micro-batches per step "
                    "(default 8)")
    pp.add_argument("--schedules", nargs="+", default=list(PIPELINE_SCHEDULES),
                    help=f"schedules (default {' '.join(PIPELINE_SCHEDULES)})")
    pp.add_argument("--virtual", type=int, default=2, help="stages per rank when interleaved "
                    "(default 2)")
    pp.add_argument("--sleep-ms", type=float, help="add this sleep per block forward (2x "
                    "backward), as `bench pipeline --compute sleep` (default: none)")
    pp.add_argument("--compare", metavar="FILE", help="a pipeline.json of `microddp bench "
                    "pipeline`: predict its job and print its measurements beside (default: "
                    "none; hardware: calibrated if saved, else cpu-loopback)")
    mg = p.add_argument_group("a GPT on a dp x pp x tp mesh (--batch is the global batch)")
    mg.add_argument("--tp", type=int, help="tensor-parallel ranks per stage (default 1 with --pp or --dp)")
    mg.add_argument("--pp", type=int, help="pipeline stages (default 1 with --tp or --dp)")
    mg.add_argument("--dp", type=int, help="data-parallel replicas (default 1)")
    mg.add_argument("--cp", type=int, help="context-parallel ranks (ring attention) per replica, "
                    "pp 1 (default 1; --mesh-world ranks cp meshes too)")
    mg.add_argument("--mesh-world", type=int, help="rank every mesh of this many ranks (default: none; one mesh from --tp/--pp/--dp)")
    mg.add_argument("--heads", type=int, default=8, help="attention heads (default 8)")
    mg.add_argument("--seq", type=int, default=1024, help="tokens per sequence (default 1024)")
    mg.add_argument("--vocab", type=int, default=256, help="vocabulary (default 256: bytes)")
    mg.add_argument("--per-host", type=int, default=8,
                    help="ranks per host: a group wider than this crosses --inter-hardware "
                    "(default 8)")
    mg.add_argument("--device-memory", type=float,
                    help="GiB per device: meshes that need more rank last (default: no limit)")
    zm = p.add_argument_group("memory")
    zm.add_argument("--zero", action="store_true", help="print the model state per rank of "
                    "plain DP and ZeRO-1/2/3 for --params (or the model) on each --world "
                    "(default world 64)")
    zm.add_argument("--zero-bytes", choices=("mixed", "fp32"), default="mixed",
                    help="bytes per parameter: mixed = 2 + 2 + 12 (the ZeRO paper's mixed "
                    "precision Adam), fp32 = 4 + 4 + 8 (default mixed)")


def _mesh(args: argparse.Namespace) -> int:
    """--tp/--pp (one mesh) or --mesh-world N (every mesh of N ranks, ranked) for a GPT."""
    from ..predict import mesh3d

    if args.cp is not None and args.cp < 1:
        raise MicroDDPError(f"--cp must be at least 1, got {args.cp}")
    for name in ("dim", "depth", "heads", "seq", "vocab", "microbatches", "per_host"):
        if getattr(args, name) < 1:
            raise MicroDDPError(f"--{name.replace('_', '-')} must be at least 1, got "
                                f"{getattr(args, name)}")
    if args.inter_hardware not in HARDWARE:
        raise MicroDDPError(f"unknown --inter-hardware {args.inter_hardware!r}; choose one of "
                            f"{', '.join(HARDWARE)}")
    if args.dim % args.heads:
        raise MicroDDPError(f"--dim {args.dim} must divide by --heads {args.heads}")
    args.hardware = args.hardware or "a100-nvlink"
    hw, inter = _hardware(args), HARDWARE[args.inter_hardware]
    shape = mesh3d.GPTShape(args.dim, args.depth, args.heads, args.seq, args.vocab,
                            int(args.batch))
    kw = {"microbatches": args.microbatches, "per_host": args.per_host, "inter": inter}
    if args.mesh_world is not None:
        if args.mesh_world < 1:
            raise MicroDDPError(f"--mesh-world must be at least 1, got {args.mesh_world}")
        capacity = None if args.device_memory is None else args.device_memory * 2**30
        rows = mesh3d.rank(shape, args.mesh_world, hw, capacity, **kw, with_cp=True)
    else:
        tp, pp = args.tp or 1, args.pp or 1
        dp = args.dp or 1
        rows = [mesh3d.predict_mesh(shape, dp, pp, tp, hw, **kw, cp=args.cp or 1)]
    print(f"GPT: d_model {args.dim}, {args.depth} blocks, {args.heads} heads, seq {args.seq}, "
          f"vocab {args.vocab}: {shape.params:.3g} parameters; global batch {shape.batch}, "
          f"{args.microbatches} micro-batches per pipeline; {args.per_host} ranks per host")
    print(f"inside a host: {hw.note} ({hw.bandwidth:.3g} B/s, {1e6 * hw.latency:.0f} us); "
          f"between hosts: {inter.note} ({inter.bandwidth:.3g} B/s)")
    print(mesh3d.table(rows))
    return 0


def _across_hosts(args: argparse.Namespace, hw: Hardware) -> None:
    """Flat vs hierarchical all-reduce, --hosts hosts of --local-ranks ranks each."""
    if args.hosts < 1 or args.local_ranks < 1:
        raise MicroDDPError(f"--hosts and --local-ranks must be at least 1, got {args.hosts} "
                            f"and {args.local_ranks}")
    if args.inter_hardware not in HARDWARE:
        raise MicroDDPError(f"unknown --inter-hardware {args.inter_hardware!r}; choose one of "
                            f"{', '.join(HARDWARE)}")
    inter = HARDWARE[args.inter_hardware]
    print(f"all-reduce over {args.hosts} hosts x {args.local_ranks} ranks; inside a host: "
          f"{hw.note} ({hw.bandwidth:.3g} B/s, {1e6 * hw.latency:.0f} us); between hosts: "
          f"{inter.note} ({inter.bandwidth:.3g} B/s, {1e6 * inter.latency:.0f} us)")
    print(f"{'bytes':>10} {'flat ms':>9} {'hier ms':>9} {'flat/hier':>9}")
    for nbytes in (4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20):
        t = across_hosts(nbytes, args.hosts, args.local_ranks, hw, inter)
        print(f"{nbytes:>10} {1e3 * t['flat_s']:>9.3f} {1e3 * t['hierarchical_s']:>9.3f} "
              f"{t['flat_s'] / t['hierarchical_s']:>9.2f}")


def _hardware(args: argparse.Namespace) -> Hardware:
    if args.hardware == "calibrated":
        try:
            hw, _ = load_calibration(args.calibration)
        except FileNotFoundError:
            raise MicroDDPError(f"no calibration at {args.calibration}; run "
                                "`microddp predict --calibrate` first") from None
    elif args.hardware in HARDWARE:
        hw = HARDWARE[args.hardware]
    else:
        raise MicroDDPError(f"unknown hardware {args.hardware!r}; choose one of "
                            f"{', '.join(HARDWARE)} or 'calibrated'")
    for name in ("flops", "bandwidth", "latency", "memory"):
        v = getattr(args, name)
        if v is not None:
            if not 0 < v < math.inf:
                raise MicroDDPError(f"--{name} must be positive, got {v}")
            hw = replace(hw, **{name: v}, note=hw.note + f" ({name} overridden)")
    if args.flops is not None:  # the stated rate is the rate: a measured cap would hide it
        hw = replace(hw, rank_flops=0.0)
    return hw


def _model(args: argparse.Namespace) -> Model:
    if args.params is None:
        if args.tokens is not None or args.flops_per_sample is not None:
            raise MicroDDPError("--tokens and --flops-per-sample describe a --params model; a "
                                "preset or FullMLP already knows its FLOPs per sample")
    else:
        if not 0 < args.params < math.inf:
            raise MicroDDPError(f"--params must be positive, got {args.params:g}")
        if args.params > MAX_PARAMS:
            raise MicroDDPError(f"--params {args.params:g} is beyond any model the table can "
                                f"show (at most {MAX_PARAMS:g})")
        if args.tokens is not None and args.flops_per_sample is not None:
            raise MicroDDPError("give --tokens or --flops-per-sample, not both")
        for name in ("tokens", "flops_per_sample"):
            v = getattr(args, name)
            if v is not None and not 0 < v < math.inf:
                raise MicroDDPError(f"--{name.replace('_', '-')} must be positive, "
                                    f"got {v:g}")
        if args.flops_per_sample is not None:
            return Model(args.params, args.flops_per_sample, "custom, FLOPs per sample as given")
        # Without --tokens a sample is one token: say so, since it is easy to forget
        tokens = args.tokens or 1.0
        note = (f"custom, {tokens:g} tokens per sample" if args.tokens is not None else
                "custom, a sample is ONE token (give --tokens for sequences)")
        return Model(args.params, 6 * args.params * tokens, note)
    if args.model:
        return MODELS[args.model]
    return fullmlp(args.dim, args.depth)


def _pipeline(args: argparse.Namespace) -> int:
    from ..predict import pipeline as pp

    measured = None
    if args.compare is not None:
        try:
            measured = json.loads(Path(args.compare).read_text())
        except (OSError, ValueError) as e:
            raise MicroDDPError(f"cannot read {args.compare} ({e}); pass the pipeline.json "
                                "that `microddp bench pipeline` wrote") from None
        job = pp.from_bench(measured)
        names = [n for n in PIPELINE_SCHEDULES if n in measured]
        if args.hardware is None:
            saved = Path(args.calibration).is_file()
            args.hardware = "calibrated" if saved else "cpu-loopback"
            if not saved:  # a preset is another machine: its errors say nothing about this one
                print(f"note: no calibration of this host at {args.calibration}; predicting "
                      "with the cpu-loopback preset (an 8-core host), not the host the "
                      "benchmark ran on: run `microddp predict --calibrate` first")
    else:
        for name in ("stages", "microbatches", "virtual", "dim", "depth"):
            if getattr(args, name) < 1:
                raise MicroDDPError(f"--{name} must be at least 1, got {getattr(args, name)}")
        if args.sleep_ms is not None and not args.sleep_ms > 0:
            raise MicroDDPError(f"--sleep-ms must be positive, got {args.sleep_ms}")
        job = pp.PipelineJob(args.stages, args.microbatches, args.dim, args.depth,
                             int(args.batch), args.virtual, args.sleep_ms)
        names = args.schedules
    args.hardware = args.hardware or "a100-ib"
    hw = _hardware(args)
    costs = None
    if args.hardware == "calibrated":
        saved = load_calibration(args.calibration)[1]
        if saved is None:
            print(f"note: {args.calibration} has no pipeline costs (an older calibration): "
                  "predicting from FLOPs alone; run `microddp predict --calibrate` again")
        else:
            try:
                costs = pp.PipelineCosts(**saved)
            except TypeError:  # written by another version of microddp
                raise MicroDDPError(f"{args.calibration}: its pipeline costs are not the ones this "
                                    "microddp reads; run `microddp predict --calibrate` "
                                    "again") from None
    rows = [pp.predict(job, name, hw, costs) for name in names]
    print(pp.describe(job, hw, costs))
    print(pp.table(job, rows, measured))
    if measured is not None:
        la = measured["config"].get("load_average")
        print(f"measured: {args.compare} (compute {measured['config']['compute']}, load average "
              f"{la}); error = (predicted - measured) / measured step time")
    return 0


def _zero(args: argparse.Namespace) -> int:
    from ..predict import memory

    params = _model(args).params
    b = memory.MIXED_ADAM if args.zero_bytes == "mixed" else memory.FP32_ADAM
    for world in args.world or [64]:
        print(memory.table(params, world, b))
    return 0


def run(args: argparse.Namespace) -> int:
    """List presets, calibrate, or print the predicted step time per world size; the exit code."""
    if args.zero:
        return _zero(args)
    if any(v is not None for v in (args.tp, args.pp, args.dp, args.cp, args.mesh_world)):
        return _mesh(args)
    if args.stages is not None or args.compare is not None:
        return _pipeline(args)
    if args.list:
        for name, hw in HARDWARE.items():
            print(f"{name:13} {hw.flops:9.3g} FLOP/s {hw.bandwidth:9.3g} B/s "
                  f"{1e6 * hw.latency:5.0f} us {hw.memory:9.3g} B/s memory  {hw.note}")
        for name, m in MODELS.items():
            print(f"{name:13} {m.params:9.3g} params {m.flops_per_sample:9.3g} FLOP/sample  "
                  f"{m.note}")
        return 0
    if args.calibrate:
        if args.hardware not in (None, "calibrated"):
            raise MicroDDPError(f"--calibrate predicts with the figures it measures here; drop "
                                f"--hardware {args.hardware} (or drop --calibrate)")
        from ..predict.calibrate import calibrate_and_verify

        calibrate_and_verify(args)
        args.hardware = "calibrated"  # then predict, on the figures just measured
        print()
    elif args.verify is not None:
        raise MicroDDPError("--verify needs --calibrate")
    args.hardware = args.hardware or "a100-ib"
    if args.hosts is not None:
        _across_hosts(args, _hardware(args))
        return 0
    if not 0 < args.bucket_mb < math.inf:
        raise MicroDDPError(f"--bucket-mb must be positive, got {args.bucket_mb:g}")
    if args.local_ranks < 1 or args.grad_bytes < 1:
        raise MicroDDPError(f"--local-ranks and --grad-bytes must be at least 1, got "
                            f"{args.local_ranks} and {args.grad_bytes}")
    if not 0 < args.batch < math.inf:
        raise MicroDDPError(f"--batch must be positive, got {args.batch:g}")
    model, hw = _model(args), _hardware(args)
    args.algorithm = args.algorithm or hw.algorithm or "ring"
    worlds = args.world or [2**i for i in range(13)]
    if any(n < 1 for n in worlds):
        raise MicroDDPError(f"world sizes must be at least 1, got {worlds}")
    rows = scaling(model, hw, sorted(set(worlds)), args.batch, args.strong,
                   algorithm=args.algorithm, bucket_mb=args.bucket_mb, grad_bytes=args.grad_bytes,
                   overlap=not args.no_overlap, local_ranks=args.local_ranks)
    kind = "strong scaling, global batch" if args.strong else "weak scaling, batch per rank"
    print(f"model: {model.note}, {model.params:.3g} parameters, {model.flops_per_sample:.3g} "
          f"FLOP/sample; {kind} {args.batch:g}")
    alone = f" ({hw.rank_flops:.3g} for one rank alone)" if hw.rank_flops else ""
    print(f"assumed hardware: {hw.note}: {hw.flops:.3g} FLOP/s{alone}, bandwidth {hw.bandwidth:.3g} B/s "
          f"(1/beta), latency {1e6 * hw.latency:.0f} us per message (alpha); {args.algorithm} "
          f"all-reduce, buckets of {args.bucket_mb:g} MB, "
          f"{'no ' if args.no_overlap else ''}overlap")
    print("times in ms per step; exp. = exposed communication without / with overlap")
    print(table(rows))
    print(verdict(rows))
    return 0
