"""The keep-alive soak from the product spec: one client, an impatient engine, no errors.

One client keep-alive connection runs round after round of a multi-turn streaming
chat (the message history grows every round) while the upstream closes every idle
connection after 0.1 s. Between rounds the client pauses: half the pauses end within
20% of the upstream's idle close, the rest well before it (the pooled connection is
alive) or well after (the upstream has closed it). Many pauses therefore end right as
the upstream closes the pooled connection: the proxy meets stale connections (its own
pool idle timeout is the default 4 s) and must hide every one of them. This file
proves that, under that race:

* the client sees zero errors and zero hangs, on the same connection throughout;
* every stream is complete: all tokens in order, usage, then ``data: [DONE]``;
* each round reached the engine exactly once (a resend never duplicates work), and
  a resend only ever follows a failure on a *reused* connection;
* the race really happened: the upstream closed idle connections and the proxy had
  to open new ones, yet still reused connections whenever they were alive.
"""

# Duration: about 10 s of pauses by default; TRACEPROXY_SOAK_SECONDS=600 runs a longer
# soak of the same shape. The pauses are the point of the test, so the time scale
# is what is kept short: a request meets a connection the upstream is closing within
# a millisecond or so of the close, and that window is a larger share of a pause
# spread of tens of milliseconds than of hundreds, so a short soak meets the race
# more often per round than a slow one. The pauses well before and well after the
# close keep both reuse and fresh connections in every run, even when a loaded
# machine delays each round by tens of milliseconds.

from __future__ import annotations

import json
import os
import random
import socket
import threading
import time

import h11
import pytest

from traceproxy.sim.fast import MODEL

from .support import RawClient, wait_until

UPSTREAM_IDLE_CLOSE = 0.1
# Pause ranges, as fractions of the upstream's idle close, drawn from with equal chance:
# kept alive, at the edge (twice as often), closed while idle.
PAUSE_RANGES = ((0.3, 0.7), (0.8, 1.2), (0.8, 1.2), (1.5, 2.0))
MEAN_PAUSE = UPSTREAM_IDLE_CLOSE * sum(lo + hi for lo, hi in PAUSE_RANGES) / (2 * len(PAUSE_RANGES))
DEFAULT_SOAK_SECONDS = 10.0
MIN_ROUNDS = 20
HISTORY_ROUNDS = 200  # a longer soak keeps the latest rounds: requests stay the size they reach by then
REQUEST_TIMEOUT = 10.0  # a response not done within this counts as a hang
MAX_FAILURES = 5  # stop early once the verdict is clear
SEED = 20240611


def soak_seconds(environ=os.environ) -> float:
    """TRACEPROXY_SOAK_SECONDS, about how long the client spends pausing between rounds."""
    text = environ.get("TRACEPROXY_SOAK_SECONDS", "").strip()
    if not text:
        return DEFAULT_SOAK_SECONDS
    try:
        seconds = float(text)
    except ValueError:
        seconds = 0.0
    if not 0 < seconds < 86400:
        raise pytest.UsageError(f"TRACEPROXY_SOAK_SECONDS: expected seconds above 0 and below a day, got {text!r}")
    return seconds


SOAK_SECONDS = soak_seconds()
ROUNDS = max(MIN_ROUNDS, round(SOAK_SECONDS / MEAN_PAUSE))

pytestmark = pytest.mark.timeout(120 + 3 * SOAK_SECONDS)


def pause_before_next_round(rng: random.Random) -> float:
    return rng.uniform(*rng.choice(PAUSE_RANGES)) * UPSTREAM_IDLE_CLOSE


