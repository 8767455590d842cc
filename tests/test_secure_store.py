"""microddp's rendezvous store behind the job's secret (issue 51): the same answers as torch's
TCPStore, every stranger refused in one line, and none of them able to hold up the job."""

import os
import socket
import stat
import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from launch_helpers import microddp, write
from microddp import MicroDDPError
from microddp.world import secret as sec
from microddp.world import store_client, store_server
from microddp.world.rendezvous import bind
from microddp.world.store_client import AuthStore
from microddp.world.store_server import StoreServer

SECRET = "0123456789abcdef" * 4


@pytest.fixture
def server():
    srv = StoreServer(bind("127.0.0.1", 0), SECRET)
    yield srv
    srv.close()


def _client(srv, secret=SECRET, seconds=10):
    return AuthStore("127.0.0.1", srv.port, secret, timedelta(seconds=seconds))


def _script(store) -> list:
    """The same calls on any store, with what each returned."""
    out = []
    store.set("a", b"1")
    out.append(store.get("a"))
    out.append(store.add("n", 3))
    out.append(store.add("n", -5))
    out.append(store.get("n"))
    out.append(store.compare_set("c", "x", "y"))   # missing key, expected given: not set
    out.append(store.check(["c"]))
    out.append(store.compare_set("c", "", "y"))    # missing key, nothing expected: set
    out.append(store.compare_set("c", "z", "w"))   # wrong expectation: the current value
    out.append(store.compare_set("c", "y", "w"))
    store.append("p", b"ab")
    store.append("p", b"cd")
    out.append(store.get("p"))
    store.multi_set(["m1", "m2"], [b"x", b"y"])
    out.append(store.multi_get(["m1", "m2"]))
    out.append(store.check(["m1", "m2"]))
    out.append(store.check(["m1", "nope"]))
    out.append(store.delete_key("m1"))
    out.append(store.delete_key("m1"))
    store.wait(["a", "n"])
    with pytest.raises(dist.DistStoreError):
        store.wait(["never"], timedelta(milliseconds=200))
    return out


def test_the_same_answers_as_torchs_tcpstore(server):
    torch_store = dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False,
                                timeout=timedelta(seconds=10))
    ours = _client(server)
    assert _script(ours) == _script(torch_store)
    assert sorted(ours.list_keys()) == ["a", "c", "m2", "n", "p"]
    assert ours.num_keys() == 5


def test_a_clone_sees_the_same_keys(server):
    a = _client(server)
    a.set("k", b"v")
    assert a.clone().get("k") == b"v"


def test_many_hosts_without_a_secret_warn_in_one_line(monkeypatch, capsys):
    from microddp.launch import hosts

    monkeypatch.delenv(sec.SECRET_ENV, raising=False)
    monkeypatch.delenv(sec.SECRET_FILE_ENV, raising=False)
    hosts._warn_without_secret("10.0.0.1", 29400)
    monkeypatch.setenv(sec.SECRET_ENV, SECRET)
    hosts._warn_without_secret("10.0.0.1", 29400)
    assert capsys.readouterr().err.splitlines() == [
        "microddp run: warning: no job secret (MICRODDP_SECRET or MICRODDP_SECRET_FILE), so "
        "anyone who reaches 10.0.0.1:29400 can join this job's rendezvous; see docs/security.md"]


def test_the_calls_torch_does_not_forward_reach_the_store_beneath_its_prefixes(server):
    from microddp.world.store_client import python_store

    ours = _client(server)
    wrapped = dist.PrefixStore("b/", dist.PrefixStore("a/", ours))
    with pytest.raises(RuntimeError, match="pure virtual"):  # torch's trampoline lacks it
        wrapped.delete_key("k")
    assert python_store(wrapped) is ours and python_store(dist.HashStore()) is not ours
    wrapped.set("k", b"v")
    (key,) = ours.list_keys()  # torch's prefixes joined its way
    assert key.endswith("k") and python_store(wrapped).delete_key(key) and not wrapped.check(["k"])


def test_a_get_waits_for_the_key_another_client_sets(server):
    a, b = _client(server), _client(server)
    got = []
    t = threading.Thread(target=lambda: got.append(a.get("late")))
    t.start()
    b.set("late", b"here")
    t.join(timeout=10)
    assert got == [b"here"]


def test_a_wrong_secret_is_refused_in_one_line_before_any_key(server, capfd):
    _client(server).set("k", b"job's")
    with pytest.raises(MicroDDPError, match="refused this process: its job secret differs"):
        _client(server, secret="f" * 64)
    assert server.data == {b"k": b"job's"} and server.refused == 1
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "refused 127.0.0.1:" in err[0] and "job's secret" in err[0]


def test_an_impostor_server_is_not_handed_the_keys():
    impostor = StoreServer(bind("127.0.0.1", 0), "9" * 64)
    try:
        with pytest.raises(MicroDDPError, match="refused this process|does not know"):
            _client(impostor)
        assert impostor.data == {}
    finally:
        impostor.close()


def test_torchs_own_store_is_named_not_waited_on(monkeypatch):
    monkeypatch.setattr(store_client, "HANDSHAKE_TIMEOUT_S", 0.5)
    torch_store = dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False)
    with pytest.raises(MicroDDPError, match="did not greet with microddp's handshake"):
        AuthStore("127.0.0.1", torch_store.port, SECRET, timedelta(seconds=5))


