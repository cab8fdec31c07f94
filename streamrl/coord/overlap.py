"""Run a Redis script with other work done while Redis executes it.

A command's round trip is mostly waiting: the request crosses the socket, Redis wakes, runs it
and answers. :class:`OverlappedScript` sends the script, runs ``meanwhile()`` (work that does
not need the reply: the weights store's file GC after a publish), and only then reads the reply,
so that work costs no time of its own. For a small weights version (a LoRA adapter's few MB) the
announcement's round trip is a third of the publish, so it also has a connection of its own:
taking one from the pool (its bookkeeping and a readiness poll) and the pool's periodic health
check (a PING round trip after 10 s idle) would each cost as much as the work it hides.

Failures take the client's ordinary path: a lost connection or a script cache miss (a restarted
Redis has no scripts) runs the script again through the client, whose retry rides out an
outage (:class:`~streamrl.coord.coordinator.OutageRetry`) and which loads the script again; the
own connection reconnects at its next use. The script must therefore be idempotent (the publish
script is: a second run writes the same keys and sends one more notification, which subscribers
treat like any other). One thread at a time (the publisher's).
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import redis
from redis.commands.core import Script
from redis.exceptions import NoScriptError

# Errors after which the script is run again through the client (a connection error may come
# before or after Redis ran it: the second run must be harmless).
RERUN = (redis.ConnectionError, redis.TimeoutError, NoScriptError, ConnectionError, TimeoutError, OSError)


class OverlappedScript:
    """``script`` on ``client``'s Redis over a connection of its own (made like the pool's)."""

    def __init__(self, client: redis.Redis, script: Script):
        self.client, self.script = client, script
        self.conn = None
        self.pings = 0  # PINGs sent by wake() whose replies are unread

    def wake(self) -> None:
        """Send a PING whose reply is read with the next script's: Redis, idle since the last
        version, is awake (its core out of idle, its code in cache) when the script follows a few
        hundred microseconds later, which takes a fifth off the script's round trip. Never raises:
        a failed PING leaves the script to find the connection closed."""
        if self.conn is None:
            self.conn = self.client.connection_pool.make_connection()
        try:
            self.conn.send_command("PING", check_health=False)
            self.pings += 1
        except RERUN:  # send_command closed the connection: its replies are gone
            self.pings = 0

    def __call__(self, keys: Sequence[Any], args: Sequence[Any], meanwhile: Callable[[], Any]) -> Any:
        """``script(keys, args)``, with ``meanwhile()`` run (exactly once) between sending the script
        and reading its reply; returns the reply. ``meanwhile`` raising propagates (the connection,
        whose reply is then unread, is closed)."""
        if self.conn is None:
            self.conn = self.client.connection_pool.make_connection()
        sent = True
        try:
            self.conn.send_command("EVALSHA", self.script.sha, len(keys), *keys, *args, check_health=False)
        except RERUN:  # send_command closed the connection
            sent, self.pings = False, 0
        try:
            meanwhile()
        except BaseException:
            self._disconnect()
            raise
        if sent:
            try:
                for _ in range(self.pings):
                    self.conn.read_response()
                self.pings = 0
                return self.conn.read_response()
            except RERUN:  # read_response closed the connection
                self.pings = 0
            except BaseException:  # an error the script raised (its reply was read) or an interrupt
                self._disconnect()
                raise
        return self.script(keys=keys, args=args)

    def _disconnect(self) -> None:
        """Close the connection, and with it any reply left unread."""
        self.conn.disconnect()
        self.pings = 0

    def close(self) -> None:
        if self.conn is not None:
            self._disconnect()
            self.conn = None
