"""The JSON an SGLang server answers with, per endpoint, for the simulated workers.

Theory of operation
-------------------
``Reply`` knows one request's endpoint, id, model and prompt size and builds every
object the worker sends for it:

* ``/generate`` (SGLang native): each stream event carries the *cumulative* text and a
  ``meta_info`` (``id``, ``finish_reason`` null until the end, then an object such as
  ``{"type": "length", "length": N}``, token counts); the non-stream answer is the
  last such object.
* ``/v1/chat/completions`` and ``/v1/completions`` (OpenAI): ``chat.completion.chunk``
  / ``text_completion`` events with one token each; the final event carries the
  finish reason and ``usage``; the stream ends with ``data: [DONE]``.

Token counts are estimates (about four characters per token): the simulator has no
tokenizer and does not need one.
"""

from __future__ import annotations

import json
import time
import uuid
import zlib

DEFAULT_MAX_TOKENS = 16
MAX_TOKENS_CAP = 4096  # bounds every generation loop
VOCABULARY = 32000  # token ids are below this
_WORDS = ("The", " quick", " brown", " fox", " jumps", " over", " the", " lazy", " dog", ".", " It", " was",
          " a", " bright", " cold", " day", " in", " April", ",", " and", " the", " clocks", " struck", " thirteen")


def token_text(index: int) -> str:
    return _WORDS[index % len(_WORDS)]


