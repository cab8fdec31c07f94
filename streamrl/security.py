"""Transport security: ZeroMQ CURVE keys and socket setup for cross-host trajectory and weight sockets.

Why: on one host the sockets bind loopback and nothing else can reach them. Across hosts the
trajectory socket (learner ROUTER) and the weights bucket server listen on a routable address;
without CURVE anyone on the network could push trajectories (poisoning training) or read the
weights. CURVE (CurveZMQ: Curve25519 key exchange + per-message authenticated encryption)
gives both encryption and authentication with no extra service: the server knows its secret
key, a client must know the server's *public* key, and the server may additionally accept only
an allow-list of client public keys (ZAP, via ``zmq.auth``).

Keys are Z85 text (40 characters). Where they come from, first match wins
(:func:`load_curve_keys`):

* environment: ``STREAMRL_CURVE_SECRET`` / ``STREAMRL_CURVE_PUBLIC`` (this process's pair),
  ``STREAMRL_CURVE_SERVER_PUBLIC`` (the learner's public key, for clients),
  ``STREAMRL_CURVE_CLIENTS`` (comma-separated allowed client public keys, for servers);
* a directory (``STREAMRL_CURVE_DIR`` or the ``directory`` argument) written by
  :func:`write_keypair`: ``NAME.key`` (public) and ``NAME.key_secret`` (secret, mode 0600).

Wiring (the sockets live in :mod:`streamrl.transport.sockets` and
:mod:`streamrl.weights.zmq_plane`): call :func:`configure_curve_server` on a ROUTER/REP **before
bind** and :func:`configure_curve_client` on a DEALER/REQ **before connect**. Options set after
bind/connect are silently ignored by libzmq (tests/test_security.py checks the mechanism of real sockets).
"""
from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

ENV_SECRET = "STREAMRL_CURVE_SECRET"
ENV_PUBLIC = "STREAMRL_CURVE_PUBLIC"
ENV_SERVER_PUBLIC = "STREAMRL_CURVE_SERVER_PUBLIC"
ENV_CLIENTS = "STREAMRL_CURVE_CLIENTS"
ENV_DIR = "STREAMRL_CURVE_DIR"
Z85_KEY_LEN = 40


class SecurityError(ValueError):
    """Keys are missing, malformed, or CURVE is not available in this libzmq."""


def curve_available() -> bool:
    """Whether this libzmq was built with CURVE (libsodium / tweetnacl)."""
    return bool(zmq.has("curve"))


def _require_curve() -> None:
    if not curve_available():
        raise SecurityError(f"libzmq {zmq.zmq_version()} has no CURVE support; install a pyzmq wheel built with it")


def _check_key(name: str, key: str | bytes) -> bytes:
    k = key.encode() if isinstance(key, str) else bytes(key)
    k = k.strip()
    if len(k) != Z85_KEY_LEN:
        raise SecurityError(f"{name}: a CURVE key is {Z85_KEY_LEN} Z85 characters, got {len(k)}")
    try:
        z85.decode(k)
    except (ValueError, KeyError, IndexError) as e:
        raise SecurityError(f"{name}: not a Z85 key ({e})") from None
    return k


@dataclass(frozen=True)
class CurveKeys:
    """One process's CURVE material. ``public``/``secret``: its own pair; ``server_public``: the
    server it connects to (clients); ``clients``: allowed client public keys (servers; empty =
    any client that knows the server key)."""

    public: bytes
    secret: bytes
    server_public: bytes | None = None
    clients: tuple[bytes, ...] = field(default_factory=tuple)


def generate_keypair() -> tuple[bytes, bytes]:
    """A fresh (public, secret) Z85 pair."""
    _require_curve()
    return zmq.curve_keypair()


def public_from_secret(secret: str | bytes) -> bytes:
    """The public key that belongs to ``secret``."""
    _require_curve()
    return zmq.curve_public(_check_key("secret key", secret))


