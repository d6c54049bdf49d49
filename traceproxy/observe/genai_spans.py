"""GenAI span attributes: copied from the record in the proxy process, built in the exporter.

Theory of operation
-------------------
``evidence`` runs in the proxy process, once per request whose spans are kept, and
copies what an event stream's scanner and the token stamps hold into a plain tuple
(``GenAIEvidence``; marshal carries only plain tuples). ``genai_attributes`` runs in the
exporter process and builds the SERVER span's GenAI attributes, following the GenAI
semantic conventions of release 1.41.0 (``semconv``):

* the request's ``gen_ai.request.model``, ``stream`` and ``max_tokens``, from the kept
  start and end of its body;
* ``gen_ai.provider.name``: ``tracing.genai_provider`` when set, else what the response
  says: ``sglang`` for ``/generate`` or a response with SGLang's own fields
  (``meta_info``, ``matched_stop``), ``vllm`` for one with vLLM's (``stop_reason``),
  else ``openai``, the flavour of the OpenAI-compatible API the others speak;
* ``gen_ai.system``, the name it replaced, beside it with the same value, unless
  ``OTEL_SEMCONV_STABILITY_OPT_IN`` holds ``gen_ai_latest_experimental``: as the
  conventions ask of an instrumentation that emitted the older names (traceproxy did,
  with 1.26), the default keeps what it emitted and the opt-in emits only the latest;
* ``gen_ai.conversation.id`` from the request header ``tracing.conversation_id_header``
  names, when the record carries it;
* the response's model, id, finish reasons and usage: for an event stream, what its
  scanner read of the whole stream (the engine's counts, else its output events
  counted: ``traceproxy.usage.source``); otherwise from the kept end of the body;
* an event stream's time to first token (``traceproxy.response.time_to_first_token_s``;
  ``gen_ai.response.time_to_first_chunk`` stays the time to its first body byte, as
  the conventions define it), its output events, heartbeats and longest wait between
  two output events (left out with fewer than two: there is no gap, and a 0 would say
  the tokens came back to back).
"""

from __future__ import annotations

import os
import re
from typing import NamedTuple

import orjson

from ..lifecycle.token_progress import has_token_gap
from . import semconv as sc
from .genai import SOURCE_COUNTED, SOURCE_USAGE

OPERATIONS = {"/v1/chat/completions": "chat", "/v1/completions": "text_completion", "/generate": "text_completion",
              "/v1/embeddings": "embeddings", "/v1/responses": "chat"}
LATEST_OPT_IN = "gen_ai_latest_experimental"
PROVIDER_SGLANG, PROVIDER_VLLM, PROVIDER_OPENAI = "sglang", "vllm", "openai"


class SpanOptions(NamedTuple):
    provider: str = ""  # tracing.genai_provider: "" detects it from the response
    latest: bool = False  # only the latest GenAI names (OTEL_SEMCONV_STABILITY_OPT_IN)


def latest_opted_in(environ=os.environ) -> bool:
    """Whether OTEL_SEMCONV_STABILITY_OPT_IN (a comma-separated list) asks for the latest GenAI names only."""
    return LATEST_OPT_IN in (item.strip() for item in environ.get("OTEL_SEMCONV_STABILITY_OPT_IN", "").split(","))


# The exporter process's options, set once when it starts (exporter_main).
OPTIONS = SpanOptions(latest=latest_opted_in())


class GenAIEvidence(NamedTuple):
    """What the proxy process copies of a request for its GenAI attributes."""

    events: int  # events of its event stream; -1: not an event stream
    output_events: int
    heartbeats: int
    first_token_ns: int  # 0: no output event
    max_token_gap_ns: int
    model: str | None  # as the stream's events name it
    prompt_tokens: int | None  # the engine's own counts, None where it gave none
    completion_tokens: int | None
    finish_reasons: tuple[str, ...]
    conversation_id: str


def evidence(record) -> tuple:
    """The request's ``GenAIEvidence`` as a plain tuple; () when it has none (no event
    stream, no conversation id)."""
    events = record.stream_events
    conversation = record.conversation_id
    if events is None:
        return (-1, 0, 0, 0, 0, None, None, None, (), conversation) if conversation else ()
    s = events.summary()
    return (s.events, s.output_events, s.heartbeats, record.first_token_ns or 0, record.max_token_gap_ns, s.model,
            s.prompt_tokens, s.completion_tokens, s.finish_reasons, conversation)


