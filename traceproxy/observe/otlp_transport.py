"""Exporter process: an encoded ``ExportTraceServiceRequest`` to a collector, over
http/protobuf or gRPC, retried as the OTLP specification says.

Both transports send the bytes ``otlp_proto.py`` wrote, through public APIs only:
an HTTP POST with ``requests``, and a gRPC unary call made without a serializer
(grpcio then passes the bytes as they are, and hands back the answer's bytes).
Where they go and how comes from ``otlp_settings.py``.

Retries:
- http/protobuf: answers 429, 502, 503 and 504, a connection that cannot be made or
  breaks, and no answer in time are retried; a ``Retry-After`` is obeyed. Any other
  answer fails the batch at once (retrying a 400 would only be refused again).
- gRPC: CANCELLED, DEADLINE_EXCEEDED, ABORTED, OUT_OF_RANGE, UNAVAILABLE and DATA_LOSS
  are retried, RESOURCE_EXHAUSTED only when the collector says when (RetryInfo),
  which is then obeyed.
- Otherwise the waits grow: 1, 2, 4, ... s, each ±20 %. At most ``MAX_ATTEMPTS``, and
  never past the export's timeout: each attempt gets what is left of it, and a wait
  that would end past it ends the export as failed instead. So an export never
  takes longer than its timeout, and a slow or down collector only fills the pipe
  from the proxy (which drops and counts).

Hazards:
- A gRPC channel that lost its server backs off its own reconnections, up to two
  minutes: after UNAVAILABLE the channel is replaced, so a collector that is back
  gets the next attempt.
- A failed export is logged as one line under ``traceproxy.export``, naming the
  destination and the collector's words; the exporter process's episode filter
  keeps one such line per episode of failures.
"""

from __future__ import annotations

import email.utils
import gzip
import logging
import math
import random
import time
import zlib
from collections.abc import Callable
from datetime import timezone
from typing import NamedTuple

from traceproxy import __version__

from .otlp_proto import read_varint
from .otlp_settings import OtlpSettings

log = logging.getLogger("traceproxy.export")

MAX_ATTEMPTS = 6
JITTER = 0.2
USER_AGENT = f"traceproxy/{__version__}"
PROTOBUF = "application/x-protobuf"
RETRYABLE_HTTP_STATUSES = frozenset({429, 502, 503, 504})
EXPORT_METHOD = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
_COMPRESSORS: dict[str, Callable[[bytes], bytes]] = {
    "none": lambda payload: payload, "gzip": gzip.compress, "deflate": zlib.compress,
}


class Attempt(NamedTuple):
    delivered: bool
    retryable: bool = False
    retry_after: float | None = None  # seconds the collector asked us to wait
    reason: str = ""


DELIVERED = Attempt(True)


def backoff(retry: int) -> float:
    return 2**retry * random.uniform(1 - JITTER, 1 + JITTER)


def send_with_retries(attempt: Callable[[float], Attempt], timeout: float, destination: str,
                      clock: Callable[[], float] = time.monotonic,
                      sleep: Callable[[float], None] = time.sleep) -> bool:
    """``attempt(seconds_left)`` until delivered, or until retrying is pointless or too late."""
    started = clock()
    deadline = started + timeout
    for number in range(1, MAX_ATTEMPTS + 1):
        outcome = attempt(max(deadline - clock(), 0.001))
        if outcome.delivered:
            return True
        wait = outcome.retry_after if outcome.retry_after is not None else backoff(number - 1)
        if outcome.retryable and number < MAX_ATTEMPTS and wait < deadline - clock():
            log.debug("OTLP export to %s: %s; retrying in %.2f s", destination, outcome.reason, wait)
            sleep(wait)
            continue
        if not outcome.retryable:
            how = "not retried"
        else:
            how = f"gave up after {number} attempt{'s' if number > 1 else ''} in {clock() - started:.1f} s"
            how += f"; the export timeout is {timeout:g} s"
        log.warning("OTLP export to %s failed: %s (%s)", destination, outcome.reason, how)
        return False
    return False


