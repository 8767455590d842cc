"""Chapter 7, script 2: speedup, efficiency and the communication/computation ratio.

    python course/07_observability/scaling_laws.py

No measurement here: the alpha-beta cost model of `microddp predict`, so every number can be
checked by hand. A step is compute + DDP's bucket copies + the communication backward could
not hide. Strong scaling splits a fixed global batch over N ranks; weak scaling gives
every rank the same batch. Then: where does adding ranks stop paying, and why? Last, CPU
ranks sharing one host: past its cores, the host's CPU work is the limit instead.
"""

from microddp import predict

MODEL = predict.Model(params=110e6, flops_per_sample=6 * 110e6 * 512,
                      note="a BERT-base-sized model, 512 tokens per sample")
LINKS = {"NVLink": predict.HARDWARE["a100-nvlink"], "InfiniBand": predict.HARDWARE["a100-ib"],
         "10 GbE": predict.HARDWARE["10gbe"]}
WORLDS = [1, 2, 8, 64, 512]


def show(title: str, rows: list[dict]) -> None:
    print(title)
    print(f"{'N':>5} {'batch/rank':>10} {'compute ms':>11} {'copies ms':>9} {'comm ms':>9} "
          f"{'exposed ms':>10} {'comm/comp':>9} {'speedup':>8} {'efficiency':>10}")
    for r in rows:
        print(f"{r['world']:>5} {r['batch']:>10g} {1e3 * r['compute_s']:>11.2f} "
              f"{1e3 * r['copies_s']:>9.2f} {1e3 * r['comm_s']:>9.2f} "
              f"{1e3 * r['exposed_overlap_s']:>10.2f} "
              f"{r['comm_comp_ratio']:>9.3f} {r['speedup']:>8.2f} {100 * r['efficiency']:>9.1f}%")


def main() -> None:
    hw = LINKS["InfiniBand"]
    grad = MODEL.params * 4
    print(f"{MODEL.note}: {MODEL.params:.3g} parameters, {grad / 1e6:.0f} MB of fp32 gradients")
    print(f"ring all-reduce moves 2(N-1)/N x {grad / 1e6:.0f} MB per rank: "
          f"{2 * 7 / 8 * grad / 1e6:.0f} MB at N=8, {2 * 511 / 512 * grad / 1e6:.0f} MB at N=512")
    show("weak scaling, 16 samples per rank (InfiniBand):",
         predict.scaling(MODEL, hw, WORLDS, 16))
    show("strong scaling, global batch 512 (InfiniBand):",
         predict.scaling(MODEL, hw, WORLDS, 512, strong=True))
    print("step = compute + copies + exposed; speedup = throughput(N) / throughput(1); "
          "efficiency = speedup / N")
    for name, link in LINKS.items():
        rows = predict.scaling(MODEL, link, [1, 2, 4, 8, 16, 32, 64, 128, 256, 512], 16)
        print(f"{name:>10}: {predict.verdict(rows)}")


def shared_host() -> None:
    """Ranks on one CPU host: each computes at one core's rate while it runs, but beyond the
    cores they take turns, so the step is at least all ranks' CPU work over the cores. Waiting
    for messages is not CPU work: only the measured busy share of communication counts."""
    hw = predict.HARDWARE["cpu-loopback"]
    model = predict.fullmlp(512, 8)
    print(f"CPU ranks on one {hw.cores}-core host, {model.note}, 32 samples per rank, "
          f"communication {100 * hw.comm_cpu:.0f}% CPU-busy:")
    print(f"{'ranks':>5} {'one rank ms':>11} {'host CPU ms':>11} {'step ms':>8}  limit")
    for n in (2, 4, 8, 16, 32):
        r = predict.predict(model, hw, n, 32, local_ranks=n)
        limit = "host CPU" if r["cpu_bound_s"] > r["chain_s"] else "one rank"
        # Up to one rank per core nobody waits for a core: the bound does not apply ("-")
        host = f"{1e3 * r['cpu_bound_s']:.2f}" if n > hw.cores else "-"
        print(f"{n:>5} {1e3 * r['chain_s']:>11.2f} {host:>11} {1e3 * r['step_s']:>8.2f}  {limit}")


if __name__ == "__main__":
    main()
    shared_host()
