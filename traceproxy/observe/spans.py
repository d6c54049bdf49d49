"""From a finished request to its spans, in two steps on two sides of a pipe.

``summarize`` runs in the proxy process, once per request, and only copies what the
spans need into a flat tuple (cheap: no formatting, no JSON). ``spans_for`` runs in
the exporter process and builds the SERVER span, one CLIENT span per upstream
attempt, the marks as span events and every attribute, including the GenAI ones
parsed from the kept request and response bytes.

Times: marks are monotonic nanoseconds; ``clock_offset_ns`` (unix minus monotonic,
read by the proxy) turns them into wall-clock times here, at export.
"""

from __future__ import annotations

from typing import NamedTuple

from ..lifecycle.flags import BY_CODE
from ..lifecycle.marks import MARK, UPSTREAM_MARKS, Mark
from ..lifecycle.timeline import RequestRecord
from ..lifecycle.token_progress import token_progress
from . import semconv as sc
from .genai_spans import _response_attributes, evidence, genai_attributes  # noqa: F401 (_response_attributes: for tests)
from .spandata import KIND_CLIENT, KIND_INTERNAL, KIND_SERVER, STATUS_ERROR, STATUS_UNSET, SpanData, SpanEvent
from .token_view import stall_attributes

DOWNSTREAM_ORDER = tuple(m for m in Mark if m not in UPSTREAM_MARKS)
UPSTREAM_ORDER = tuple(m for m in Mark if m in UPSTREAM_MARKS)
DOWNSTREAM_LABELS = tuple(m.label for m in DOWNSTREAM_ORDER)
UPSTREAM_LABELS = tuple(m.label for m in UPSTREAM_ORDER)
# map(marks.get, ORDER, ZEROS): each mark's time, or 0 when not reached.
_DOWNSTREAM_ZEROS, _UPSTREAM_ZEROS = (0,) * len(DOWNSTREAM_ORDER), (0,) * len(UPSTREAM_ORDER)
# Where each mark sits in a summary's mark tuples.
DOWNSTREAM_INDEX = {mark: i for i, mark in enumerate(DOWNSTREAM_ORDER)}
UPSTREAM_INDEX = {mark: i for i, mark in enumerate(UPSTREAM_ORDER)}
_LAST_UPSTREAM_RX = UPSTREAM_INDEX[Mark.LAST_UPSTREAM_RX_BYTE]
_UPSTREAM_CLOSED = UPSTREAM_INDEX[Mark.UPSTREAM_CLOSED]
_FIRST_DOWNSTREAM_TX_BODY = DOWNSTREAM_INDEX[Mark.FIRST_DOWNSTREAM_TX_BODY_BYTE]
TAIL_BYTES = 4096

# Routes named in span names: low-cardinality paths of OpenAI and SGLang servers.
KNOWN_ROUTES = frozenset({
    "/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/models", "/generate",
    "/health", "/health_generate", "/get_model_info", "/get_server_info", "/server_info", "/model_info",
    "/v1/responses", "/metrics",
})


class AttemptSummary(NamedTuple):
    span_id: int
    index: int
    connection_id: int
    reused: bool
    idle_age_ns: int
    connection_request_number: int
    marks: tuple[int, ...]  # UPSTREAM_ORDER, 0 = not reached
    outcome: str  # "" when the attempt was the request's last
    error: str
    started_ns: int = 0  # when it asked for a connection (0: unknown)
    status: int = 0  # the upstream's response status on it (0: no head came)


class RequestSummary(NamedTuple):
    trace_id: int
    span_id: int
    parent_span_id: int
    sampled: bool
    tracestate: str
    rejected_traceparent: str
    request_id: str
    method: str
    target: str
    http_version: str
    status: int
    outcome: str
    error: str
    start_ns: int
    end_ns: int
    clock_offset_ns: int
    marks: tuple[int, ...]  # DOWNSTREAM_ORDER, 0 = not reached
    client_peer: str
    client_connection_id: int
    sequence: int
    idle_gap_ns: int  # -1 for the first request on a connection
    user_agent: str
    server: tuple[str, int]  # the proxy's listen address
    upstream: tuple[str, int]
    request_body_bytes: int
    response_body_bytes: int
    chunks: int
    max_chunk_gap_ns: int
    request_body_head: bytes
    response_tail: bytes
    request_body_tail: bytes
    attempts: tuple[AttemptSummary, ...]
    stalls: tuple[tuple[str, str, int, int, int], ...] = ()  # code, phase, since, detected, resolved (0: no)
    genai: tuple = ()  # genai_spans.GenAIEvidence as a plain tuple, () when there is none
    # Where the engines had it when it ended (engine_join; EngineStage.as_dict), when known.
    engine_stage: dict | None = None


