"""microddp's rendezvous store server: torch's key-value store semantics behind the job's secret.

PyTorch's TCPStore lets any client that reaches its port read and write every key (its
SECURITY.md says to run on a trusted network, and it has no hook for authentication). This
server keeps the same operations (set, get that waits, add, compare_set, wait, ...) but lets a
connection use them only after the handshake of secret.py. A stranger cannot stall it:
connections are accepted and handshaken by one thread that never blocks on a socket
(a selector, with a deadline per connection and a fixed number of bytes to read), so garbage,
half a handshake, or silence costs nothing but a descriptor until the deadline closes it with one
line on stderr. Only a connection that proved the secret gets a thread of its own.
"""

from __future__ import annotations

import os
import selectors
import socket
import sys
import threading
import time

from . import secret as sec
from . import store_wire as wire

HANDSHAKE_TIMEOUT_S = 10.0
MAX_PENDING = 4096  # connections still in their handshake; beyond it the oldest is dropped
_REPLY_LEN = sec.NONCE_LEN + sec.MAC_LEN


def _peer(sock: socket.socket) -> str:
    try:
        host, port = sock.getpeername()[:2]
        return f"{host}:{port}"
    except OSError:
        return "an unknown address"


class _Pending:
    """A connection in its handshake: the nonce it was sent, what it has replied so far."""

    def __init__(self, sock: socket.socket, nonce: bytes):
        self.sock, self.nonce, self.reply = sock, nonce, b""
        self.deadline = time.monotonic() + HANDSHAKE_TIMEOUT_S
        self.peer = _peer(sock)


