"""The multi-turn agent harness: C conversations x R streaming turns, every byte timed.

Each conversation is an agent loop: the messages accumulate turn after turn (the
assistant's streamed reply and the next user message are appended), so the context
grows the way a real agent's does. Connection reuse is exact:

* ``reused``: the whole conversation on ONE keep-alive connection (turn N is use N
  of that connection), unless the server closes it, in which case the next turn
  opens a new one and says so;
* ``fresh``: a new connection per turn, closed after the response.

``both`` (the default) runs the two side by side, because the original clue was
that fresh connections worked. Conversations run concurrently, one thread each.

Every turn carries the harness's own ``x-request-id`` (so the id is known even if
nothing comes back) and records the proxy's ``traceresponse`` when it arrives.
When a turn hangs past ``turn_timeout``, the harness asks the proxy's admin
listener where that request is (``inflight.ask_proxy``) *before* closing the
connection, since closing it would end the request at the proxy. A conversation
stops at its first hung or failed turn, as a real agent would.

Bounds: turns per conversation, the per-turn timeout, the connect and admin
timeouts, and ``MAX_CONVERSATIONS``.
"""

from __future__ import annotations

import json
import secrets
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_all
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import h11

from .client import COMPLETE, TIMEOUT, ClientConnection, Exchange, connect
from .inflight import (ADMIN_TIMEOUT_S, AdminError, Diagnosis, ask_proxy, fetch_inflight_document, parse_admin,
                       span_file_of)

REUSED, FRESH, BOTH = "reused", "fresh", "both"
MODES = (REUSED, FRESH, BOTH)
OK, HUNG, FAILED = "ok", "hung", "failed"
DEFAULT_PATH = "/v1/chat/completions"
MAX_CONVERSATIONS = 200
MAX_TURNS = 1000
CONNECT_TIMEOUT_S = 5.0
USER_AGENT = "traceproxy-repro"
TOOL_OUTPUT = "tool output: " + "lorem ipsum dolor sit amet " * 8  # what each turn adds besides the reply


class UsageError(ValueError):
    """Arguments the harness cannot run with (exit status 2)."""


class TargetUnreachable(Exception):
    """The proxy (or its admin listener) does not answer at all (exit status 2)."""


@dataclass
class TurnRecord:
    """One turn as the client saw it. Times are seconds since the request was sent."""

    mode: str
    conversation: int
    turn: int
    request_id: str
    connection: int = 0  # the harness's number for the connection (0: none was opened)
    connection_use: int = 0  # 1 = the first request on that connection
    local_port: int = 0
    note: str = ""
    result: str = FAILED
    error: str = ""
    status: int | None = None
    trace_id: str | None = None
    echoed_request_id: str | None = None
    request_bytes: int = 0
    response_bytes: int = 0
    context_messages: int = 0
    events: int = 0
    done_seen: bool = False
    head_s: float | None = None
    first_body_s: float | None = None
    last_byte_s: float | None = None
    elapsed_s: float = 0.0
    diagnosis: Diagnosis | None = None
    span_file: str | None = None  # the proxy's span file, when its admin listener said: for the diagnose hint


@dataclass
class ReproResult:
    url: str
    admin: str | None
    modes: tuple[str, ...]
    conversations: int
    turns: int
    turn_timeout: float
    records: list[TurnRecord] = field(default_factory=list)
    elapsed_s: float = 0.0

    def count(self, result: str, mode: str | None = None) -> int:
        return sum(1 for r in self.records if r.result == result and (mode is None or r.mode == mode))

    @property
    def hung(self) -> list[TurnRecord]:
        return [r for r in self.records if r.result == HUNG]

    @property
    def failed(self) -> list[TurnRecord]:
        return [r for r in self.records if r.result == FAILED]

    @property
    def exit_code(self) -> int:
        """0: every turn ok; 1: something hung or failed."""
        return 1 if self.hung or self.failed else 0


@dataclass(frozen=True)
class Plan:
    """Everything a conversation needs, shared read-only by all of them."""

    host: str
    port: int
    path: str
    admin: tuple[str, int] | None
    turns: int
    turn_timeout: float
    model: str
    max_tokens: int
    think: float
    extra_headers: tuple[tuple[str, str], ...]
    run_token: str
    numbering: "Numbering"
    on_turn: Callable[[TurnRecord], None] | None
    stop: threading.Event  # set on Ctrl-C: no new turns start
    span_file: str | None = None  # the proxy's span file, when its admin listener said


