"""The client of microddp's store server: a `torch.distributed.Store` that proves the job's
secret on every connection before it reads or writes a key.

It is a subclass of torch's Store, so `init_process_group(store=...)`, gloo's and NCCL's
rendezvous, PrefixStore and `new_group` use it as they use a TCPStore. Each thread has its own
connection: a `get` that waits for a key (gloo's rendezvous, the hang monitor's reads) never holds
up another thread's call. The client checks the server's proof too, so a process that took the
address cannot collect the job's keys.
"""

from __future__ import annotations

import socket
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from ..errors import MicroDDPError
from . import secret as sec
from . import store_wire as wire

CONNECT_RETRY_S = 0.1
HANDSHAKE_TIMEOUT_S = 10.0


def _keys(keys) -> list[bytes]:
    return [k.encode() if isinstance(k, str) else bytes(k) for k in keys]


def _value(v) -> bytes:
    return v.encode() if isinstance(v, str) else bytes(v)


class AuthStore(dist.Store):
    """A key-value store at `host:port` served by store_server.StoreServer for `secret`."""

    def __init__(self, host: str, port: int, secret: str,
                 timeout: timedelta = timedelta(seconds=300)):
        super().__init__()
        self.host, self.port, self._secret = host, port, secret
        self._timeout = timeout
        self._local = threading.local()
        self._conns: list[socket.socket] = []
        self._clones: list[AuthStore] = []
        self._lock = threading.Lock()
        self._conn()  # fail here, in one line, if the server is missing or refuses us

    # -- the connection and its handshake -----------------------------------------------
    def _connect_once(self, left: float) -> socket.socket:
        s = socket.create_connection((self.host, self.port), timeout=max(0.1, left))
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.settimeout(HANDSHAKE_TIMEOUT_S)
        where = f"the rendezvous store at {self.host}:{self.port}"
        try:
            hello = wire.recv_exact(s, len(sec.MAGIC) + sec.NONCE_LEN)
        except (OSError, wire.WireError):
            s.close()
            raise MicroDDPError(f"{where} did not greet with microddp's handshake; is it "
                                "torch's own TCPStore (torchrun's)? Start the job with "
                                "`microddp run`, which serves a store that checks the job's "
                                "secret") from None
        if not hello.startswith(sec.MAGIC):
            s.close()
            raise MicroDDPError(f"{where} is not a microddp store (it answered {hello[:8]!r})")
        server_nonce = hello[len(sec.MAGIC):]
        reply, mine = sec.client_answer(self._secret, server_nonce)
        try:
            s.sendall(reply)
            proof = wire.recv_exact(s, sec.MAC_LEN)
        except (OSError, wire.WireError):
            s.close()
            raise MicroDDPError(f"{where} refused this process: its job secret differs "
                                f"(check that {sec.SECRET_ENV} or {sec.SECRET_FILE_ENV} gives "
                                "every host the same secret)") from None
        if not sec.server_is_genuine(self._secret, server_nonce, mine, proof):
            s.close()
            raise MicroDDPError(f"{where} does not know the job's secret: another process "
                                "holds the address; refusing to hand it the job's keys")
        s.settimeout(None)
        return s

    def _conn(self) -> socket.socket:
        s = getattr(self._local, "sock", None)
        if s is not None:
            return s
        deadline = time.monotonic() + self._timeout.total_seconds()
        while True:
            try:
                s = self._connect_once(deadline - time.monotonic())
                break
            except OSError as e:  # not up yet (refused, timed out): retried until the deadline
                if time.monotonic() >= deadline:
                    raise MicroDDPError(
                        f"could not reach the rendezvous store at {self.host}:{self.port} "
                        f"within {self._timeout.total_seconds():g} s ({e}); is rank 0 (or "
                        "`microddp run`) running with the same address and port?") from None
                time.sleep(CONNECT_RETRY_S)
        self._local.sock = s
        with self._lock:
            self._conns.append(s)
        return s

    def _call(self, op: int, fields: list[bytes]) -> list[bytes]:
        s = self._conn()
        wire.send_frame(s, op, fields)
        status, out = wire.recv_frame(s)
        if status == wire.TIMEOUT:
            missing = ", ".join(k.decode(errors="replace") for k in out)
            # torch raises DistStoreError (a RuntimeError) on a wait's timeout; callers catch it
            raise dist.DistStoreError(f"timed out waiting for keys: {missing}")
        if status != wire.OK:
            raise RuntimeError(b"".join(out).decode(errors="replace"))
        return out

    def _ms(self, timeout: timedelta | None = None) -> bytes:
        t = self._timeout if timeout is None else timeout
        return str(int(t.total_seconds() * 1000)).encode()

    # -- torch.distributed.Store ----------------------------------------------------------
    def set(self, key, value) -> None:
        """Set `key` to `value`."""
        self._call(wire.SET, [_value(key), _value(value)])

    def get(self, key) -> bytes:
        """The value of `key`, waiting for it up to the store's timeout."""
        return self._call(wire.GET, [self._ms(), _value(key)])[0]

    def add(self, key, value: int) -> int:
        """Add `value` to the number at `key` (0 if unset); the new number."""
        return int(self._call(wire.ADD, [_value(key), str(int(value)).encode()])[0])

    def compare_set(self, key, expected_value, desired_value) -> bytes:
        """Set `key` to `desired_value` if it holds `expected_value` (or is unset and
        `expected_value` is empty); the value it holds afterwards, as TCPStore answers."""
        return self._call(wire.CAS, [_value(key), _value(expected_value),
                                     _value(desired_value)])[0]

    def delete_key(self, key) -> bool:
        """Remove `key`; whether it was there."""
        return self._call(wire.DELETE, [_value(key)])[0] == b"1"

    def num_keys(self) -> int:
        """How many keys the store holds."""
        return int(self._call(wire.NUM_KEYS, [])[0])

    def check(self, keys) -> bool:
        """Whether every one of `keys` is set, without waiting."""
        return self._call(wire.CHECK, _keys(keys))[0] == b"1"

    def wait(self, keys, timeout: timedelta | None = None) -> None:
        """Wait until every one of `keys` is set; DistStoreError at the timeout."""
        self._call(wire.WAIT, [self._ms(timeout), *_keys(keys)])

    def multi_get(self, keys) -> list[bytes]:
        """The values of `keys`, waiting for all of them."""
        return self._call(wire.MULTI_GET, [self._ms(), *_keys(keys)])

    def multi_set(self, keys, values) -> None:
        """Set each of `keys` to its value, at once."""
        pairs = [b for k, v in zip(_keys(keys), values, strict=True) for b in (k, _value(v))]
        self._call(wire.MULTI_SET, pairs)

    def append(self, key, value) -> None:
        """Append `value` to the bytes at `key` (set it if unset)."""
        self._call(wire.APPEND, [_value(key), _value(value)])

    def list_keys(self) -> list[str]:
        """Every key the store holds."""
        return [k.decode() for k in self._call(wire.LIST, [])]

    def clone(self) -> AuthStore:
        """Another client of the same store, with connections of its own (kept alive with this
        one: torch holds a Python store only through C++)."""
        twin = AuthStore(self.host, self.port, self._secret, self._timeout)
        self._clones.append(twin)
        return twin

    def has_extended_api(self) -> bool:
        """Yes: multi_get, multi_set, append and list_keys are here."""
        return True

    def set_timeout(self, timeout: timedelta) -> None:
        """How long a get or wait waits from now on."""
        self._timeout = timeout

    @property
    def timeout(self) -> timedelta:
        """How long a get or wait waits."""
        return self._timeout

    def close(self) -> None:
        """Close every thread's connection to the server."""
        with self._lock:
            for s in self._conns:
                s.close()
            self._conns.clear()
        self._local = threading.local()


def python_store(store: dist.Store) -> dist.Store:
    """The AuthStore beneath torch's PrefixStores around it, else `store` itself.

    torch forwards only some calls from its C++ stores to a Python one (delete_key and num_keys
    fail through a PrefixStore with "pure virtual function"); a caller that needs every call and
    keys of its own (the hang monitor's, under microddp/monitor/) talks to the store directly.
    """
    inner = store
    while isinstance(inner, dist.PrefixStore):
        inner = inner.underlying_store
    return inner if isinstance(inner, AuthStore) else store