def summarize(record: RequestRecord, clock_offset_ns: int, server: tuple[str, int],
              upstream: tuple[str, int], engine_stage: dict | None = None) -> RequestSummary:
    """A kept request, for its spans (only kept requests are summarized)."""
    marks = record.marks
    tail = b"".join(read[-TAIL_BYTES:] for read in record.response_tail)
    # Every field, in order, through tuple.__new__: the named tuple's generated __new__
    # (a Python function of forty arguments) was a third of this, once per request.
    return _new_tuple(RequestSummary, (
        record.trace_id, record.span_id, record.parent_span_id, record.sampled,
        record.tracestate.decode("latin-1"), (record.rejected_traceparent or b"").decode("latin-1"),
        record.request_id, record.method, record.target, record.http_version, record.status or 0,
        record.outcome.code, record.error or "", marks.get(MARK.FIRST_DOWNSTREAM_RX_BYTE) or record.end_ns,
        record.end_ns, clock_offset_ns, tuple(map(marks.get, DOWNSTREAM_ORDER, _DOWNSTREAM_ZEROS)),
        record.connection.peer, record.connection.id, record.sequence,
        -1 if record.idle_gap_ns is None else record.idle_gap_ns, record.user_agent, server, upstream,
        record.downstream_rx_body_bytes, record.downstream_tx_body_bytes, record.upstream_rx_chunks,
        record.max_chunk_gap_ns, record.request_body_head, tail, record.request_body_tail,
        tuple(map(_summarize_attempt, record.attempts)),
        tuple([(e.code, e.phase, e.since_ns, e.detected_ns, e.resolved_ns or 0) for e in record.stalls])
        if record.stalls else (),
        evidence(record), engine_stage,
    ))


def _summarize_attempt(attempt) -> AttemptSummary:
    conn = attempt.connection
    return _new_tuple(AttemptSummary, (
        attempt.span_id, attempt.index, conn.id if conn else 0, attempt.reused, attempt.idle_age_ns,
        attempt.connection_request_number, tuple(map(attempt.marks.get, UPSTREAM_ORDER, _UPSTREAM_ZEROS)),
        attempt.outcome.code if attempt.outcome else "", attempt.error or "", attempt.started_ns, attempt.status,
    ))


# ----------------------------------------------------------------------------------
# In the exporter process
# ----------------------------------------------------------------------------------
def spans_for(s: RequestSummary) -> list[SpanData]:
    route = _route(s.target)
    events = _events(DOWNSTREAM_LABELS, s.marks, s.clock_offset_ns)
    if s.stalls:
        events = tuple(sorted(events + _stall_events(s), key=lambda e: e.time_unix_ns))
    server_span = SpanData(
        s.trace_id, s.span_id, s.parent_span_id, _span_name(s.method, route), KIND_SERVER,
        s.start_ns + s.clock_offset_ns, s.end_ns + s.clock_offset_ns, _server_attributes(s, route),
        events, *_status(s.outcome, s.status, s.error),
        s.tracestate, s.sampled, parent_is_remote=bool(s.parent_span_id),
    )
    spans = [server_span]
    for attempt in s.attempts:
        spans.append(_client_span(s, attempt, route))
    return spans


def _span_name(method: str, route: str) -> str:
    """``{method} {route}``; "HTTP" for a request refused before its method was read,
    as the HTTP semantic conventions name a span whose method is unknown."""
    method = method or "HTTP"
    return f"{method} {route}" if route else method


def _client_span(s: RequestSummary, a: AttemptSummary, route: str) -> SpanData:
    stamped = [t for t in a.marks if t]
    start = a.started_ns or (min(stamped) if stamped else s.end_ns)
    # It ends at its last byte; one that failed and was resent, when its connection
    # went; otherwise (failed or cut) with the request.
    end = a.marks[_LAST_UPSTREAM_RX] or (a.outcome and a.marks[_UPSTREAM_CLOSED]) or s.end_ns
    outcome = a.outcome or s.outcome
    attrs = {
        sc.HTTP_REQUEST_METHOD: s.method,
        sc.SERVER_ADDRESS: s.upstream[0],
        sc.SERVER_PORT: s.upstream[1],
        sc.NETWORK_PEER_ADDRESS: s.upstream[0],
        sc.NETWORK_PEER_PORT: s.upstream[1],
        sc.URL_FULL: f"http://{s.upstream[0]}:{s.upstream[1]}{s.target}",
    }
    if a.connection_id:  # none for an attempt whose connect failed (or never began)
        attrs.update({
            sc.UPSTREAM_CONNECTION_ID: a.connection_id,
            sc.UPSTREAM_CONNECTION_REUSED: a.reused,
            sc.UPSTREAM_CONNECTION_IDLE_AGE: a.idle_age_ns / 1e9,
            sc.UPSTREAM_CONNECTION_REQUEST_NUMBER: a.connection_request_number,
        })
    attrs[sc.OUTCOME] = outcome
    attrs[sc.BLAME] = BY_CODE[outcome].blame.value
    if a.index:
        attrs[sc.HTTP_REQUEST_RESEND_COUNT] = a.index
    # The upstream's status only: not the proxy's own reply (502, 504) to a failed attempt.
    upstream_status = a.status
    if upstream_status:
        attrs[sc.HTTP_RESPONSE_STATUS_CODE] = upstream_status
    status = _status(outcome, upstream_status, a.error or s.error, client=True)
    if status[0] == STATUS_ERROR:
        attrs[sc.ERROR_TYPE] = BY_CODE[outcome].name
    return SpanData(
        s.trace_id, a.span_id, s.span_id, _span_name(s.method, route), KIND_CLIENT,
        start + s.clock_offset_ns, end + s.clock_offset_ns, attrs,
        _events(UPSTREAM_LABELS, a.marks, s.clock_offset_ns), *status, s.tracestate, s.sampled,
    )


