"""A direct link between the ServerActor and a worker pool's ClientActor on the same node
(``resources.pool_channel: socket``): the round's calls and replies travel over a Unix-domain socket
(``multiprocessing.connection``, authenticated by HMAC with a random key per actor), not as Ray actor calls.

Why: a Ray actor call and its reply cost about 1 ms each way on this workload's 40-50 ms round, on the
round's critical path (docs/performance.md, section 1); a socket round trip costs tens of microseconds.
Ray still starts, places, restarts and resets the actors; only the per-round exchange moves.

Plain Python, no Ray: :class:`Endpoint` serves a handler in the ClientActor's process, :class:`Link`
calls it from the ServerActor. A reply carries the number of its request, so the late reply of a
request that timed out (a straggler) is recognised and dropped; a closed socket (the process died)
raises :class:`ChannelLost`.
"""

from __future__ import annotations

import logging
import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection, Listener

log = logging.getLogger(__name__)


class ChannelLost(ConnectionError):
    """The other end of a link is gone (its process died, or the link was closed)."""


class Endpoint:
    """Listens on a Unix-domain socket and answers ``handler(method, args)`` for each request of each
    connection, in order. A connection has a reader thread, which takes requests off the socket at once
    (a sender is never blocked by a request still computing), and a worker thread, which computes them
    one after the other and sends the replies."""

    def __init__(self, handler: Callable[[str, tuple], object]):
        self.handler = handler
        self.authkey = os.urandom(32)
        # Linux: an abstract socket, no file to leave behind when Ray kills the process; elsewhere a file in a
        # temporary folder. Either way only this node can connect, and only with the key.
        address = f"\0fedsweep-{os.getpid()}-{os.urandom(8).hex()}" if sys.platform == "linux" else None
        self.listener = Listener(address, family="AF_UNIX", authkey=self.authkey)
        self.served = 0  # requests answered, over every connection
        self.closed = False
        threading.Thread(target=self._accept, name="fedsweep-channel-accept", daemon=True).start()

    @property
    def address(self) -> str | bytes:
        return self.listener.address

    def _accept(self) -> None:
        while True:
            try:
                conn = self.listener.accept()
            except (AuthenticationError, EOFError, OSError) as error:
                if self.closed:
                    return
                log.warning("fedsweep channel: refused a connection (%s)", error)  # wrong key, or caller gone
                continue
            requests: queue.Queue = queue.Queue()
            threading.Thread(target=self._read, args=(conn, requests), name="fedsweep-channel-read", daemon=True).start()
            threading.Thread(target=self._work, args=(conn, requests), name="fedsweep-channel-work", daemon=True).start()

    @staticmethod
    def _read(conn: Connection, requests: queue.Queue) -> None:
        try:
            while True:
                requests.put(conn.recv())
        except (EOFError, OSError):
            requests.put(None)  # the caller closed the link

    def _work(self, conn: Connection, requests: queue.Queue) -> None:
        with conn:
            while (request := requests.get()) is not None:
                number, method, args = request
                try:
                    reply = (number, True, self.handler(method, args))
                except Exception as error:  # noqa: BLE001 - the caller re-raises it
                    reply = (number, False, error)
                self.served += 1  # before the reply: whoever has read it sees the count
                try:
                    conn.send(reply)
                except OSError:
                    return

    def close(self) -> None:
        self.closed = True
        self.listener.close()


class Call:
    """A request sent on a :class:`Link`; :meth:`result` waits for its reply."""

    def __init__(self, link: Link, number: int, lost: ChannelLost | None = None):
        self.link, self.number, self.lost = link, number, lost  # lost: the request could not be sent

    def result(self, deadline: float | None = None):
        """The reply (an exception raised by the handler is raised here); ``TimeoutError`` when it has
        not come by ``deadline`` (``time.monotonic()``), :class:`ChannelLost` when the other end is gone."""
        if self.lost is not None:
            raise self.lost
        conn = self.link.conn
        while True:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                if not conn.poll(wait):
                    break
                number, ok, value = conn.recv()
            except (EOFError, OSError) as error:
                raise ChannelLost(str(error) or type(error).__name__) from error
            if number < self.number:
                continue  # the late reply of an earlier request that timed out
            if not ok:
                raise value
            return value
        raise TimeoutError(f"no reply to request {self.number} in time")


class Link:
    """The calling end: ``link.submit(method, *args).result(deadline)``."""

    def __init__(self, address: str | bytes, authkey: bytes):
        self.conn = Client(address, family="AF_UNIX", authkey=authkey)
        self.sent = 0

    def submit(self, method: str, *args) -> Call:
        """Send the request; a closed socket is reported by the returned call's :meth:`Call.result`."""
        self.sent += 1
        try:
            self.conn.send((self.sent, method, args))
        except OSError as error:
            return Call(self, self.sent, ChannelLost(str(error) or type(error).__name__))
        return Call(self, self.sent)

    def close(self) -> None:
        self.conn.close()
