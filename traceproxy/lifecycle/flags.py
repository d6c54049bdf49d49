"""THE outcome vocabulary: every way a request can end, defined once.

Theory of operation
-------------------
Each row is an outcome with a short code (Envoy's response-flag code where the
meaning matches), a long name, the side to blame and a one-line meaning. Span
attributes, log lines, metric labels, error responses and ``docs/outcomes.md`` all
read this table; nothing else in the project types an outcome string.

Blame is one of exactly four words (``Blame``): the side that owed the next byte
when the request went wrong. ``OK`` has no one to blame and says so with
``Blame.NONE``, which is never shown as a fifth blame word: it renders as "-".
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Blame(str, enum.Enum):
    CLIENT = "client"
    PROXY = "proxy"
    ENGINE = "engine"
    UNKNOWN = "unknown"
    NONE = "-"


@dataclass(frozen=True)
class Outcome:
    code: str
    name: str
    blame: Blame
    meaning: str
    # The status the proxy answers with when it ends the request itself and no
    # response has started yet; None when the proxy never writes a local reply.
    local_status: int | None = None

    @property
    def is_ok(self) -> bool:
        return self.code == "OK"


class Flag:
    """Namespace of every outcome; iterate with ``ALL``."""

    OK = Outcome("OK", "ok", Blame.NONE, "The response was delivered completely.")
    DC = Outcome(
        "DC", "downstream_connection_termination", Blame.CLIENT,
        "The client closed its connection before the response was complete.",
    )
    DPE = Outcome(
        "DPE", "downstream_protocol_error", Blame.CLIENT,
        "The client sent a malformed or ambiguous request; it was rejected, not forwarded: 400, or 414 "
        "(target too long), 417 (Expect), 431 (head too large), 501 (upgrade, CONNECT, a method it cannot carry), 505 (HTTP version).",
        400,
    )
    DHT = Outcome(
        "DHT", "downstream_header_timeout", Blame.CLIENT,
        "The client did not send a complete request head within the header timeout.",
        408,
    )
    DBT = Outcome(
        "DBT", "downstream_body_timeout", Blame.CLIENT,
        "The client stopped sending its request body for longer than the body timeout.",
        408,
    )
    DO = Outcome(
        "DO", "downstream_overflow", Blame.PROXY,
        "The client connection limit was reached with no idle connection to close.",
        503,
    )
    UF = Outcome(
        "UF", "upstream_connection_failure", Blame.ENGINE,
        "The proxy could not connect to the upstream (refused, unreachable or connect timeout).",
        502,
    )
    UT = Outcome(
        "UT", "upstream_request_timeout", Blame.ENGINE,
        "The upstream sent no response headers within the upstream header timeout.",
        504,
    )
    UPE = Outcome(
        "UPE", "upstream_protocol_error", Blame.ENGINE,
        "The upstream sent a malformed HTTP response.",
        502,
    )
    UC = Outcome(
        "UC", "upstream_connection_termination", Blame.ENGINE,
        "The upstream closed the connection before its response was complete.",
        502,
    )
    SI = Outcome(
        "SI", "stream_idle_timeout", Blame.ENGINE,
        "The upstream response body went silent for longer than the upstream read timeout.",
        504,
    )
    SRC = Outcome(
        "SRC", "stale_reused_connection", Blame.PROXY,
        "A reused pooled upstream connection was closed before any response byte. The request "
        "ends so only when it was too large to resend; a resent one keeps it on its failed attempt.",
        502,
    )
    URX = Outcome(
        "URX", "upstream_retry_limit_exceeded", Blame.ENGINE,
        "The request failed on a stale reused connection and again on a fresh one.",
        502,
    )
    # -- stalls: live verdicts while a request waits; the local status is what the
    #    watchdog's abort action answers with when no response has started yet

    DHS = Outcome(
        "DHS", "downstream_header_stall", Blame.CLIENT,
        "The client started a request head and stopped sending it.",
        408,
    )
    DBS = Outcome(
        "DBS", "downstream_body_stall", Blame.CLIENT,
        "The client stopped sending its request body while the proxy was ready to take it.",
        408,
    )
    PWS = Outcome(
        "PWS", "pool_wait_stall", Blame.PROXY,
        "The request waits for a free upstream connection: the pool is at its connection cap.",
        504,
    )
    UCS = Outcome(
        "UCS", "upstream_connect_stall", Blame.ENGINE,
        "The proxy is still connecting to the upstream: it does not accept the connection.",
        504,
    )
    FBS = Outcome(
        "FBS", "first_byte_stall", Blame.ENGINE,
        "The request went upstream and no response header arrived (router queue or prefill); for an event "
        "stream, no event with output arrived (heartbeats do not count).",
        504,
    )
    MSS = Outcome(
        "MSS", "mid_stream_stall", Blame.ENGINE,
        "The response started and the upstream went silent between chunks (decode); for an event stream, "
        "sent no event with output, whatever heartbeats it sent.",
        504,
    )
    DNR = Outcome(
        "DNR", "downstream_not_reading", Blame.CLIENT,
        "Response bytes are waiting because the client is not reading (its transport is paused).",
        504,
    )
    PFS = Outcome(
        "PFS", "proxy_forward_stall", Blame.PROXY,
        "Upstream bytes arrived and were not written to the client, whose transport is not paused.",
        504,
    )
    # -- engine correlation (``correlation``): verdicts from comparing the proxy's view
    #    with the engines' /metrics. Never a finished request's outcome, never a local reply.
    EOR = Outcome(
        "EOR", "engine_orphan", Blame.ENGINE,
        "The engines report requests in flight that no proxied request explains, for longer than "
        "engines.orphan_after (a leaked queue slot or abandoned work); no client request is blamed.",
    )
    LST = Outcome(
        "LST", "lost_before_engine", Blame.UNKNOWN,
        "A request waits for its response head while the engines report nothing queued or running: "
        "it was lost between the proxy and the engines, in the router or the network.",
    )
    ESL = Outcome(
        "ESL", "engine_slow", Blame.ENGINE,
        "A request waits at a phase while the engines report requests in flight at that phase: "
        "the engines have the work and are slow with it.",
    )
    # -- how a response ended, checked at the end
    NDN = Outcome(
        "NDN", "stream_without_done", Blame.ENGINE,
        "An SSE response ended cleanly but without data: [DONE] (the stream may be incomplete).",
    )
    USE = Outcome(
        "USE", "upstream_stream_error", Blame.ENGINE,
        "The upstream reported inside its event stream that the response failed: an event whose JSON is a "
        "top-level error (as smg sends when an engine fails mid-stream), whether the stream then ended cleanly "
        "or the client left after it. The client got the bytes unchanged.",
    )
    PFE = Outcome(
        "PFE", "proxy_framing_error", Blame.PROXY,
        "The proxy wrote a response whose framing does not match what it sent (a proxy bug).",
    )
    LR = Outcome(
        "LR", "local_reset", Blame.PROXY,
        "The proxy ended the request itself: its shutdown grace period ran out, or the "
        "connection it was pipelined on closed before its turn.",
        503,
    )

    ALL: tuple[Outcome, ...] = ()


Flag.ALL = tuple(v for v in vars(Flag).values() if isinstance(v, Outcome))
BY_CODE: dict[str, Outcome] = {o.code: o for o in Flag.ALL}


def outcomes_markdown() -> str:
    """The ``docs/outcomes.md`` table, generated so the docs cannot drift."""
    lines = [
        "# Outcomes",
        "",
        "Every finished request has exactly one outcome. Generated from",
        "`traceproxy/lifecycle/flags.py`; do not edit by hand.",
        "",
        "| code | name | blame | local status | meaning |",
        "|---|---|---|---|---|",
    ]
    for o in Flag.ALL:
        status = str(o.local_status) if o.local_status else "-"
        lines.append(f"| {o.code} | {o.name} | {o.blame.value} | {status} | {o.meaning} |")
    return "\n".join(lines) + "\n"