def _server_attributes(s: RequestSummary, route: str) -> dict:
    path, _, query = s.target.partition("?")
    host, _, port = s.client_peer.rpartition(":")
    attrs = {
        sc.HTTP_REQUEST_METHOD: s.method or "_OTHER",  # the conventions' word for a method not known
        sc.URL_PATH: path,
        sc.URL_SCHEME: "http",
        sc.SERVER_ADDRESS: s.server[0],
        sc.SERVER_PORT: s.server[1],
        sc.CLIENT_ADDRESS: host,
        sc.NETWORK_PEER_ADDRESS: host,
        sc.NETWORK_PROTOCOL_VERSION: s.http_version,
        sc.HTTP_REQUEST_BODY_SIZE: s.request_body_bytes,
        sc.HTTP_RESPONSE_BODY_SIZE: s.response_body_bytes,
        sc.REQUEST_ID: s.request_id,
        sc.OUTCOME: s.outcome,
        sc.OUTCOME_NAME: BY_CODE[s.outcome].name,
        sc.BLAME: BY_CODE[s.outcome].blame.value,
        sc.CLIENT_CONNECTION_ID: s.client_connection_id,
        sc.CLIENT_REQUEST_SEQUENCE: s.sequence,
        sc.ATTEMPTS: len(s.attempts),
        sc.CHUNKS: s.chunks,
        sc.CHUNK_MAX_GAP: s.max_chunk_gap_ns / 1e9,
        sc.STALLS: len(s.stalls),
    }
    if port.isdigit():
        attrs[sc.CLIENT_PORT] = attrs[sc.NETWORK_PEER_PORT] = int(port)
    if query:
        attrs[sc.URL_QUERY] = query
    if route:
        attrs[sc.HTTP_ROUTE] = route
    if s.status:
        attrs[sc.HTTP_RESPONSE_STATUS_CODE] = s.status
    if s.user_agent:
        attrs[sc.USER_AGENT_ORIGINAL] = s.user_agent
    if s.idle_gap_ns >= 0:
        attrs[sc.CLIENT_IDLE_GAP] = s.idle_gap_ns / 1e9
    if s.rejected_traceparent:
        attrs[sc.REJECTED_TRACEPARENT] = s.rejected_traceparent
    if s.error:
        attrs[sc.ERROR_MESSAGE] = s.error
    if BY_CODE[s.outcome].blame.value != "-" or s.status >= 500:
        attrs[sc.ERROR_TYPE] = BY_CODE[s.outcome].name if s.outcome != "OK" else str(s.status)
    if s.engine_stage:  # where the engines had it when it ended: diagnose reads it after the fact
        attrs.update(engine_stage_attributes(s.engine_stage))
    attrs.update(genai_attributes(path, s, s.marks[_FIRST_DOWNSTREAM_TX_BODY]))
    return attrs


def _stall_events(s: RequestSummary) -> tuple[SpanEvent, ...]:
    events = []
    for code, phase, since, detected, resolved in s.stalls:
        attrs = {sc.STALL_OUTCOME: code, sc.STALL_PHASE: phase, sc.BLAME: BY_CODE[code].blame.value,
                 sc.STALL_WAITED: (detected - since) / 1e9}
        events.append(SpanEvent("stall", detected + s.clock_offset_ns, attrs))
        if resolved:
            events.append(SpanEvent("stall_resolved", resolved + s.clock_offset_ns,
                                    {sc.STALL_OUTCOME: code, sc.STALL_DURATION: (resolved - since) / 1e9}))
    return tuple(events)