# --------------------------------------------------------------------------- HTTP
class HttpTransport:
    """OTLP http/protobuf: a POST per batch, on a keep-alive session."""

    def __init__(self, settings: OtlpSettings) -> None:
        import requests

        self._requests = requests
        self._session = requests.Session()
        # Given with each request, not set on the session: requests lets a
        # REQUESTS_CA_BUNDLE or CURL_CA_BUNDLE variable outrank the session's CA bundle.
        self._tls = {"verify": settings.certificate or True}
        if settings.client_certificate:
            self._tls["cert"] = ((settings.client_certificate, settings.client_key) if settings.client_key
                                 else settings.client_certificate)
        self._url, self._timeout = settings.endpoint, settings.timeout
        self._compress = _COMPRESSORS[settings.compression]
        headers = {"content-type": PROTOBUF, "user-agent": USER_AGENT}
        if settings.compression != "none":
            headers["content-encoding"] = settings.compression
        self._headers = headers | settings.headers

    def send(self, payload: bytes) -> bool:
        body = self._compress(payload)
        return send_with_retries(lambda seconds_left: self._attempt(body, seconds_left), self._timeout, self._url)

    def _attempt(self, body: bytes, timeout: float) -> Attempt:
        requests = self._requests
        try:
            response = self._session.post(self._url, data=body, headers=self._headers, timeout=timeout,
                                          allow_redirects=False, **self._tls)
        except requests.Timeout:
            return Attempt(False, retryable=True, reason=f"no answer within {timeout:.1f} s")
        except requests.exceptions.SSLError as exc:  # a certificate is not fixed by waiting
            return Attempt(False, reason=f"TLS: {innermost_reason(exc)}")
        except requests.ConnectionError as exc:
            return Attempt(False, retryable=True, reason=f"connection failed: {innermost_reason(exc)}")
        except OSError as exc:  # requests' other errors, and a CA bundle path that does not exist
            return Attempt(False, reason=innermost_reason(exc))
        status = response.status_code
        if 200 <= status < 300:
            return DELIVERED
        reason = f"HTTP {status} {response.reason or ''}".rstrip()
        if 300 <= status < 400 and response.headers.get("location"):
            reason += f" to {response.headers['location']}"
        reason += _said(response)
        if status in RETRYABLE_HTTP_STATUSES:
            return Attempt(False, True, retry_after_seconds(response.headers.get("retry-after")), reason)
        return Attempt(False, reason=reason)

    def shutdown(self) -> None:
        self._session.close()


def _said(response) -> str:
    """The collector's own message: a google.rpc.Status (OTLP's error body), or text."""
    content_type = response.headers.get("content-type", "").partition(";")[0].strip().lower()
    if content_type == PROTOBUF:
        message = status_message(response.content)
    elif content_type.startswith("text/") or content_type.endswith("json"):
        message = response.text.strip()
    else:
        message = ""
    return f": {message[:300]}" if message else ""


def retry_after_seconds(value: str | None) -> float | None:
    """An HTTP ``Retry-After``: delay-seconds, or an HTTP-date."""
    if not value:
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        if when.tzinfo is None:
            when = when.replace(tzinfo=timezone.utc)
        seconds = when.timestamp() - time.time()
    return max(seconds, 0.0) if math.isfinite(seconds) else None


def innermost_reason(exc: BaseException) -> str:
    """The root of a wrapped error: requests wraps urllib3, which wraps the socket's
    error, each adding its own long description; the socket's words are the news."""
    for _ in range(10):
        inner = exc.__cause__ or getattr(exc, "reason", None)
        if inner is None and exc.args and isinstance(exc.args[0], BaseException):
            inner = exc.args[0]
        if not isinstance(inner, BaseException) or inner is exc:
            break
        exc = inner
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc) or type(exc).__name__