def _hold(port: int, send: bytes) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port))
    if send:
        s.sendall(send)
    return s


def test_strangers_that_hold_their_connections_do_not_stall_the_job(server, monkeypatch):
    strangers = [_hold(server.port, b"") for _ in range(50)]                 # nothing
    strangers += [_hold(server.port, b"\x00" * 40) for _ in range(50)]      # half a reply
    strangers += [_hold(server.port, os.urandom(64))]                         # a wrong proof
    strangers += [_hold(server.port, os.urandom(1 << 16))]                   # garbage
    a, b = _client(server), _client(server)
    for i in range(100):
        a.set(f"k{i}", str(i))
        assert b.get(f"k{i}") == str(i).encode()
    # the job went on while 100 strangers still hold their connections (deadline: 10 s)
    assert (server.pending, server.refused) == (100, 2)
    assert sorted(server.data) == sorted(f"k{i}".encode() for i in range(100))
    for s in strangers:
        s.close()


def test_a_silent_stranger_is_closed_at_its_deadline_with_one_line(server, monkeypatch, capfd):
    monkeypatch.setattr(store_server, "HANDSHAKE_TIMEOUT_S", 0.5)
    s = _hold(server.port, b"")
    s.settimeout(30)
    greeting = b""
    while chunk := s.recv(1 << 10):  # greeted, then closed by the server
        greeting += chunk
    assert greeting.startswith(sec.MAGIC) and len(greeting) == len(sec.MAGIC) + sec.NONCE_LEN
    assert server.refused == 1
    lines = capfd.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "no complete handshake within 0.5 s" in lines[0]


def test_a_secret_file_must_be_private_and_long_enough(tmp_path):
    f = tmp_path / "secret"
    f.write_text(SECRET + "\n")
    f.chmod(0o644)
    with pytest.raises(MicroDDPError, match="can be read by others.*chmod 600"):
        sec.job_secret({sec.SECRET_FILE_ENV: str(f)})
    f.chmod(stat.S_IRUSR | stat.S_IWUSR)
    assert sec.job_secret({sec.SECRET_FILE_ENV: str(f)}) == SECRET
    with pytest.raises(MicroDDPError, match="has 5 characters"):
        sec.job_secret({sec.SECRET_ENV: "short"})
    assert sec.job_secret({}) is None


def test_the_handshake_proves_both_ways_and_never_sends_the_secret():
    nonce = os.urandom(sec.NONCE_LEN)
    reply, mine = sec.client_answer(SECRET, nonce)
    proof = sec.server_checks(SECRET, nonce, reply)
    assert proof is not None and sec.server_is_genuine(SECRET, nonce, mine, proof)
    assert SECRET.encode() not in reply + proof
    assert sec.server_checks("x" * 64, nonce, reply) is None        # another secret
    assert sec.server_checks(SECRET, os.urandom(32), reply) is None  # a replayed answer
    assert not sec.server_is_genuine(SECRET, nonce, mine, reply[32:])  # the client's own proof


def test_microddp_run_gives_each_job_its_own_secret_and_the_ranks_use_it(tmp_path):
    script = write(tmp_path, "who.py", """
        import hashlib, os
        from datetime import timedelta
        import torch
        import microddp as mdp
        from microddp.world.store_client import AuthStore
        from torch.distributed import distributed_c10d as c10d
        w = mdp.init()
        store = c10d._get_default_store()
        while hasattr(store, "underlying_store"):
            store = store.underlying_store
        t = torch.ones(1)
        mdp.comms.all_reduce(t)
        try:
            AuthStore("127.0.0.1", int(os.environ["MICRODDP_STORE_PORT"]), "w" * 64,
                      timedelta(seconds=5))
            stranger = "let in"
        except mdp.MicroDDPError:
            stranger = "refused"
        digest = hashlib.sha256(os.environ["MICRODDP_SECRET"].encode()).hexdigest()[:12]
        print(type(store).__name__, int(t.item()), stranger, digest)
        mdp.shutdown()
    """)
    digests = []
    for _ in range(2):
        out = microddp("run", "-n", "2", script)
        assert out.returncode == 0, out.stderr
        rows = sorted(line.split()[2:] for line in out.stdout.splitlines())
        assert [r[:3] for r in rows] == [["AuthStore", "2", "refused"]] * 2, out.stdout
        assert rows[0][3] == rows[1][3]  # one secret for the job's ranks
        digests.append(rows[0][3])
        assert out.stderr.count("refused 127.0.0.1:") == 2  # each rank's stranger, one line
    assert digests[0] != digests[1]  # and a new one for the next job


def test_a_plain_torch_script_under_microddp_run_still_runs(tmp_path):
    script = write(tmp_path, "plain.py", """
        import torch, torch.distributed as dist
        dist.init_process_group("gloo")
        t = torch.ones(1)
        dist.all_reduce(t)
        print(int(t.item()))
        dist.destroy_process_group()
    """)
    out = microddp("run", "-n", "2", script)
    assert out.returncode == 0, out.stderr
    assert sorted(out.stdout.splitlines()) == ["[rank 0] 2", "[rank 1] 2"]