def stall_span(record: RequestRecord, code: str, phase: str, since_ns: int, detected_ns: int,
               clock_offset_ns: int, span_id: int, engines: str = "") -> SpanData:
    """The span sent the moment a stall is detected, in the request's trace, so a hung
    request shows in the trace viewer while it is still hung.

    ``engines``: the engines' latest gauges (``running=1 queued=0 ...``) when the
    engine scraper is on; empty leaves the attribute out. An event stream's stall span
    also has its output events and heartbeats so far and the seconds since its last token
    (or, with none yet, since the response head); a request with a conversation id, that."""
    outcome = BY_CODE[code]
    attrs = {
        sc.STALL_OUTCOME: code, sc.OUTCOME_NAME: outcome.name, sc.BLAME: outcome.blame.value,
        sc.STALL_PHASE: phase, sc.STALL_WAITED: (detected_ns - since_ns) / 1e9,
        sc.REQUEST_ID: record.request_id, sc.HTTP_REQUEST_METHOD: record.method,
        sc.URL_PATH: record.target.partition("?")[0], sc.CLIENT_CONNECTION_ID: record.connection.id,
        sc.CLIENT_REQUEST_SEQUENCE: record.sequence,
        # The span starts when the stall's wait began; this dates the request itself.
        sc.STALL_REQUEST_AGE: (detected_ns - record.marks.get(MARK.FIRST_DOWNSTREAM_RX_BYTE, since_ns)) / 1e9,
    }
    attempt = record.attempt
    if attempt is not None and attempt.connection is not None:
        attrs[sc.UPSTREAM_CONNECTION_ID] = attempt.connection.id
        attrs[sc.UPSTREAM_CONNECTION_REUSED] = attempt.reused
    if engines:
        attrs[sc.STALL_ENGINES] = engines
    progress = token_progress(record)
    if progress is not None:  # an event stream: its tokens as they stood
        attrs.update(stall_attributes(progress, detected_ns))
    if record.conversation_id:
        attrs[sc.GEN_AI_CONVERSATION_ID] = record.conversation_id
    return SpanData(record.trace_id, span_id, record.span_id, f"stall {code} {phase}", KIND_INTERNAL,
                    since_ns + clock_offset_ns, detected_ns + clock_offset_ns, attrs, (), STATUS_ERROR,
                    f"{outcome.meaning} Waited {(detected_ns - since_ns) / 1e9:.1f} s.",
                    record.tracestate.decode("latin-1"), record.sampled)


def engine_stage_attributes(stage: dict) -> dict:
    """The attributes of an ``engine_stage`` (``EngineStage.as_dict``), for a stall span
    and a request's SERVER span: the component and stage, the worker, since when, and
    what says so."""
    attrs = {sc.ENGINE_COMPONENT: stage["component"], sc.ENGINE_ROLE: stage["role"],
             sc.ENGINE_STAGE_STATE: stage["state"], sc.ENGINE_SOURCE: stage["source"]}
    if stage.get("stage"):
        attrs[sc.ENGINE_STAGE] = stage["stage"]
    if stage.get("since_s") is not None:
        attrs[sc.ENGINE_STAGE_SINCE] = stage["since_s"]
    if stage.get("detail"):
        attrs[sc.ENGINE_DETAIL] = stage["detail"]
    worker = stage.get("worker") or {}
    for key, name in (("service", sc.ENGINE_WORKER_SERVICE), ("host", sc.ENGINE_WORKER_HOST),
                      ("pid", sc.ENGINE_WORKER_PID)):
        if worker.get(key) is not None:
            attrs[name] = worker[key]
    return attrs


def _route(target: str) -> str:
    path = target.partition("?")[0]
    return path if path in KNOWN_ROUTES else ""


def _events(labels: tuple[str, ...], marks: tuple[int, ...], offset: int) -> tuple[SpanEvent, ...]:
    """The reached marks as events, in time order (two marks can share a time: the
    order of the edges then breaks the tie)."""
    stamped = sorted((t, i) for i, t in enumerate(marks) if t)
    # tuple.__new__ builds the same SpanEvent without NamedTuple's Python-level
    # __new__ (about a third of this function's cost, ~15 events a request).
    return tuple(_new_tuple(SpanEvent, (labels[i], t + offset, None)) for t, i in stamped)


_new_tuple = tuple.__new__


def _status(outcome: str, http_status: int, error: str, client: bool = False) -> tuple[int, str]:
    """A request (or attempt) that did not end OK is an error, whoever is to blame (its
    outcome says whose: a 400 the proxy refused is the client's). One that ended OK is
    judged by its status as the HTTP conventions say: 5xx is an error; 4xx only on the
    CLIENT side (the server side answered a bad request correctly)."""
    if outcome != "OK":
        return STATUS_ERROR, error or BY_CODE[outcome].meaning
    if http_status >= (400 if client else 500):
        return STATUS_ERROR, f"HTTP {http_status}"
    return STATUS_UNSET, ""