# --------------------------------------------------------------------------- gRPC
class GrpcTransport:
    """OTLP over gRPC: ``TraceService/Export`` as a unary call carrying our bytes."""

    def __init__(self, settings: OtlpSettings) -> None:
        import grpc

        self._grpc = grpc
        self._settings = settings
        self._metadata = tuple(settings.headers.items())
        self._credentials = None if settings.insecure else channel_credentials(grpc, settings)
        self._compression = {"none": grpc.Compression.NoCompression, "gzip": grpc.Compression.Gzip,
                             "deflate": grpc.Compression.Deflate}[settings.compression]
        codes = grpc.StatusCode
        self._retryable = frozenset({codes.CANCELLED, codes.DEADLINE_EXCEEDED, codes.ABORTED, codes.OUT_OF_RANGE,
                                     codes.UNAVAILABLE, codes.DATA_LOSS})
        self._channel = None
        self._open_channel()

    def _open_channel(self) -> None:
        grpc, target = self._grpc, self._settings.endpoint
        options = (("grpc.primary_user_agent", USER_AGENT),)
        if self._credentials is None:
            self._channel = grpc.insecure_channel(target, options=options, compression=self._compression)
        else:
            self._channel = grpc.secure_channel(target, self._credentials, options=options,
                                                compression=self._compression)
        # No serializers: the request is our encoded bytes, the answer is left as bytes.
        self._export = self._channel.unary_unary(EXPORT_METHOD, request_serializer=None,
                                                 response_deserializer=None)

    def send(self, payload: bytes) -> bool:
        return send_with_retries(lambda seconds_left: self._attempt(payload, seconds_left),
                                 self._settings.timeout, self._settings.endpoint)

    def _attempt(self, payload: bytes, timeout: float) -> Attempt:
        grpc = self._grpc
        try:
            self._export(payload, timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as error:
            code = error.code() if callable(getattr(error, "code", None)) else grpc.StatusCode.UNKNOWN
            details = error.details() if callable(getattr(error, "details", None)) else str(error)
            trailers = error.trailing_metadata() if callable(getattr(error, "trailing_metadata", None)) else ()
            delay = grpc_retry_delay(trailers or ())
            if code is grpc.StatusCode.UNAVAILABLE:
                self._channel.close()
                self._open_channel()
            retryable = code in self._retryable or (code is grpc.StatusCode.RESOURCE_EXHAUSTED and delay is not None)
            return Attempt(False, retryable, delay, f"{code.name}: {details}")
        return DELIVERED

    def shutdown(self) -> None:
        self._channel.close()


def channel_credentials(grpc, settings: OtlpSettings):
    def read(path: str) -> bytes | None:
        if not path:
            return None
        try:
            with open(path, "rb") as file:
                return file.read()
        except OSError as exc:
            log.warning("OTLP over gRPC: cannot read %s (%s); going on without it", path, exc.strerror or exc)
            return None

    return grpc.ssl_channel_credentials(root_certificates=read(settings.certificate),
                                        private_key=read(settings.client_key),
                                        certificate_chain=read(settings.client_certificate))


# ------------------------------------------------------- the collector's error details
RETRY_INFO_TRAILER = "google.rpc.retryinfo-bin"
STATUS_DETAILS_TRAILER = "grpc-status-details-bin"
RETRY_INFO_TYPE = "type.googleapis.com/google.rpc.RetryInfo"


def grpc_retry_delay(trailers) -> float | None:
    """Seconds a RetryInfo asks for, from its own trailer or from the status details."""
    for key, value in trailers:
        if key == RETRY_INFO_TRAILER and isinstance(value, bytes):
            return retry_info_delay(value)
        if key == STATUS_DETAILS_TRAILER and isinstance(value, bytes):
            for number, detail in protobuf_fields(value):  # google.rpc.Status.details = 3 (Any)
                if number == 3 and isinstance(detail, bytes):
                    any_fields = dict(protobuf_fields(detail))  # Any: type_url = 1, value = 2
                    if any_fields.get(1) == RETRY_INFO_TYPE.encode():
                        return retry_info_delay(any_fields.get(2, b""))
    return None


def retry_info_delay(raw: bytes) -> float | None:
    """google.rpc.RetryInfo.retry_delay (1), a Duration: seconds (1), nanos (2)."""
    duration = dict(protobuf_fields(raw)).get(1)
    if not isinstance(duration, bytes):
        return None
    fields = dict(protobuf_fields(duration))
    seconds, nanos = fields.get(1, 0), fields.get(2, 0)
    if not isinstance(seconds, int) or not isinstance(nanos, int):
        return None
    return max(seconds + nanos / 1e9, 0.0)


def status_message(raw: bytes) -> str:
    """google.rpc.Status.message (2), as an OTLP/HTTP error body carries it."""
    message = dict(protobuf_fields(raw)).get(2)
    return message.decode("utf-8", "replace").strip() if isinstance(message, bytes) else ""


def protobuf_fields(data: bytes) -> list[tuple[int, int | bytes]]:
    """A message's varint and length-delimited fields as (number, value); fixed-width
    ones are skipped. [] for bytes that are not a message: these are hints only."""
    fields: list[tuple[int, int | bytes]] = []
    position = 0
    try:
        while position < len(data):
            key, position = read_varint(data, position)
            number, wire_type = key >> 3, key & 7
            if wire_type == 0:
                value, position = read_varint(data, position)
                fields.append((number, value))
            elif wire_type == 2:
                length, position = read_varint(data, position)
                if position + length > len(data):
                    return []
                fields.append((number, data[position:position + length]))
                position += length
            elif wire_type in (1, 5):
                position += 8 if wire_type == 1 else 4
            else:
                return []
    except IndexError:
        return []
    return fields