def write_keypair(directory: str | Path, name: str) -> tuple[Path, Path]:
    """Generate a pair into ``directory/NAME.key`` (public) and ``NAME.key_secret`` (mode 0600)."""
    if not name or "/" in name:
        raise SecurityError(f"key name {name!r}: use a plain file name")
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    public, secret = generate_keypair()
    pub, sec = d / f"{name}.key", d / f"{name}.key_secret"
    pub.write_bytes(public + b"\n")
    fd = os.open(sec, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # never world-readable, not even briefly
    with os.fdopen(fd, "wb") as f:
        f.write(secret + b"\n")
    return pub, sec


def read_keypair(directory: str | Path, name: str) -> tuple[bytes, bytes]:
    """(public, secret) written by :func:`write_keypair`; refuses a group/world-readable secret."""
    d = Path(directory)
    sec = d / f"{name}.key_secret"
    if not sec.is_file():
        raise SecurityError(f"CURVE secret key {str(sec)!r} does not exist")
    if sec.stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise SecurityError(f"CURVE secret key {str(sec)!r} is readable by others; chmod 600 it")
    secret = _check_key(str(sec), sec.read_bytes())
    public = public_from_secret(secret)
    pub = d / f"{name}.key"
    if pub.is_file() and _check_key(str(pub), pub.read_bytes()) != public:
        raise SecurityError(f"{str(pub)!r} does not belong to the secret key next to it")
    return public, secret


def read_public(path: str | Path) -> bytes:
    return _check_key(str(path), Path(path).read_bytes())


def load_curve_keys(role: str, directory: str | Path | None = None,
                    env: dict[str, str] | None = None) -> CurveKeys | None:
    """This process's keys for ``role`` (``"server"`` or ``"client"``), or None when CURVE is off.

    Environment variables win over files; a directory holds ``server.key[_secret]``,
    ``client.key[_secret]`` and optionally ``clients/*.key`` (the allow-list).
    """
    if role not in ("server", "client"):
        raise SecurityError(f"role {role!r}: expected 'server' or 'client'")
    env = os.environ if env is None else env
    directory = directory or env.get(ENV_DIR) or None
    if env.get(ENV_SECRET):
        secret = _check_key(ENV_SECRET, env[ENV_SECRET])
        public = public_from_secret(secret)
        if env.get(ENV_PUBLIC) and _check_key(ENV_PUBLIC, env[ENV_PUBLIC]) != public:
            raise SecurityError(f"{ENV_PUBLIC} does not belong to {ENV_SECRET}")
    elif directory:
        public, secret = read_keypair(directory, role)
    else:
        return None
    server_public = None
    if role == "client":
        if env.get(ENV_SERVER_PUBLIC):
            server_public = _check_key(ENV_SERVER_PUBLIC, env[ENV_SERVER_PUBLIC])
        elif directory and (Path(directory) / "server.key").is_file():
            server_public = read_public(Path(directory) / "server.key")
        else:
            raise SecurityError(f"CURVE client keys found but no server public key ({ENV_SERVER_PUBLIC} "
                                f"or server.key in the key directory)")
    clients: tuple[bytes, ...] = ()
    if role == "server":
        if env.get(ENV_CLIENTS):
            clients = tuple(_check_key(ENV_CLIENTS, k) for k in env[ENV_CLIENTS].split(",") if k.strip())
        elif directory and (Path(directory) / "clients").is_dir():
            clients = tuple(read_public(p) for p in sorted((Path(directory) / "clients").glob("*.key")))
    return CurveKeys(public, secret, server_public, clients)


class _AllowList:
    """ZAP credentials provider: a client may connect iff its public key (Z85) is listed."""

    def __init__(self):
        self.keys: set[bytes] = set()

    def callback(self, domain: str, key: bytes) -> bool:
        return bytes(key) in self.keys


class _Auth:
    """One ZAP authenticator per context (libzmq allows one ZAP handler per context)."""

    _by_ctx: dict[int, object] = {}

    @classmethod
    def allow(cls, ctx: zmq.Context, clients: tuple[bytes, ...]):
        auth = cls._by_ctx.get(id(ctx))
        if auth is None:
            auth = ThreadAuthenticator(ctx)
            auth.start()
            auth._streamrl_keys = _AllowList()
            auth.configure_curve_callback(domain="*", credentials_provider=auth._streamrl_keys)
            cls._by_ctx[id(ctx)] = auth
        auth._streamrl_keys.keys.update(clients)
        return auth

    @classmethod
    def stop(cls, ctx: zmq.Context) -> None:
        auth = cls._by_ctx.pop(id(ctx), None)
        if auth is not None:
            auth.stop()


def configure_curve_server(sock: zmq.Socket, secret: str | bytes, clients: tuple[bytes, ...] | list = ()) -> None:
    """Make ``sock`` a CURVE server. Call BEFORE ``bind``.

    ``clients``: allowed client public keys; empty = any client that knows our public key
    (it still cannot read or forge traffic without the key exchange).
    """
    _require_curve()
    sock.curve_secretkey = _check_key("server secret key", secret)
    sock.curve_server = True
    if clients:
        _Auth.allow(sock.context, tuple(_check_key("client public key", c) for c in clients))
        sock.zap_domain = b"*"


def configure_curve_client(sock: zmq.Socket, server_public: str | bytes, public: str | bytes | None = None,
                           secret: str | bytes | None = None) -> None:
    """Make ``sock`` a CURVE client of the server with ``server_public``. Call BEFORE ``connect``.

    Without ``public``/``secret`` an ephemeral pair is generated (fine when the server has no
    client allow-list).
    """
    _require_curve()
    if secret is None:
        public, secret = generate_keypair()
    elif public is None:
        public = public_from_secret(secret)
    sock.curve_serverkey = _check_key("server public key", server_public)
    sock.curve_publickey = _check_key("client public key", public)
    sock.curve_secretkey = _check_key("client secret key", secret)


def apply_server_keys(sock: zmq.Socket, keys: CurveKeys | None) -> bool:
    """:func:`configure_curve_server` from loaded keys; no-op (False) when ``keys`` is None."""
    if keys is None:
        return False
    configure_curve_server(sock, keys.secret, keys.clients)
    return True


def apply_client_keys(sock: zmq.Socket, keys: CurveKeys | None) -> bool:
    """:func:`configure_curve_client` from loaded keys; no-op (False) when ``keys`` is None."""
    if keys is None:
        return False
    configure_curve_client(sock, keys.server_public, keys.public, keys.secret)
    return True


def stop_authenticator(ctx: zmq.Context) -> None:
    """Stop the ZAP thread :func:`configure_curve_server` started for ``ctx`` (if any)."""
    _Auth.stop(ctx)