def estimate_tokens(text: str) -> int:
    return max(1, (len(text) + 3) // 4)


def prompt_tokens(path: str, body: dict) -> int:
    if path == "/v1/chat/completions":
        messages = body.get("messages") if isinstance(body.get("messages"), list) else []
        return sum(4 + estimate_tokens(_content_text(m.get("content"))) for m in messages if isinstance(m, dict)) or 1
    if path == "/generate" and isinstance(body.get("input_ids"), list):
        return max(1, len(body["input_ids"]))
    text = body.get("text") if path == "/generate" else body.get("prompt")
    return estimate_tokens(text if isinstance(text, str) else json.dumps(text or ""))


def prompt_text(path: str, body: dict) -> str:
    """The prompt as one text: chat messages one a line (``role: content``), else the prompt."""
    if path == "/v1/chat/completions":
        messages = body.get("messages") if isinstance(body.get("messages"), list) else []
        return "\n".join(f"{m.get('role', '')}: {_content_text(m.get('content'))}" for m in messages
                         if isinstance(m, dict))
    text = body.get("text") if path == "/generate" else body.get("prompt")
    return text if isinstance(text, str) else json.dumps(text or "")


def prompt_token_ids(text: str) -> list[int]:
    """Token ids for ``text``, four characters a token as ``estimate_tokens`` counts: the same
    text always gives the same ids, and a shared prefix the same leading ids."""
    return [zlib.crc32(text[i:i + 4].encode()) % VOCABULARY for i in range(0, len(text), 4)] or [0]


def _content_text(content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return ""


def max_tokens(path: str, body: dict) -> int:
    if path == "/generate":
        params = body.get("sampling_params") if isinstance(body.get("sampling_params"), dict) else {}
        wanted = params.get("max_new_tokens")
    else:
        wanted = body.get("max_completion_tokens") or body.get("max_tokens")
    if not isinstance(wanted, int) or isinstance(wanted, bool) or wanted < 0:
        return DEFAULT_MAX_TOKENS
    return min(wanted, MAX_TOKENS_CAP)


def check_request(path: str, body: dict) -> None:
    """Refuse what SGLang (and the OpenAI API it imitates) refuses, with the field named;
    raises ValueError. Only what the simulator reads is checked: the router adds its own
    fields (bootstrap host, port and room), and unknown fields are ignored, as SGLang does."""
    if path == "/generate":
        if body.get("text") is None and body.get("input_ids") is None:
            raise ValueError("either text or input_ids should be provided")
        params = body.get("sampling_params", {})
        if not isinstance(params, dict):
            raise ValueError("sampling_params must be an object")
        _check_count(params, "max_new_tokens")
    elif path == "/v1/chat/completions":
        if not isinstance(body.get("messages"), list):
            raise ValueError("messages is required and must be a list of message objects")
        if not all(isinstance(m, dict) for m in body["messages"]):
            raise ValueError("each entry of messages must be an object")
    for key in ("max_tokens", "max_completion_tokens"):
        _check_count(body, key)
    if not isinstance(body.get("stream", False), bool):
        raise ValueError(f"stream must be true or false, got {body['stream']!r}")


def _check_count(fields: dict, key: str) -> None:
    value = fields.get(key)
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
        raise ValueError(f"{key} must be a non-negative integer, got {value!r}")


def request_rid(body: dict) -> str:
    rid = body.get("rid")
    return rid if isinstance(rid, str) and rid else uuid.uuid4().hex


class Reply:
    def __init__(self, path: str, rid: str, model: str, prompt_tokens: int) -> None:
        self.path, self.rid, self.model, self.prompt_tokens = path, rid, model, prompt_tokens
        self.created = int(time.time())
        self.text = ""

    # -- stream events ---------------------------------------------------------
    def token_event(self, piece: str, n: int) -> dict:
        """The event for token number ``n`` (1-based), whose text is ``piece``."""
        self.text += piece
        if self.path == "/generate":
            return {"text": self.text, "meta_info": self._meta(n, None)}
        if self.path == "/v1/chat/completions":
            delta = {"role": "assistant", "content": piece} if n == 1 else {"content": piece}
            return self._chunk({"index": 0, "delta": delta, "logprobs": None, "finish_reason": None})
        return self._chunk({"index": 0, "text": piece, "logprobs": None, "finish_reason": None})

    def final_event(self, n: int, finish: str = "length") -> dict:
        """The last event: the finish reason, and usage for the OpenAI endpoints."""
        if self.path == "/generate":
            return {"text": self.text, "meta_info": self._meta(n, finish)}
        if self.path == "/v1/chat/completions":
            choice = {"index": 0, "delta": {}, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": "", "logprobs": None, "finish_reason": finish}
        return {**self._chunk(choice), "usage": self._usage(n)}

    def error_event(self, message: str, status: int) -> dict:
        return {"error": {"message": message, "type": "ServiceUnavailableError" if status == 503 else "InternalError",
                          "code": status}}

    # -- whole answers ------------------------------------------------------------
    def complete(self, n: int, finish: str | None = "length") -> dict:
        """The non-stream answer after ``n`` tokens (``finish`` None: no finish reason)."""
        if self.path == "/generate":
            return {"text": self.text, "meta_info": self._meta(n, finish)}
        if self.path == "/v1/chat/completions":
            choice = {"index": 0, "message": {"role": "assistant", "content": self.text}, "logprobs": None,
                      "finish_reason": finish}
            kind = "chat.completion"
        else:
            choice = {"index": 0, "text": self.text, "logprobs": None, "finish_reason": finish}
            kind = "text_completion"
        return {"id": self.rid, "object": kind, "created": self.created, "model": self.model, "choices": [choice],
                "usage": self._usage(n)}

    # -- parts ----------------------------------------------------------------------
    def _chunk(self, choice: dict) -> dict:
        kind = "chat.completion.chunk" if self.path == "/v1/chat/completions" else "text_completion"
        return {"id": self.rid, "object": kind, "created": self.created, "model": self.model, "choices": [choice]}

    def _usage(self, n: int) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": n, "total_tokens": self.prompt_tokens + n}

    def _meta(self, n: int, finish: str | None) -> dict:
        reason = None if finish is None else ({"type": finish, "length": n} if finish == "length" else {"type": finish})
        return {"id": self.rid, "finish_reason": reason, "prompt_tokens": self.prompt_tokens,
                "completion_tokens": n, "cached_tokens": 0}


def sse(obj: dict | str) -> bytes:
    """One SSE event: ``data: <json>`` and the blank line."""
    payload = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
    return b"data: " + payload.encode() + b"\n\n"
