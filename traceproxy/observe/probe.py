"""The stall probe: is it the connection, or the engine?

When a request stalls waiting on the upstream (``FBS`` first byte, ``MSS`` mid-stream,
``UCS`` connecting), the prober opens a *fresh* connection to the same upstream (never
one from the pool), sends ``GET probe_path`` and waits at most ``timeout`` for the
response's status line:

* an answer means the engine serves fresh connections: when the stalled request waits
  on a reused connection, that points at a connection-state fault (fresh works);
* no answer (timeout, refused, reset) means the engine is unresponsive (fresh hangs too).

Off the request path: ``on_stall`` only starts a task. At most one probe is in flight
per upstream; a stall that finds one running gets no probe of its own. Results are
kept per request (the most recent ``KEEP`` requests), logged, and shown in
``/debug/inflight`` under the request's ``probe``.

This module imports ``lifecycle`` only.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time

from ..lifecycle.stall import Judgement
from ..lifecycle.timeline import RequestRecord, StallEntry

log = logging.getLogger("traceproxy.probe")

PROBED_OUTCOMES = frozenset({"FBS", "MSS", "UCS"})
FRESH_WORKS = "connection-state fault (fresh works)"
FRESH_WORKS_NEW = "engine answers fresh connections; this request itself is stuck"
FRESH_HANGS = "engine unresponsive (fresh hangs too)"


class StallProber:
    """A stall listener; ``host``/``port`` name the upstream, ``authority`` its Host header."""

    KEEP = 256

    def __init__(self, host: str, port: int, path: str, timeout: float, authority: str) -> None:
        self.host = host
        self.port = port
        self.path = path  # validated by the config: starts with /
        self.timeout = timeout
        self.authority = authority
        self.results: collections.OrderedDict[int, dict] = collections.OrderedDict()
        self.in_flight: asyncio.Task | None = None
        self.probes = 0

    # -- stall listener ----------------------------------------------------------
    def on_stall(self, record: RequestRecord, judgement: Judgement, entry: StallEntry) -> None:
        if entry.code not in PROBED_OUTCOMES:
            return
        if self.in_flight is not None and not self.in_flight.done():
            return  # at most one probe at a time
        attempt = record.attempt
        conn = attempt.connection if attempt is not None else None
        waiting_on = None if conn is None else (conn.id, bool(attempt.reused))
        self.probes += 1
        self.in_flight = asyncio.get_running_loop().create_task(self._run(record, entry, waiting_on))

    def on_stall_resolved(self, record: RequestRecord, entry: StallEntry) -> None:
        pass

    # -- reading -------------------------------------------------------------------
    def result_for(self, record_id: int) -> dict | None:
        return self.results.get(record_id)

    def stop(self) -> None:
        if self.in_flight is not None and not self.in_flight.done():
            self.in_flight.cancel()

    # -- the probe -------------------------------------------------------------------
    async def _run(self, record: RequestRecord, entry: StallEntry, waiting_on: tuple[int, bool] | None) -> None:
        started = time.monotonic_ns()
        status, error = await self._probe()
        elapsed_ms = (time.monotonic_ns() - started) / 1e6
        if waiting_on is None:
            where = "while the request has no upstream connection yet"
        else:
            where = f"while the request waits on {'reused' if waiting_on[1] else 'new'} connection #{waiting_on[0]}"
        if status is not None:
            verdict = FRESH_WORKS if waiting_on is None or waiting_on[1] else FRESH_WORKS_NEW
            detail = f"fresh connection answered {status} in {elapsed_ms:.0f} ms {where}"
        else:
            verdict = FRESH_HANGS
            detail = f"fresh connection {error} after {elapsed_ms:.0f} ms {where}"
        result = {
            "stall": entry.code,
            "path": self.path,
            "fresh_works": status is not None,
            "status": status,
            "elapsed_ms": round(elapsed_ms, 1),
            "error": error,
            "upstream_connection": waiting_on[0] if waiting_on else None,
            "upstream_reused": waiting_on[1] if waiting_on else None,
            "verdict": verdict,
            "detail": detail,
        }
        self.results[record.id] = result
        while len(self.results) > self.KEEP:
            self.results.popitem(last=False)
        log.warning("stall %s probe: %s -> %s; trace_id=%032x request_id=%s", entry.code, detail, verdict,
                    record.trace_id, record.request_id)

    async def _probe(self) -> tuple[int | None, str | None]:
        """(status, None) when a status line came in time, else (None, what went wrong)."""
        writer = None
        try:
            async with asyncio.timeout(self.timeout):
                reader, writer = await asyncio.open_connection(self.host, self.port)
                writer.write(f"GET {self.path} HTTP/1.1\r\nHost: {self.authority}\r\n"
                             f"User-Agent: traceproxy-probe\r\nConnection: close\r\n\r\n".encode("latin-1"))
                line = await reader.readline()
            parts = line.split(None, 2)
            if len(parts) < 2 or not parts[0].startswith(b"HTTP/") or not parts[1].isdigit():
                return None, "closed without a response" if not line else "answered with no HTTP status line"
            return int(parts[1]), None
        except TimeoutError:
            return None, f"got no answer within {self.timeout:g} s"
        except OSError as exc:
            return None, f"failed ({exc.strerror or type(exc).__name__})"
        except Exception as exc:  # whatever else went wrong is this probe's result, never silence
            return None, f"failed ({type(exc).__name__}: {exc})"
        finally:
            if writer is not None:
                writer.transport.abort()