class Numbering:
    """Connection numbers, unique across the run and all its threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last = 0

    def next(self) -> int:
        with self._lock:
            self._last += 1
            return self._last


# ----------------------------------------------------------------------------------
# Arguments
# ----------------------------------------------------------------------------------
def parse_url(url: str) -> tuple[str, int]:
    """``http://HOST:PORT`` -> (host, port); raises UsageError."""
    try:
        parts = urlsplit(url.strip())
        port = parts.port
    except ValueError:  # an unclosed IPv6 bracket, a port that is not a number in range
        raise UsageError(f"expected http://HOST:PORT (plain HTTP/1.1), got {url!r}") from None
    if parts.scheme != "http" or not parts.hostname or any(c.isspace() for c in url.strip()):
        raise UsageError(f"expected http://HOST:PORT (plain HTTP/1.1), got {url!r}")
    if parts.path not in ("", "/") or parts.query:
        raise UsageError(f"give the URL without a path ({url!r}); the request path is --path")
    if port == 0:
        raise UsageError(f"port 0 in {url!r} is no server's port")
    return parts.hostname, 80 if port is None else port


def modes_for(mode: str) -> tuple[str, ...]:
    if mode not in MODES:
        raise UsageError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    return (REUSED, FRESH) if mode == BOTH else (mode,)


def _check_counts(conversations: int, turns: int, turn_timeout: float, think: float) -> None:
    if not 1 <= conversations <= MAX_CONVERSATIONS:
        raise UsageError(f"conversations must be 1..{MAX_CONVERSATIONS}, got {conversations}")
    if not 1 <= turns <= MAX_TURNS:
        raise UsageError(f"turns must be 1..{MAX_TURNS}, got {turns}")
    if not 0 < turn_timeout <= 3600:
        raise UsageError(f"turn timeout must be above 0 and at most 3600 s, got {turn_timeout}")
    if not 0 <= think <= 600:
        raise UsageError(f"think time must be 0..600 s, got {think}")


def _check_reachable(host: str, port: int, admin: tuple[str, int] | None) -> str | None:
    """Raises TargetUnreachable; returns the span file the admin listener names, if any."""
    try:
        connect(host, port, 0, CONNECT_TIMEOUT_S).close()
    except OSError as exc:
        raise TargetUnreachable(f"cannot connect to {host}:{port}: {exc.strerror or exc}") from None
    if admin is None:
        return None
    try:
        return span_file_of(fetch_inflight_document(admin))
    except AdminError as exc:
        raise TargetUnreachable(str(exc)) from None


# ----------------------------------------------------------------------------------
# The stream
# ----------------------------------------------------------------------------------
def parse_stream(body: bytes) -> tuple[int, bool, str]:
    """An SSE chat stream -> (data events, saw ``data: [DONE]``, the assistant's text)."""
    events, done, text = 0, False, []
    for line in body.split(b"\n"):
        line = line.strip()
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        events += 1
        if payload == b"[DONE]":
            done = True
            continue
        text.append(_delta_text(payload))
    return events, done, "".join(text)


def _delta_text(payload: bytes) -> str:
    try:
        chunk = json.loads(payload)
        content = chunk["choices"][0]["delta"].get("content")
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        return ""
    return content if isinstance(content, str) else ""


def trace_id_of(traceresponse: str | None) -> str | None:
    """The trace id of a W3C ``traceresponse`` (``00-<trace>-<span>-<flags>``)."""
    parts = (traceresponse or "").strip().split("-")
    if len(parts) == 4 and len(parts[1]) == 32:
        try:
            int(parts[1], 16)
        except ValueError:
            return None
        return parts[1].lower()
    return None


