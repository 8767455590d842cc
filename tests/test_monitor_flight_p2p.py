"""A pipeline's sends and receives and a parameter server's messages in the Flight Recorder
dumps (issue 52), read by torch's own analyser (torchfrtrace).

Two ranks run one GPipe step of a 2-stage pipeline (microddp's interpreter, its messages
through microddp.comms' isend/irecv) and exchange one parameter-server message (ps/protocol),
then one all-reduce; rank 1 then skips the next all-reduce. The dumps must list every
message as torch's recorder lists one (`gloo:send 0->1` on the sender, `gloo:recv 1<-0` on the
receiver, numbered by p2p_seq_id, completed, with a duration), the same messages on both sides,
and torchfrtrace must read them, pair them, and still name the skipped all-reduce and rank 1.
"""

import pickle

import torch
import torch.distributed as dist

import microddp as mdp
from microddp import monitor, pipeline
from microddp.monitor import flight
from microddp.ps import protocol
from test_monitor_flight import _frtrace, _wait_for_dump

STALL_S = 1.5
P2P = {"gloo:send", "gloo:recv"}
M = 4  # microbatches: 4 activations down, 4 gradients up


def _line(marker: str) -> int:
    with open(__file__) as f:
        return next(i for i, line in enumerate(f, 1) if line.rstrip().endswith(f"# {marker}"))


def _job(world, folder):
    flight.set_run_dir(folder)
    monitor.enable(timeout=STALL_S)
    torch.manual_seed(0)
    model = mdp.FullMLP(8, 4)
    schedule = pipeline.build("gpipe", 2, M)
    stages = pipeline.split_model(model, schedule.stages)
    mine = {s: stages[s] for s in schedule.stages_of(world.rank)}
    x, y = torch.randn(8, 8), torch.randint(0, 2, (8,))
    pipeline.run_schedule(schedule, mine, x, y, torch.nn.functional.cross_entropy)
    head = protocol.header(protocol.PARAMS, world.rank, 2, 3, 4)  # a server's parameters
    if world.rank == 0:
        protocol.send(head, 1, torch.ones(6))  # PS-SEND
    else:
        got, payload = protocol.recv(0, 6, timeout=30)
        assert got.tolist() == [protocol.PARAMS, 0, 2, 3, 4] and payload.tolist() == [1.0] * 6
    t = torch.ones(4)
    error = None
    try:
        dist.all_reduce(t)
        if world.rank == 0:
            dist.all_reduce(t)  # rank 1 skips it
    except mdp.MicroDDPError as e:
        error = str(e)
    return error, _wait_for_dump()


def test_pipeline_and_parameter_server_messages_in_the_dumps(tmp_path):
    res = mdp.spawn(_job, 2, args=(str(tmp_path),), timeout=120)
    folder = tmp_path / flight.FOLDER
    dumps = [pickle.loads((folder / f"fr_trace_rank_{r}").read_bytes()) for r in (0, 1)]
    skipped = dumps[0]["entries"][-1]["collective_seq_id"]  # the one rank 1 skipped
    assert f"all_reduce #{skipped}" in res[0][0]
    p2p = [[e for e in d["entries"] if e["is_p2p"]] for d in dumps]
    # rank 0 sends 4 activations and 2 PS messages and receives 4 gradients; rank 1 mirrors it
    names = [sorted({e["profiling_name"] for e in ranks}) for ranks in p2p]
    assert names == [["gloo:recv 0<-1", "gloo:send 0->1"], ["gloo:recv 1<-0", "gloo:send 1->0"]]
    counts = [{n: sum(e["profiling_name"] == n for e in ranks) for n in names[r]}
              for r, ranks in enumerate(p2p)]
    assert counts == [{"gloo:recv 0<-1": M, "gloo:send 0->1": M + 2},
                      {"gloo:recv 1<-0": M + 2, "gloo:send 1->0": M}]
    for ranks in p2p:
        # numbered 1, 2, ... per group, negated (flight.build says why)
        assert sorted(-e["p2p_seq_id"] for e in ranks) == list(range(1, 2 * M + 3))
        assert all(e["state"] == "completed" and e["duration_ms"] >= 0 for e in ranks)
        # all between the same two collectives: the pipeline's own check and the all-reduce
        assert {e["collective_seq_id"] for e in ranks} == {skipped - 2}
    # a message's sizes are the same on both ends, in order, per direction
    for a, b in ((0, 1), (1, 0)):
        sent = [e["input_sizes"] for e in p2p[a] if "send" in e["profiling_name"]]
        received = [e["output_sizes"] for e in p2p[b] if "recv" in e["profiling_name"]]
        assert sent == received and sent
    (ps_send,) = [e for e in p2p[0] if e["input_sizes"] == [[6]]]
    assert ps_send["input_dtypes"] == ["Float"]
    assert [(f["name"], f["line"]) for f in ps_send["frames"]][-1] == ("_job", _line("PS-SEND"))
    colls = [[(e["profiling_name"], e["state"]) for e in d["entries"] if not e["is_p2p"]]
             for d in dumps]
    assert colls[0][:-1] == colls[1] and colls[0][-1] == ("gloo:all_reduce", "started")
    text = _frtrace(folder, "-o", str(tmp_path / "db.pkl"))
    assert f"Not all ranks joining collective, sequence number: {skipped}" in text, text
    assert "missing ranks: {1}" in text
    assert "Traceback" not in text and "mismatch" not in text.lower(), text
    # the analyser's own database (-o): every message paired with its partner, none in error
    _, db = pickle.loads((tmp_path / "db.pkl").read_bytes())
    pairs = [c for c in db.collectives if c.collective_name.split(" ")[0] in P2P]
    assert len(pairs) == 2 * M + 2 and all(c.pass_check and not c.missing_ranks for c in pairs)
    assert sorted(-c.p2p_seq_id for c in pairs) == list(range(1, 2 * M + 3))
    (stuck,) = [c for c in db.collectives if c.missing_ranks]
    assert (stuck.collective_name, stuck.collective_seq_id, stuck.missing_ranks) == (
        "gloo:all_reduce", skipped, {1})
