"""The job's secret, and the handshake that proves it without sending it.

A rendezvous store that anyone on the network may join lets a stranger read the job's addresses,
write keys the ranks trust, or take a rank's place. So every job has a secret that only its
own processes hold: `microddp run` makes a random one per job and hands it to its workers in
MICRODDP_SECRET; a job on many hosts takes it from MICRODDP_SECRET or from a file that only its
owner can read (MICRODDP_SECRET_FILE, mode 0600), copied to every host by the user.

The handshake (`serve_proof` / `client_proof`) is a challenge-response in both directions: each
side sends a fresh random nonce and proves it knows the secret with an HMAC-SHA256 over both
nonces and its role, so neither side can replay an old answer or reflect the other's, and the
secret never crosses the wire. A client that fails is refused before it can read or write a key.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
from pathlib import Path

from ..errors import MicroDDPError

SECRET_ENV = "MICRODDP_SECRET"
SECRET_FILE_ENV = "MICRODDP_SECRET_FILE"
MAGIC = b"MDPS1"  # what the server says first: protocol and version, so a stray client learns
NONCE_LEN = 32
MAC_LEN = 32
MIN_SECRET_LEN = 16  # characters: a short secret could be guessed offline from one handshake


def new_secret() -> str:
    """A fresh random secret for one job (256 bits, hex)."""
    return secrets.token_hex(32)


def _checked(secret: str, where: str) -> str:
    secret = secret.strip()
    if len(secret) < MIN_SECRET_LEN:
        raise MicroDDPError(f"the job secret from {where} has {len(secret)} characters; use at "
                            f"least {MIN_SECRET_LEN} random ones (`python -c \"import secrets; "
                            "print(secrets.token_hex(32))\"`)")
    return secret


def read_secret_file(path: str | os.PathLike) -> str:
    """The secret in `path`, which only its owner may read or write (mode 0600 or stricter)."""
    p = Path(path)
    try:
        info = p.stat()
        text = p.read_text()
    except OSError as e:
        raise MicroDDPError(f"cannot read the job secret file {p} ({e.strerror}); set "
                            f"{SECRET_FILE_ENV} to a file that holds the secret") from None
    if stat.S_IMODE(info.st_mode) & 0o077:
        raise MicroDDPError(f"the job secret file {p} can be read by others (mode "
                            f"{stat.S_IMODE(info.st_mode):o}); run `chmod 600 {p}`")
    if info.st_uid != os.getuid():
        raise MicroDDPError(f"the job secret file {p} belongs to another user (uid "
                            f"{info.st_uid}); use a file of your own with mode 600")
    return _checked(text, str(p))


def job_secret(environ: dict | None = None) -> str | None:
    """This job's secret: MICRODDP_SECRET, else the file named by MICRODDP_SECRET_FILE, else
    None (no secret: the store is torch's own, as under raw torchrun)."""
    env = os.environ if environ is None else environ
    if env.get(SECRET_ENV):
        return _checked(env[SECRET_ENV], SECRET_ENV)
    if env.get(SECRET_FILE_ENV):
        return read_secret_file(env[SECRET_FILE_ENV])
    return None


def _mac(secret: str, role: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(secret.encode(), role + first + second, hashlib.sha256).digest()


def client_answer(secret: str, server_nonce: bytes) -> tuple[bytes, bytes]:
    """The client's reply to a server's nonce: (its own nonce + its proof, that nonce)."""
    mine = os.urandom(NONCE_LEN)
    return mine + _mac(secret, b"client", server_nonce, mine), mine


def server_checks(secret: str, server_nonce: bytes, reply: bytes) -> bytes | None:
    """The server's proof for a client's reply, or None if the client does not know the
    secret (compared in constant time)."""
    if len(reply) != NONCE_LEN + MAC_LEN:
        return None
    theirs, proof = reply[:NONCE_LEN], reply[NONCE_LEN:]
    if not hmac.compare_digest(proof, _mac(secret, b"client", server_nonce, theirs)):
        return None
    return _mac(secret, b"server", theirs, server_nonce)


def server_is_genuine(secret: str, server_nonce: bytes, client_nonce: bytes,
                      proof: bytes) -> bool:
    """Whether the server's proof shows it knows the secret too (a client must not hand its
    keys to an impostor listening at the address)."""
    return hmac.compare_digest(proof, _mac(secret, b"server", client_nonce, server_nonce))
