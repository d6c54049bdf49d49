"""Ask the proxy where a hung request is: ``GET /debug/inflight`` on its admin listener.

The harness sets its own ``x-request-id`` on every turn, and the proxy keeps a
client-sent request id, so the id the harness knows is the id the proxy files the
request under. ``locate`` turns the in-flight list and that id into a ``Diagnosis``:

* an entry with the id: the proxy has the request; its verdict says which phase
  it is stuck in, for how long, and whose turn it is (blame and outcome code);
* no entry, and no response head came back: the request never reached the proxy,
  so the hang is in front of it (a load balancer, a sidecar, the client's network);
* no entry, but the proxy did answer: the proxy is done with it, so what is
  missing was lost after the proxy.

``locate`` is pure (JSON in, ``Diagnosis`` out); ``fetch_inflight`` does the I/O.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from .client import COMPLETE, simple_get

ADMIN_TIMEOUT_S = 3.0

IN_FLIGHT = "in_flight"
NOT_REACHED = "not_reached"
LEFT_PROXY = "left_proxy"
UNKNOWN = "unknown"


@dataclass
class Diagnosis:
    """Where the proxy says a request is; ``kind`` is one of the four names above."""

    kind: str
    detail: str = ""  # UNKNOWN: why we cannot tell
    phase: str | None = None
    waiting_for_s: float | None = None
    blame: str | None = None
    outcome: str | None = None
    outcome_name: str | None = None
    stalled: bool | None = None
    proxy_connection: int | None = None
    proxy_sequence: int | None = None
    upstream_connection: int | None = None
    upstream_reused: bool | None = None
    attempts: int | None = None
    trace_id: str | None = None
    engine_stage: dict | None = None  # where the engines have it (PD component, stage, worker), when known


class AdminError(Exception):
    """The admin listener did not answer with the in-flight JSON."""


def parse_admin(text: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``http://HOST:PORT`` -> (host, port); raises ValueError."""
    raw = text.strip().removesuffix("/")
    if raw.lower().startswith("http://"):
        raw = raw[7:]
    host, _, port = raw.rpartition(":")
    if not host or not port.isdigit() or "/" in raw or not 0 < int(port) < 65536:
        raise ValueError(f"expected HOST:PORT such as 127.0.0.1:9464, got {text!r}")
    return host.strip("[]"), int(port)


def fetch_inflight(admin: tuple[str, int], timeout: float = ADMIN_TIMEOUT_S) -> list[dict]:
    """The ``requests`` list of ``GET /debug/inflight``; raises AdminError."""
    return requests_of(fetch_inflight_document(admin, timeout))


def requests_of(document: dict) -> list[dict]:
    return [entry for entry in document["requests"] if isinstance(entry, dict)]


def span_file_of(document: dict) -> str | None:
    """The span file the proxy writes, from the ``health`` in its in-flight answer: an
    absolute path, else None (spans over OTLP, off, or a proxy that does not say)."""
    health = document.get("health")
    spans = health.get("spans") if isinstance(health, dict) else None
    return spans if isinstance(spans, str) and os.path.isabs(spans) else None


def fetch_inflight_document(admin: tuple[str, int], timeout: float = ADMIN_TIMEOUT_S) -> dict:
    """``GET /debug/inflight`` as JSON, with its list of requests; raises AdminError."""
    host, port = admin
    try:
        answer = simple_get(host, port, "/debug/inflight", timeout)
    except OSError as exc:
        raise AdminError(f"cannot connect to the admin listener {host}:{port}: {exc}") from None
    if answer.ending != COMPLETE:
        raise AdminError(f"no complete answer from {host}:{port}/debug/inflight ({answer.ending or 'timeout'})")
    try:
        document = json.loads(bytes(answer.body))
    except ValueError:
        raise AdminError(f"{host}:{port}/debug/inflight did not answer JSON (is this the admin port?)") from None
    if not isinstance(document, dict) or not isinstance(document.get("requests"), list):
        raise AdminError(f"{host}:{port}/debug/inflight has no list of requests (is this the admin port?)")
    return document


def locate(entries: list[dict], request_id: str, answered: bool) -> Diagnosis:
    """Where the request with ``request_id`` is, given the proxy's in-flight list."""
    entry = next((e for e in entries if e.get("request_id") == request_id), None)
    if entry is None:
        return Diagnosis(LEFT_PROXY if answered else NOT_REACHED)
    return from_entry(entry)


def from_entry(entry: dict) -> Diagnosis:
    verdict = entry.get("verdict") or {}
    return Diagnosis(
        IN_FLIGHT,
        phase=entry.get("phase"),
        waiting_for_s=verdict.get("waiting_for_s"),
        blame=verdict.get("blame"),
        outcome=verdict.get("outcome"),
        outcome_name=verdict.get("name"),
        stalled=verdict.get("stalled"),
        proxy_connection=entry.get("client_connection"),
        proxy_sequence=entry.get("client_request_sequence"),
        upstream_connection=entry.get("upstream_connection"),
        upstream_reused=entry.get("upstream_reused"),
        attempts=entry.get("attempts"),
        trace_id=entry.get("trace_id"),
        engine_stage=entry.get("engine_stage") if isinstance(entry.get("engine_stage"), dict) else None,
    )


def ask_proxy(admin: tuple[str, int] | None, request_id: str, answered: bool) -> Diagnosis:
    """``locate`` against the live admin listener; UNKNOWN when there is none or it fails."""
    if admin is None:
        return Diagnosis(UNKNOWN, "no --admin given, so the proxy was not asked")
    try:
        return locate(fetch_inflight(admin), request_id, answered)
    except AdminError as exc:
        return Diagnosis(UNKNOWN, str(exc))