# ----------------------------------------------------------------------------------
# A conversation
# ----------------------------------------------------------------------------------
class Conversation:
    def __init__(self, plan: Plan, mode: str, index: int) -> None:
        self.plan, self.mode, self.index = plan, mode, index
        self.messages: list[dict] = [{"role": "system", "content": "You are a coding agent. Be brief."}]
        self.conn: ClientConnection | None = None

    def run(self) -> list[TurnRecord]:
        records: list[TurnRecord] = []
        try:
            for turn in range(1, self.plan.turns + 1):
                if self.plan.stop.is_set():
                    break
                record = self.turn(turn)
                records.append(record)
                if self.plan.on_turn is not None:
                    self.plan.on_turn(record)
                if record.result != OK:
                    break
                if self.plan.think and turn < self.plan.turns:
                    self.plan.stop.wait(self.plan.think)
        finally:
            self._drop_connection()
        return records

    def turn(self, turn: int) -> TurnRecord:
        self.messages.append({"role": "user", "content": f"turn {turn}. {TOOL_OUTPUT}"})
        record = TurnRecord(self.mode, self.index, turn, self._request_id(turn), context_messages=len(self.messages),
                            span_file=self.plan.span_file)
        if not self._ensure_connection(record):
            return record
        record.connection, record.connection_use = self.conn.number, self.conn.uses + 1
        record.local_port = self.conn.local_port
        body = self._body()
        started = time.monotonic()
        answer = self.conn.exchange(self._request(record.request_id, len(body)), body, _deadline(self.plan))
        record.elapsed_s = round(time.monotonic() - started, 6)
        self._read_answer(record, answer)
        if record.result == HUNG:  # ask while the connection is still open: closing it ends the request
            record.diagnosis = ask_proxy(self.plan.admin, record.request_id, answered=record.status is not None)
        if record.result != OK or self.mode == FRESH:
            self._drop_connection()
        return record

    def _request_id(self, turn: int) -> str:
        return f"repro-{self.plan.run_token}-{self.mode}-c{self.index}-t{turn}"

    def _ensure_connection(self, record: TurnRecord) -> bool:
        if self.conn is not None and self.conn.reusable():
            return True
        if self.conn is not None:
            record.note = f"new connection: connection #{self.conn.number} was closed by the server"
            self._drop_connection()
        try:
            self.conn = connect(self.plan.host, self.plan.port, self.plan.numbering.next(), CONNECT_TIMEOUT_S)
        except OSError as exc:
            record.error = f"connect to {self.plan.host}:{self.plan.port} failed: {exc.strerror or exc}"
            return False
        return True

    def _drop_connection(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    def _request(self, request_id: str, length: int) -> h11.Request:
        headers = [*_default_host(self.plan.extra_headers, f"{self.plan.host}:{self.plan.port}"),
                   ("Content-Type", "application/json"), ("Accept", "text/event-stream"), ("User-Agent", USER_AGENT),
                   ("x-request-id", request_id), *self.plan.extra_headers, ("Content-Length", str(length))]
        return h11.Request(method="POST", target=self.plan.path, headers=headers)

    def _body(self) -> bytes:
        return json.dumps({"model": self.plan.model, "stream": True, "max_tokens": self.plan.max_tokens,
                           "messages": self.messages}, separators=(",", ":")).encode()

    def _read_answer(self, record: TurnRecord, answer: Exchange) -> None:
        record.status, record.error = answer.status, answer.error
        record.trace_id = trace_id_of(answer.headers.get("traceresponse"))
        record.echoed_request_id = answer.headers.get("x-request-id")
        record.request_bytes, record.response_bytes = answer.bytes_out, answer.bytes_in
        record.head_s, record.first_body_s, record.last_byte_s = answer.head_s, answer.first_body_s, answer.last_byte_s
        record.events, record.done_seen, text = parse_stream(bytes(answer.body))
        record.result = _judge(answer, record)
        if record.result == OK:
            self.messages.append({"role": "assistant", "content": text})


def _deadline(plan: Plan) -> float:
    return time.monotonic() + plan.turn_timeout


def _judge(answer: Exchange, record: TurnRecord) -> str:
    """OK, HUNG or FAILED; sets ``record.error`` for the failures that have no message yet."""
    if answer.ending == TIMEOUT:
        return HUNG
    if answer.ending != COMPLETE:
        return FAILED
    if answer.status != 200:
        record.error = record.error or f"HTTP {answer.status}: {bytes(answer.body[:200]).decode('utf-8', 'replace')}"
        return FAILED
    if not record.done_seen:
        record.error = "the stream ended without data: [DONE]"
        return FAILED
    return OK


# ----------------------------------------------------------------------------------
# The run
# ----------------------------------------------------------------------------------
# Headers repro sets itself, each for a reason a second copy would undo.
_OWN_HEADERS = {
    "content-length": "repro frames each request body itself",
    "transfer-encoding": "repro frames each request body itself",
    "connection": "--mode decides whether a connection is reused",
    "x-request-id": "repro gives every turn an id of its own, to find it in the proxy",
}


def _default_host(extra_headers, host: str) -> list[tuple[str, str]]:
    """repro's own Host header, unless one is given (it replaces repro's)."""
    return [] if any(name.lower() == "host" for name, _ in extra_headers) else [("Host", host)]


def _check_sendable(path: str, headers: tuple) -> None:
    """A path or header h11 would refuse to send, or one repro sets itself, is a usage
    error, found before any turn runs (a Host given replaces repro's own)."""
    for name, value in headers:
        why = _OWN_HEADERS.get(name.lower())
        if why is not None:
            raise UsageError(f"cannot send the header {name}: {why}")
        if name.lower() == "host" and not value.strip():
            raise UsageError("a Host header needs a value: the host the server is asked for")
    try:
        h11.Request(method="POST", target=path, headers=[*_default_host(headers, "localhost"), *headers])
    except h11.LocalProtocolError as exc:
        detail = f"{exc}: {path!r}" if "target" in str(exc) else str(exc)
        raise UsageError(f"cannot send this request: {detail}") from None


def run_repro(url: str, admin: str | None = None, conversations: int = 2, turns: int = 3,
              turn_timeout: float = 30.0, mode: str = BOTH, extra_headers=None, *,
              path: str = DEFAULT_PATH, model: str = "traceproxy-repro", max_tokens: int = 16,
              think: float = 0.0, on_turn: Callable[[TurnRecord], None] | None = None,
              on_start: Callable[[], None] | None = None) -> ReproResult:
    """Run the harness; raises UsageError or TargetUnreachable before any turn runs.

    ``extra_headers``: (name, value) pairs or a dict, sent on every turn (auth, pacing).
    ``on_start`` is called once the arguments are checked and the target answered, just
    before the first turn (a plan printed earlier would announce a run that never starts).
    ``on_turn`` is called from the conversation threads as each turn ends.
    """
    modes = modes_for(mode)
    _check_counts(conversations, turns, turn_timeout, think)
    if not 1 <= max_tokens <= 1_000_000:
        raise UsageError(f"max_tokens must be 1..1000000, got {max_tokens}")
    if not path.startswith("/"):
        raise UsageError(f"the path must start with '/', got {path!r}")
    headers = tuple((extra_headers or {}).items() if isinstance(extra_headers, dict) else extra_headers or ())
    _check_sendable(path, headers)
    host, port = parse_url(url)
    admin_address = None
    if admin:
        try:
            admin_address = parse_admin(admin)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    span_file = _check_reachable(host, port, admin_address)
    plan = Plan(host, port, path, admin_address, turns, turn_timeout, model, max_tokens, think, headers,
                secrets.token_hex(3), Numbering(), on_turn, threading.Event(), span_file)
    result = ReproResult(url, admin, modes, conversations, turns, turn_timeout)
    if on_start is not None:
        on_start()
    started = time.monotonic()
    result.records = _run_conversations(plan, modes, conversations)
    result.elapsed_s = time.monotonic() - started
    return result


def _run_conversations(plan: Plan, modes: tuple[str, ...], conversations: int) -> list[TurnRecord]:
    jobs = [Conversation(plan, m, i) for m in modes for i in range(1, conversations + 1)]
    bound = plan.turns * (plan.turn_timeout + plan.think + CONNECT_TIMEOUT_S + ADMIN_TIMEOUT_S + 1) + 10
    with ThreadPoolExecutor(max_workers=len(jobs), thread_name_prefix="repro") as pool:
        futures = [pool.submit(job.run) for job in jobs]
        try:
            wait_all(futures, timeout=bound)
        except KeyboardInterrupt:
            plan.stop.set()  # the turns under way end within their timeout
            raise
        records = [record for future in futures for record in future.result(timeout=0)]
    return records