# ----------------------------------------------------------------------------------
# In the exporter process
# ----------------------------------------------------------------------------------
_DATA_LINE = re.compile(rb"^data: ?(.*)$", re.M)


def genai_attributes(path: str, s, first_chunk_ns: int, options: SpanOptions | None = None) -> dict:
    """The GenAI attributes of the SERVER span of summary ``s`` (a ``spans.RequestSummary``)."""
    operation = OPERATIONS.get(path)
    if operation is None or s.method != "POST":
        return {}
    options = options or OPTIONS
    attrs: dict = {sc.GEN_AI_OPERATION_NAME: operation}
    request = _json_object(s.request_body_head)
    if request is None:  # a body longer than its kept head: what its fields say
        request = _fields_of_cut_json(s.request_body_head + b"\n" + s.request_body_tail, _REQUEST_FIELDS)
    _request_attributes(request, attrs)
    if first_chunk_ns and attrs.get(sc.GEN_AI_REQUEST_STREAM):
        attrs[sc.GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK] = (first_chunk_ns - s.start_ns) / 1e9
    _response_attributes(s.response_tail, attrs)
    found = GenAIEvidence(*s.genai) if s.genai else None
    if found is not None:
        _stream_attributes(found, s.start_ns, attrs)
    provider = options.provider or detect_provider(path, s.response_tail)
    attrs[sc.GEN_AI_PROVIDER_NAME] = provider
    if not options.latest:
        attrs[sc.GEN_AI_SYSTEM] = provider
    return attrs


def detect_provider(path: str, response_tail: bytes) -> str:
    """The engine by the fields only it writes; else the OpenAI-compatible API's flavour."""
    if path == "/generate" or b'"meta_info"' in response_tail or b'"matched_stop"' in response_tail:
        return PROVIDER_SGLANG
    if b'"stop_reason"' in response_tail:
        return PROVIDER_VLLM
    return PROVIDER_OPENAI


def _stream_attributes(found: GenAIEvidence, start_ns: int, attrs: dict) -> None:
    if found.conversation_id:
        attrs[sc.GEN_AI_CONVERSATION_ID] = found.conversation_id
    if found.events < 0:  # not an event stream
        return
    attrs[sc.OUTPUT_EVENTS] = found.output_events
    attrs[sc.HEARTBEATS] = found.heartbeats
    if found.first_token_ns:
        attrs[sc.TIME_TO_FIRST_TOKEN] = (found.first_token_ns - start_ns) / 1e9
    if has_token_gap(found.output_events):  # left out with fewer than two: no gap, not a 0
        attrs[sc.TOKEN_MAX_GAP] = found.max_token_gap_ns / 1e9
    if found.model:
        attrs[sc.GEN_AI_RESPONSE_MODEL] = found.model
    if found.finish_reasons:
        attrs[sc.GEN_AI_RESPONSE_FINISH_REASONS] = tuple(found.finish_reasons)
    if found.prompt_tokens is not None:
        attrs[sc.GEN_AI_USAGE_INPUT_TOKENS] = found.prompt_tokens
    if found.completion_tokens is not None:
        attrs[sc.GEN_AI_USAGE_OUTPUT_TOKENS] = found.completion_tokens
        attrs[sc.USAGE_SOURCE] = SOURCE_USAGE
    else:  # the engine gave no usage: the output events, counted
        attrs[sc.GEN_AI_USAGE_OUTPUT_TOKENS] = found.output_events
        attrs[sc.USAGE_SOURCE] = SOURCE_COUNTED


def _request_attributes(request: dict, attrs: dict) -> None:
    model = request.get("model")
    if isinstance(model, str):
        attrs[sc.GEN_AI_REQUEST_MODEL] = model
    stream = request.get("stream")
    if isinstance(stream, bool):
        attrs[sc.GEN_AI_REQUEST_STREAM] = stream
    max_tokens = request.get("max_tokens", request.get("max_completion_tokens"))
    if max_tokens is None and isinstance(request.get("sampling_params"), dict):
        max_tokens = request["sampling_params"].get("max_new_tokens")
    if isinstance(max_tokens, int) and not isinstance(max_tokens, bool):
        attrs[sc.GEN_AI_REQUEST_MAX_TOKENS] = max_tokens


