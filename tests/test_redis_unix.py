"""The embedded Redis's Unix socket: same-host processes use it, other hosts the TCP URL.

Real redis-server processes throughout: the socket answers, a path too long for a socket
address falls back to TCP, a Coordinator over the socket publishes (with its overlapped
announcement) and rides out a restart of the server, and the launcher hands the socket's URL
to the processes it starts on its host.
"""
from __future__ import annotations

import json
import os
import socket
import stat

import pytest
import redis

from streamrl.coord.coordinator import Coordinator
from streamrl.launcher.redis_server import SOCKET_NAME, SUN_PATH_MAX, RedisServer
from streamrl.weights.manifest import TABLE_REF, Table


@pytest.fixture
def unix_server(tmp_path_factory):
    # a short workdir: pytest's tmp_path can be longer than a socket address holds
    server = RedisServer(tmp_path_factory.mktemp("r", numbered=True)).start()
    assert server.unix_url is not None, f"{server.socket_path} unexpectedly long"
    yield server
    server.stop()


def test_embedded_server_answers_on_its_socket_only_for_its_user(unix_server):
    path = unix_server.socket_path
    assert path.name == SOCKET_NAME and stat.S_ISSOCK(os.stat(path).st_mode)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o700
    assert unix_server.local_url == unix_server.unix_url and unix_server.unix_url.startswith("unix:///")
    r = redis.Redis.from_url(unix_server.local_url)
    assert r.ping() and r.connection_pool.connection_kwargs["path"] == str(path)
    r.close()


def test_password_goes_into_the_socket_url(tmp_path_factory):
    with RedisServer(tmp_path_factory.mktemp("r"), password="s3cret-pw") as server:
        with socket.socket(socket.AF_UNIX) as raw:  # without the password: refused
            raw.settimeout(5)
            raw.connect(str(server.socket_path))
            raw.sendall(b"PING\r\n")
            assert raw.recv(100).startswith(b"-NOAUTH")
        assert redis.Redis.from_url(server.unix_url).ping()


def test_too_long_workdir_falls_back_to_tcp(tmp_path):
    deep = tmp_path / ("d" * max(1, SUN_PATH_MAX - len(os.fsencode(tmp_path))))
    with RedisServer(deep) as server:
        assert server.socket_path is None and server.unix_url is None and server.local_url == server.url
        assert not (deep / SOCKET_NAME).exists()
        assert redis.Redis.from_url(server.local_url).ping()


def test_coordinator_over_the_socket_publishes_and_recovers_after_a_restart(unix_server, run_id):
    """The overlapped announcement (its own connection) and the pooled client both reconnect to
    the re-created socket; the script cache, empty after the restart, is loaded again."""
    c = Coordinator(unix_server.local_url, run_id, outage_s=20)
    table = Table.of('[{"name": "w"}]')
    ran = []

    def publish(v: int) -> None:
        c.wake_for_publish()  # as the publisher does: a PING first, its reply read with the script's
        c.publish_version(v, {}, keep=2, encoded=json.dumps({TABLE_REF: table.digest, "v": v}), table=table,
                          meanwhile=lambda: ran.append(v))

    publish(0)
    publish(1)
    assert c.current_version() == 1 and c.manifest(1)["tensors"] == [{"name": "w"}] and ran == [0, 1]
    unix_server.stop()
    unix_server.start()  # same socket path, empty: no persistence, no scripts
    assert c.current_version() == -1 and c.reassert_version()
    publish(2)  # the own connection is dead: the script runs again through the retrying client
    publish(3)
    assert c.current_version() == 3 and c.manifest(3)["tensors"] == [{"name": "w"}] and ran == [0, 1, 2, 3]
    assert Coordinator(unix_server.url, run_id).current_version() == 3  # the same server over TCP
    c.close()


def test_overlapped_work_that_raises_or_unread_pings_leave_no_reply_behind(unix_server, run_id):
    c = Coordinator(unix_server.local_url, run_id)

    def boom():
        raise RuntimeError("meanwhile failed")

    c.publish_version(0, {"v": 0}, keep=2, meanwhile=lambda: None)  # Redis has the script from here on
    c.wake_for_publish()
    with pytest.raises(RuntimeError, match="meanwhile failed"):
        c.publish_version(1, {"v": 1}, keep=2, meanwhile=boom)
    assert c.wait_version(0, timeout_s=5, poll_s=0.01) == 1  # sent before the work ran (read on another connection)
    c.wake_for_publish()
    c.wake_for_publish()  # a publish that failed before its announcement left a PING unanswered
    c.publish_version(2, {"v": 2}, keep=2, meanwhile=lambda: None)  # the connection starts afresh
    assert c.current_version() == 2 and c.manifest(2) == {"v": 2}
    c.publish_version(3, {"v": 3}, keep=2, meanwhile=lambda: None)  # every PONG was read: the reply is the script's
    assert c.current_version() == 3 and c.manifest(1) is None
    c.close()


def test_launcher_hands_the_socket_to_its_processes(tmp_path_factory, repo, redis_server, run_id):
    from streamrl.coord.coordinator import Coordinator as Coord
    from streamrl.launcher import launch as cli
    from streamrl.launcher.runner import _processes, redis_urls
    from streamrl.launcher.runstate import RunState

    run_dir = tmp_path_factory.mktemp("run")
    argv = ["--config", str(repo / "configs/tiny.yaml"), "--rollers", "2", "--run-dir", str(run_dir),
            "--run-id", run_id]
    launch = cli.prepare(cli.parse_args(argv))
    with RedisServer(launch.run_dir / "redis") as server:
        url, local = redis_urls(launch, server)
        assert url == server.url and local == server.unix_url and local.startswith("unix://")
        learner, rollers = _processes(launch, local, RunState(Coord(local, run_id), run_id))
        for proc in [learner, *rollers]:
            assert proc.cmd[proc.cmd.index("--redis-url") + 1] == local, proc.name
    dry = cli.describe(launch)
    assert dry["redis_here"] == local and dry["redis"].startswith("redis://")
    assert all(p["cmd"][p["cmd"].index("--redis-url") + 1] == local for p in dry["processes"])
    # a given --redis-url (another host's Redis, or one of a container) is handed on as it is
    given = cli.prepare(cli.parse_args(argv + ["--redis-url", redis_server.url]))
    assert redis_urls(given, None) == (redis_server.url, redis_server.url)


def test_overlapped_script_reads_its_own_reply_after_the_pings(unix_server):
    from streamrl.coord.overlap import OverlappedScript

    client = redis.Redis.from_url(unix_server.local_url, decode_responses=True)
    echo = OverlappedScript(client, client.register_script("return ARGV[1]"))
    done = []
    assert echo([], ["first"], lambda: done.append(1)) == "first"  # NOSCRIPT: run through the client
    for n in range(3):
        for _ in range(n):
            echo.wake()
        assert echo([], [f"v{n}"], lambda: done.append(1)) == f"v{n}" and echo.pings == 0
    assert len(done) == 4
    echo.close()
    client.close()
