"""Security: embedded Redis on loopback only, passwords, refusal to expose Redis, ZeroMQ CURVE (real sockets)."""
from __future__ import annotations

import os
import socket
import stat

import pytest
import redis
import zmq

from streamrl.coord.coordinator import Coordinator
from streamrl.launcher import launch
from streamrl.launcher.redis_server import RedisServer
from streamrl.launcher.runstate import LaunchError, check_redis_url
from streamrl.security import (
    SecurityError,
    apply_client_keys,
    apply_server_keys,
    configure_curve_client,
    configure_curve_server,
    curve_available,
    generate_keypair,
    load_curve_keys,
    read_keypair,
    stop_authenticator,
    write_keypair,
)


def check_curve(sock: zmq.Socket) -> str:
    """``"server"``, ``"client"`` or ``"off"``: the CURVE role ``sock`` really has (options set
    after bind/connect are ignored by libzmq, so tests read the mechanism back)."""
    if sock.getsockopt(zmq.MECHANISM) != zmq.CURVE:
        return "off"
    return "server" if sock.getsockopt(zmq.CURVE_SERVER) else "client"


def _non_loopback_ip() -> str | None:
    """An address of this host other than loopback (None in a namespace with only lo)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))  # no packet is sent; picks the outgoing interface
            ip = s.getsockname()[0]
        return None if ip.startswith("127.") else ip
    except OSError:
        return None


# -- Redis ---------------------------------------------------------------------------------------
def test_embedded_redis_binds_loopback_only(redis_server):
    r = redis.Redis.from_url(redis_server.url)
    assert r.config_get("bind")["bind"] == "127.0.0.1"
    assert r.config_get("protected-mode")["protected-mode"] == "yes"
    ip = _non_loopback_ip()
    if ip is not None:  # the same port on a reachable address must refuse connections
        with pytest.raises(OSError):
            socket.create_connection((ip, redis_server.port), timeout=1.0).close()


def test_embedded_redis_refuses_non_loopback_without_password(tmp_path):
    with pytest.raises(ValueError, match="non-loopback"):
        RedisServer(tmp_path, host="0.0.0.0")


def test_redis_password_is_required_and_used(tmp_path, run_id):
    with RedisServer(tmp_path, password="s3cret-pw") as server:
        assert server.url.startswith("redis://:s3cret-pw@127.0.0.1:")
        anon = redis.Redis(host="127.0.0.1", port=server.port, socket_connect_timeout=1)
        with pytest.raises(redis.AuthenticationError):
            anon.get("x")
        wrong = redis.Redis(host="127.0.0.1", port=server.port, password="nope", socket_connect_timeout=1)
        with pytest.raises(redis.AuthenticationError):
            wrong.ping()
        coord = Coordinator(server.url, run_id)  # redis://:pass@host form
        coord.put_config({"a": 1})
        assert coord.get_config() == {"a": 1}
        coord.close()


def test_launcher_refuses_reachable_redis_without_password(capsys):
    with pytest.raises(LaunchError, match="password"):
        check_redis_url("redis://10.1.2.3:6379/0")
    check_redis_url("redis://:pw@10.1.2.3:6379/0")
    check_redis_url("redis://127.0.0.1:6379/0")
    assert launch.main(["--redis-host", "0.0.0.0", "--dry-run"]) == 2
    assert "--redis-password" in capsys.readouterr().err
    assert launch.main(["--redis-url", "redis://10.1.2.3:6379/0", "--dry-run"]) == 2
    assert "password" in capsys.readouterr().err
    assert launch.main(["--redis-host", "0.0.0.0", "--redis-password", "pw", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "pw@" not in out and ":***@" in out  # the password never reaches logs or --dry-run


# -- CURVE ---------------------------------------------------------------------------------------
pytestmark_curve = pytest.mark.skipif(not curve_available(), reason="libzmq without CURVE")


def _pair(ctx, server_setup, client_setup):
    srv = ctx.socket(zmq.ROUTER)
    srv.linger = 0
    server_setup(srv)
    port = srv.bind_to_random_port("tcp://127.0.0.1")
    cli = ctx.socket(zmq.DEALER)
    cli.linger = 0
    client_setup(cli)
    cli.connect(f"tcp://127.0.0.1:{port}")
    return srv, cli


def _delivered(srv, cli, payload=b"trajectory") -> bool:
    cli.send(payload)
    if not srv.poll(1500):
        return False
    peer, data = srv.recv_multipart()
    return data == payload


@pytest.fixture
def ctx():
    """A ZeroMQ context whose ZAP thread (if a test started one) and sockets go with the test."""
    c = zmq.Context()
    yield c
    stop_authenticator(c)
    c.destroy(linger=0)


@pytestmark_curve
def test_curve_encrypts_and_authenticates_real_sockets(ctx):
    s_pub, s_sec = generate_keypair()
    c_pub, c_sec = generate_keypair()
    srv, cli = _pair(ctx, lambda s: configure_curve_server(s, s_sec),
                     lambda c: configure_curve_client(c, s_pub, c_pub, c_sec))
    assert check_curve(srv) == "server" and check_curve(cli) == "client"
    assert _delivered(srv, cli)
    # a client that does not know the server key gets nothing through
    bad_pub, _ = generate_keypair()
    srv3, cli3 = _pair(ctx, lambda s: configure_curve_server(s, s_sec),
                       lambda c: configure_curve_client(c, bad_pub))
    assert not _delivered(srv3, cli3)
    # a plaintext client cannot talk to a CURVE server
    srv4, cli4 = _pair(ctx, lambda s: configure_curve_server(s, s_sec), lambda c: None)
    assert check_curve(cli4) == "off"
    assert not _delivered(srv4, cli4)


@pytestmark_curve
def test_curve_client_allow_list(ctx):
    s_pub, s_sec = generate_keypair()
    ok_pub, ok_sec = generate_keypair()
    srv, cli = _pair(ctx, lambda s: configure_curve_server(s, s_sec, clients=[ok_pub]),
                     lambda c: configure_curve_client(c, s_pub, ok_pub, ok_sec))
    assert _delivered(srv, cli)
    other = ctx.socket(zmq.DEALER)
    other.linger = 0
    configure_curve_client(other, s_pub)  # valid key exchange, but not on the allow-list
    other.connect(srv.getsockopt_string(zmq.LAST_ENDPOINT))
    other.send(b"intruder")
    assert not srv.poll(1500)


@pytestmark_curve
def test_curve_keys_from_files_and_env(tmp_path, ctx):
    write_keypair(tmp_path, "server")
    write_keypair(tmp_path, "client")
    sec = tmp_path / "server.key_secret"
    assert stat.S_IMODE(sec.stat().st_mode) == 0o600
    s_pub, s_sec = read_keypair(tmp_path, "server")
    server = load_curve_keys("server", tmp_path, env={})
    client = load_curve_keys("client", tmp_path, env={})
    assert server.public == s_pub and client.server_public == s_pub
    assert load_curve_keys("server", None, env={}) is None  # CURVE off by default
    env = {"STREAMRL_CURVE_SECRET": s_sec.decode()}
    assert load_curve_keys("server", None, env=env).public == s_pub
    with pytest.raises(SecurityError, match="server public key"):
        load_curve_keys("client", None, env=env)
    with pytest.raises(SecurityError, match="40 Z85"):
        load_curve_keys("server", None, env={"STREAMRL_CURVE_SECRET": "short"})
    os.chmod(sec, 0o644)
    with pytest.raises(SecurityError, match="readable by others"):
        read_keypair(tmp_path, "server")
    os.chmod(sec, 0o600)
    srv, cli = _pair(ctx, lambda s: apply_server_keys(s, server), lambda c: apply_client_keys(c, client))
    assert _delivered(srv, cli)