class Recorder:
    """Lifecycle observer: the proxy's own verdict on every request."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.done: list[dict] = []

    def on_request_start(self, record) -> None:
        pass

    def on_mark(self, record, mark) -> None:
        pass

    def on_done(self, record) -> None:
        entry = {
            "client_conn": record.connection.id,
            "outcome": record.outcome.code,
            "error": record.error,
            "attempts": [(a.reused, a.outcome.code if a.outcome else None) for a in record.attempts],
        }
        with self.lock:
            self.done.append(entry)


def stream_problem(resp, max_tokens: int) -> str | None:
    """Why this response is not a complete, correct SSE chat stream (None if it is)."""
    if resp.status != 200:
        return f"status {resp.status}: {resp.body[:200]!r}"
    if not resp.complete:
        return f"truncated after {len(resp.body)} bytes: {resp.body[-200:]!r}"
    if resp.headers.get("connection", "").lower() == "close":
        return "proxy asked to close the client connection"
    events = [e for e in resp.body.decode().split("\n\n") if e.strip()]
    if not events or events[-1] != "data: [DONE]":
        return f"stream does not end with data: [DONE]: {resp.body[-200:]!r}"
    chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
    tokens = [c["choices"][0]["delta"]["content"] for c in chunks if c["choices"][0]["delta"].get("content")]
    if tokens != [f"tok{i} " for i in range(max_tokens)]:
        return f"{len(tokens)} tokens, expected {max_tokens} in order"
    usage = chunks[-1].get("usage")
    if not usage or usage["completion_tokens"] != max_tokens:
        return f"missing or wrong usage: {usage}"
    return None


def test_keepalive_soak_against_upstream_idle_close(fast_upstream, start_proxy):
    up = fast_upstream(idle_close_after=UPSTREAM_IDLE_CLOSE)
    proxy = start_proxy(up.url)
    assert proxy.settings.pool.idle_timeout > UPSTREAM_IDLE_CLOSE  # the proxy will meet stale connections
    recorder = Recorder()
    proxy.fanout.add(recorder)
    rng = random.Random(SEED)

    client = RawClient(proxy.port, timeout=REQUEST_TIMEOUT)
    messages = [{"role": "system", "content": "You are a soak test."}]
    failures: list[tuple[int, str]] = []
    rounds_done = 0
    soak_started = time.monotonic()
    try:
        for rnd in range(ROUNDS):
            if rnd:
                time.sleep(pause_before_next_round(rng))  # deliberate idle gap: the race under test
                if len(messages) > 1 + 2 * HISTORY_ROUNDS:
                    del messages[1:3]  # the oldest round: a user turn and its answer
            max_tokens = rng.randint(1, 24)
            messages.append({"role": "user", "content": f"round {rnd}: {max_tokens} tokens please"})
            body = json.dumps({"model": MODEL, "messages": messages, "max_tokens": max_tokens, "stream": True,
                               "stream_options": {"include_usage": True}}).encode()
            started = time.monotonic()
            problem = None
            try:
                resp = client.roundtrip("POST", "/v1/chat/completions",
                                        headers=[("Content-Type", "application/json")], body=body)
                problem = stream_problem(resp, max_tokens)
            except socket.timeout:
                problem = f"hang: no response within {REQUEST_TIMEOUT:g} s"
            except (OSError, h11.ProtocolError) as exc:
                problem = f"client error: {exc!r}"
            if problem is None and time.monotonic() - started > REQUEST_TIMEOUT:
                problem = f"hang: response took more than {REQUEST_TIMEOUT:g} s"
            rounds_done += 1
            if problem is not None:
                failures.append((rnd, problem))
                if len(failures) >= MAX_FAILURES:
                    break
                client.close()  # the connection's state is unknown; go on with a new one
                client = RawClient(proxy.port, timeout=REQUEST_TIMEOUT)
                messages.append({"role": "assistant", "content": ""})
                continue
            messages.append({"role": "assistant", "content": "".join(f"tok{i} " for i in range(max_tokens))})
    finally:
        client.close()

    stats = dict(proxy.ctx.pool.stats)
    print(f"soak: {rounds_done} rounds in {time.monotonic() - soak_started:.0f} s, "
          f"upstream idle closes {up.idle_closes}, pool {stats}")
    # The proxy records the last request just after its last byte reaches the client.
    wait_until(lambda: len(recorder.done) >= rounds_done)
    with recorder.lock:
        done = list(recorder.done)
    assert failures == [], f"{len(failures)} failed rounds of {rounds_done}: {failures}; pool {stats}"
    assert rounds_done == ROUNDS

    # The proxy agrees: every request OK, all on the one client connection.
    assert len(done) == ROUNDS
    bad = [d for d in done if d["outcome"] != "OK"]
    assert bad == [], bad[:5]
    assert len({d["client_conn"] for d in done}) == 1

    # A resend happens only after a failure on a reused connection, goes to a fresh
    # one, and never runs a round twice on the engine.
    for d in done:
        assert len(d["attempts"]) in (1, 2), d
        if len(d["attempts"]) == 2:
            assert d["attempts"][0] == (True, "SRC") and d["attempts"][1][0] is False, d
    resent = sum(len(d["attempts"]) == 2 for d in done)
    assert resent == stats.get("stale_retried", 0)
    assert up.requests == ROUNDS, f"engine ran {up.requests} requests for {ROUNDS} rounds"

    # The race was real: the upstream closed idle connections, so the proxy had to
    # open new ones, and it still reused live ones.
    assert up.idle_closes > 0
    assert stats["opened"] > 1, stats
    assert stats["reused"] > 0, stats
    assert not proxy.ctx.in_flight
