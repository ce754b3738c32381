"""The socket between a worker pool's ServerActor and its ClientActors (actors/channel.py), without Ray:
replies in order, errors carried back, late replies dropped, a dead peer reported, a wrong key refused,
and a sender never blocked by a request still computing."""

from __future__ import annotations

import multiprocessing
import sys
import threading
import time
from multiprocessing import AuthenticationError

import numpy as np
import pytest

from actors.channel import ChannelLost, Endpoint, Link


def echo(method: str, args: tuple):
    if method == "fail":
        raise KeyError(args[0])
    return method, args


def test_replies_come_back_in_order_with_the_handlers_errors():
    endpoint = Endpoint(echo)
    assert sys.platform != "linux" or endpoint.address[:1] == b"\0"  # abstract: no file left behind
    link = Link(endpoint.address, endpoint.authkey)
    try:
        vector = np.arange(5, dtype=np.float32)
        first, second = link.submit("train", vector, 1), link.submit("evaluate", 2)
        method, (got, rnd) = first.result()
        assert method == "train" and rnd == 1 and np.array_equal(got, vector)
        assert second.result() == ("evaluate", (2,))
        with pytest.raises(KeyError, match="client 3"):
            link.submit("fail", "client 3").result()
        assert link.submit("after", 4).result() == ("after", (4,))  # an error leaves the link usable
        assert endpoint.served == 4
    finally:
        link.close()
        endpoint.close()


def test_a_late_reply_is_dropped_and_the_next_request_gets_its_own():
    release = threading.Event()

    def slow_first(method, args):
        if args[0] == 1:
            release.wait(10)
        return args[0]

    endpoint = Endpoint(slow_first)
    link = Link(endpoint.address, endpoint.authkey)
    try:
        late = link.submit("train", 1)
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            late.result(deadline=time.monotonic() + 0.3)
        assert 0.25 < time.monotonic() - t0 < 5
        release.set()
        assert link.submit("train", 2).result() == 2  # request 1's reply came first and was dropped
    finally:
        link.close()
        endpoint.close()


def test_a_sender_is_not_blocked_by_a_request_still_computing():
    """Requests larger than the socket's buffer are taken off the socket at once, while the worker thread
    is still busy with the first, so the caller can send and then wait with its own timeout."""
    release = threading.Event()

    def busy(method, args):
        release.wait(10)
        return float(args[0].sum())

    endpoint = Endpoint(busy)
    link = Link(endpoint.address, endpoint.authkey)
    try:
        big = np.ones(2_000_000, dtype=np.float32)  # 8 MB, far over an AF_UNIX socket buffer
        t0 = time.monotonic()
        calls = [link.submit("train", big * k) for k in (1, 2, 3)]
        assert time.monotonic() - t0 < 5  # blocked, it would wait the 10 s of the first request
        release.set()
        assert [c.result(time.monotonic() + 30) for c in calls] == [2e6, 4e6, 6e6]
    finally:
        link.close()
        endpoint.close()


def test_a_wrong_key_is_refused_and_the_endpoint_still_serves():
    endpoint = Endpoint(echo)
    try:
        with pytest.raises(AuthenticationError):
            Link(endpoint.address, b"not the key")
        link = Link(endpoint.address, endpoint.authkey)
        assert link.submit("ok", 1).result() == ("ok", (1,))
        link.close()
    finally:
        endpoint.close()


def _serve_in_child(conn) -> None:
    endpoint = Endpoint(echo)
    conn.send((endpoint.address, endpoint.authkey))
    time.sleep(60)


def test_a_dead_peer_is_reported_as_lost():
    """The other end's process killed: waiting for a reply, and sending, raise ChannelLost."""
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_serve_in_child, args=(child,), daemon=True)
    proc.start()
    try:
        address, authkey = parent.recv()
        link = Link(address, authkey)
        assert link.submit("ping", 1).result(time.monotonic() + 30) == ("ping", (1,))
        proc.kill()
        proc.join(10)
        with pytest.raises(ChannelLost):
            link.submit("ping", 2).result(time.monotonic() + 30)
        with pytest.raises(ChannelLost):  # the socket is known closed: sending fails at once
            link.submit("ping", 3).result(time.monotonic() + 30)
    finally:
        proc.kill()