def _response_attributes(tail: bytes, attrs: dict) -> None:
    """What the kept end of the response says: for an event stream, its last events."""
    events = [m.group(1).strip() for m in _DATA_LINE.finditer(tail)]
    if attrs.get(sc.GEN_AI_REQUEST_STREAM):
        attrs[sc.DONE_SEEN] = b"[DONE]" in events
        objects = [o for o in (_json_object(e) for e in events if e != b"[DONE]") if o is not None]
    else:
        whole = _json_object(tail)
        objects = [whole if whole is not None else _fields_of_cut_json(tail, _RESPONSE_FIELDS)]
    finish_reasons, usage = [], None
    for obj in objects:
        usage = obj.get("usage") if isinstance(obj.get("usage"), dict) else usage
        for choice in obj.get("choices") or ():
            if isinstance(choice, dict) and choice.get("finish_reason"):
                finish_reasons.append(str(choice["finish_reason"]))
        meta = obj.get("meta_info")  # SGLang /generate
        if isinstance(meta, dict):
            usage = {"prompt_tokens": meta.get("prompt_tokens"), "completion_tokens": meta.get("completion_tokens")}
            reason = meta.get("finish_reason")
            if isinstance(reason, dict) and reason.get("type"):
                finish_reasons.append(str(reason["type"]))
        if isinstance(obj.get("model"), str):
            attrs[sc.GEN_AI_RESPONSE_MODEL] = obj["model"]
        if isinstance(obj.get("id"), str):
            attrs[sc.GEN_AI_RESPONSE_ID] = obj["id"]
    if finish_reasons:
        attrs[sc.GEN_AI_RESPONSE_FINISH_REASONS] = tuple(finish_reasons)  # a string array
    if usage:
        for key, name in (("prompt_tokens", sc.GEN_AI_USAGE_INPUT_TOKENS),
                          ("completion_tokens", sc.GEN_AI_USAGE_OUTPUT_TOKENS)):
            if isinstance(usage.get(key), int):
                attrs[name] = usage[key]
                attrs[sc.USAGE_SOURCE] = SOURCE_USAGE


# Fields read out of JSON that was kept only in part (the head and tail of a long
# body): each with a value of the type it must have. That type is what keeps a
# nested namesake out: a tool's JSON schema has "model": {...}, never a string, and
# text inside a message has its quotes escaped, so it never matches.
_STRING, _BOOL, _INT = rb'"((?:[^"\\]|\\.)*)"', rb"(true|false)", rb"(\d+)"
_REQUEST_FIELDS = {"model": _STRING, "stream": _BOOL, "max_tokens": _INT, "max_completion_tokens": _INT,
                   "max_new_tokens": _INT}
_RESPONSE_FIELDS = {"finish_reason": _STRING, "prompt_tokens": _INT, "completion_tokens": _INT}
_FIELD_PATTERNS = {name: re.compile(rb'"%s"\s*:\s*%s' % (name.encode(), value))
                   for name, value in {**_REQUEST_FIELDS, **_RESPONSE_FIELDS}.items()}


def _fields_of_cut_json(data: bytes, fields: dict) -> dict:
    """The first value of each field found, as a dict shaped like the whole object."""
    found: dict = {}
    for name in fields:
        match = _FIELD_PATTERNS[name].search(data)
        if match is None:
            continue
        raw = match.group(1)
        value = (raw == b"true" if fields[name] is _BOOL else int(raw) if fields[name] is _INT
                 else raw.decode("utf-8", "replace"))
        found[name] = value
    if "max_new_tokens" in found:
        found["sampling_params"] = {"max_new_tokens": found.pop("max_new_tokens")}
    if "finish_reason" in found:
        found["choices"] = [{"finish_reason": found.pop("finish_reason")}]
    usage = {key: found.pop(key) for key in ("prompt_tokens", "completion_tokens") if key in found}
    if usage:
        found["usage"] = usage
    return found


def _json_object(data: bytes) -> dict | None:
    try:
        value = orjson.loads(data)
    except orjson.JSONDecodeError:  # also: invalid UTF-8, a cut-off head or tail
        return None
    return value if isinstance(value, dict) else None