class StoreServer:
    """Serves one job's keys on the listening socket `sock` to clients that know `secret`."""

    def __init__(self, sock: socket.socket, secret: str, name: str = "microddp store"):
        self.sock, self.secret, self.name = sock, secret, name
        self.port = sock.getsockname()[1]
        self.data: dict[bytes, bytes] = {}
        self.changed = threading.Condition()
        self.refused = 0  # connections turned away: tests and the log read it
        self.pending = 0  # connections in their handshake now
        self._stop_r, self._stop_w = os.pipe()
        self._clients: set[socket.socket] = set()
        self._closed = False
        sock.setblocking(False)
        self._thread = threading.Thread(target=self._accept_loop, name=name, daemon=True)
        self._thread.start()

    # -- the handshake thread -------------------------------------------------------------
    def _refuse(self, p: _Pending, why: str) -> None:
        self.refused += 1
        print(f"{self.name} on port {self.port}: refused {p.peer} ({why})", file=sys.stderr,
              flush=True)
        p.sock.close()

    def _accept_loop(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self.sock, selectors.EVENT_READ, None)
        sel.register(self._stop_r, selectors.EVENT_READ, "stop")
        pending: dict[socket.socket, _Pending] = {}
        try:
            while True:
                now = time.monotonic()
                soonest = min((p.deadline for p in pending.values()), default=now + 1.0)
                for key, _ in sel.select(max(0.0, soonest - now)):
                    if key.data == "stop":
                        return
                    if key.data is None:
                        self._accept(sel, pending)
                    else:
                        self._read_reply(sel, pending, key.data)
                now = time.monotonic()
                for p in [p for p in pending.values() if p.deadline <= now]:
                    sel.unregister(p.sock)
                    del pending[p.sock]
                    self._refuse(p, "no complete handshake within "
                                    f"{HANDSHAKE_TIMEOUT_S:g} s")
                self.pending = len(pending)
        finally:
            for p in pending.values():
                p.sock.close()
            sel.close()

    def _accept(self, sel: selectors.BaseSelector, pending: dict) -> None:
        try:
            conn, _ = self.sock.accept()
        except (BlockingIOError, InterruptedError, ConnectionAbortedError):
            return
        conn.setblocking(False)
        nonce = os.urandom(sec.NONCE_LEN)
        try:
            conn.send(sec.MAGIC + nonce)  # a few dozen bytes: always fits the empty buffer
        except OSError:
            conn.close()
            return
        if len(pending) >= MAX_PENDING:  # a flood: the oldest waiter is the likeliest stranger
            oldest = min(pending.values(), key=lambda q: q.deadline)
            sel.unregister(oldest.sock)
            del pending[oldest.sock]
            self._refuse(oldest, f"over {MAX_PENDING} connections in their handshake")
        p = _Pending(conn, nonce)
        pending[conn] = p
        sel.register(conn, selectors.EVENT_READ, p)

    def _read_reply(self, sel: selectors.BaseSelector, pending: dict, p: _Pending) -> None:
        try:
            chunk = p.sock.recv(_REPLY_LEN - len(p.reply))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        if chunk:
            p.reply += chunk
            if len(p.reply) < _REPLY_LEN:
                return
        sel.unregister(p.sock)
        del pending[p.sock]
        if not chunk:
            self._refuse(p, "closed during the handshake")
            return
        proof = sec.server_checks(self.secret, p.nonce, p.reply)
        if proof is None:
            self._refuse(p, "it does not prove the job's secret")
            return
        p.sock.setblocking(True)
        try:
            p.sock.sendall(proof)
        except OSError:
            p.sock.close()
            return
        self._clients.add(p.sock)
        threading.Thread(target=self._serve, args=(p.sock,), daemon=True,
                         name=f"{self.name} client").start()

    # -- one thread per client that proved the secret ---------------------------------------
    def _serve(self, conn: socket.socket) -> None:
        try:
            while True:
                op, fields = wire.recv_frame(conn)
                try:
                    status, out = self._do(op, fields)
                except (ValueError, IndexError) as e:  # a malformed request: say so, go on
                    status, out = wire.BAD, [str(e).encode()]
                wire.send_frame(conn, status, out)
        except (OSError, wire.WireError):
            pass  # the client went away (or broke the format: it proved the secret, so a bug)
        finally:
            self._clients.discard(conn)
            conn.close()

    def _wait_for(self, keys: list[bytes], timeout_ms: int) -> bool:
        end = None if timeout_ms <= 0 else time.monotonic() + timeout_ms / 1000
        with self.changed:
            while not all(k in self.data for k in keys):
                left = None if end is None else end - time.monotonic()
                if self._closed or (left is not None and left <= 0):
                    return False
                self.changed.wait(left if left is not None else 1.0)
        return True

    def _do(self, op: int, f: list[bytes]) -> tuple[int, list[bytes]]:
        d, out = self.data, []
        if op in (wire.GET, wire.WAIT, wire.MULTI_GET):
            keys = f[1:]
            if not self._wait_for(keys, int(f[0])):
                return wire.TIMEOUT, [k for k in keys if k not in d]
            with self.changed:
                return wire.OK, ([] if op == wire.WAIT else [d[k] for k in keys])
        with self.changed:
            if op == wire.SET:
                d[f[0]] = f[1]
            elif op == wire.MULTI_SET:
                d.update(zip(f[0::2], f[1::2], strict=True))
            elif op == wire.APPEND:
                d[f[0]] = d.get(f[0], b"") + f[1]
            elif op == wire.ADD:
                d[f[0]] = str(int(d.get(f[0], b"0")) + int(f[1])).encode()
                out = [d[f[0]]]
            elif op == wire.CAS:
                key, expected, desired = f
                if (key not in d and expected == b"") or d.get(key) == expected:
                    d[key] = desired
                out = [d.get(key, expected)]
            elif op == wire.DELETE:
                out = [b"1" if d.pop(f[0], None) is not None else b"0"]
            elif op == wire.NUM_KEYS:
                out = [str(len(d)).encode()]
            elif op == wire.CHECK:
                out = [b"1" if all(k in d for k in f) else b"0"]
            elif op == wire.LIST:
                out = list(d)
            else:
                return wire.BAD, [f"unknown operation {op}".encode()]
            self.changed.notify_all()
        return wire.OK, out

    def close(self) -> None:
        """Stop accepting, end every client's connection, release the port."""
        if self._closed:
            return
        self._closed = True
        os.write(self._stop_w, b"x")
        self._thread.join(timeout=5)
        for c in list(self._clients):
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        with self.changed:
            self.changed.notify_all()
        self.sock.close()
        os.close(self._stop_r)
        os.close(self._stop_w)
