"""What the routers ask a worker besides inference: load reports, prompt rendering, tokenization.

Theory of operation
-------------------
Each router polls or calls its workers for more than ``/health`` and ``/server_info``:

* **smg 1.13** polls ``GET /loads?model=NAME`` and ``GET /v1/loads?include=...`` (SGLang's
  per-DP-rank load report) every 10 s, and falls back to ``/metrics`` when both fail.
  Both answer SGLang's ``/v1/loads`` document here: one DP rank, its running and waiting
  requests read from the worker's live gauges, and the sections ``include`` names
  (``core``, ``memory``, ``spec``, ``lora``, ``disagg``, ``queues``, ``all``; an unknown
  one is a 400 naming it, as SGLang does).
* **vllm-router 0.1.17** calls ``POST /v1/chat/completions/render`` (or
  ``/v1/completions/render``) and ``POST /tokenize`` on both workers before each
  OpenAI request, for its cache-aware routing. They answer as vLLM does: the prompt's
  token ids (a render of a completion request is a list, one per prompt), and
  ``{"count", "max_model_len", "tokens", "token_strs"}``.

Token ids come from ``shapes.prompt_token_ids``: the same text always gives the same
ids, so prefix-aware routing sees shared prefixes as it would with a real tokenizer.
"""

from __future__ import annotations

import time
import uuid
from datetime import datetime, timezone
from typing import TYPE_CHECKING

from aiohttp import web

from . import gauges as g
from .shapes import max_tokens, prompt_text, prompt_token_ids

if TYPE_CHECKING:
    from .engine import SimWorker

LOAD_SECTIONS = ("core", "memory", "spec", "lora", "disagg", "queues", "all")
MAX_TOTAL_TOKENS = 131072  # the simulated KV pool's size, in tokens
MAX_MODEL_LEN = 32768


def load_report(worker: "SimWorker", include: str | None) -> dict:
    """SGLang's ``/v1/loads`` document for ``worker``; ValueError naming an unknown section."""
    sections = {part.strip() for part in (include or "all").split(",") if part.strip()} or {"all"}
    unknown = sections - set(LOAD_SECTIONS)
    if unknown:
        raise ValueError(f"Invalid include sections: {sorted(unknown)}. Valid options: {sorted(LOAD_SECTIONS)}")
    wanted = set(LOAD_SECTIONS) if "all" in sections else sections
    gauges = worker.metrics.gauges
    running, waiting = gauges[g.RUNNING], gauges[g.QUEUED]
    rank = {"dp_rank": 0, "timestamp": time.time(), "num_running_reqs": running, "num_waiting_reqs": waiting,
            "num_total_reqs": running + waiting, "num_used_tokens": 0, "num_total_tokens": 0,
            "max_total_num_tokens": MAX_TOTAL_TOKENS, "token_usage": 0.0, "gen_throughput": 0.0,
            "cache_hit_rate": 0.0, "utilization": 0.0, "max_running_requests": worker.max_running_requests}
    if "memory" in wanted:
        rank["memory"] = {"weight_gb": 0.0, "kv_cache_gb": 0.0, "graph_gb": 0.0, "token_capacity": MAX_TOTAL_TOKENS}
    if "disagg" in wanted:
        rank["disaggregation"] = {
            "mode": worker.role,
            "prefill_prealloc_queue_reqs": gauges[g.PREFILL_PREALLOC],
            "prefill_inflight_queue_reqs": gauges[g.PREFILL_INFLIGHT],
            "decode_prealloc_queue_reqs": gauges[g.DECODE_PREALLOC],
            "decode_transfer_queue_reqs": gauges[g.DECODE_TRANSFER],
            "decode_retracted_queue_reqs": 0, "kv_transfer_speed_gb_s": 0.0, "kv_transfer_latency_ms": 0.0}
    if "queues" in wanted:
        rank["queues"] = {"waiting": waiting, "grammar": 0, "paused": 0, "retracted": 0}
    return {"timestamp": datetime.now(timezone.utc).isoformat(), "version": "0.0.0-sim", "dp_rank_count": 1,
            "loads": [rank],
            "aggregate": {"total_running_reqs": running, "total_waiting_reqs": waiting,
                          "total_reqs": running + waiting, "total_used_tokens": 0,
                          "total_tokens": MAX_TOTAL_TOKENS, "avg_token_usage": 0.0, "avg_throughput": 0.0,
                          "avg_utilization": 0.0}}


def add_routes(app: web.Application, worker: "SimWorker") -> None:
    """The load reports, renders and tokenization, on ``worker``'s app."""

    async def loads(request: web.Request) -> web.Response:
        try:
            return web.json_response(load_report(worker, request.query.get("include")))
        except ValueError as exc:
            return _bad_request(str(exc))

    async def tokenize(request: web.Request) -> web.Response:
        body = await _json_object(request)
        if body is None:
            return _bad_request("the body must be a JSON object with prompt or messages")
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        ids = prompt_token_ids(prompt_text(path, body))
        return web.json_response({"count": len(ids), "max_model_len": MAX_MODEL_LEN, "tokens": ids,
                                  "token_strs": None})

    def render(path: str):
        async def handler(request: web.Request) -> web.Response:
            body = await _json_object(request)
            if body is None:
                return _bad_request("the body must be a JSON object")
            if path == "/v1/chat/completions" and not isinstance(body.get("messages"), list):
                return _bad_request("messages is required and must be a list of message objects")
            if path == "/v1/chat/completions":
                return web.json_response(_rendered(worker, body, prompt_text(path, body)))
            prompts = body.get("prompt")
            prompts = prompts if isinstance(prompts, list) and all(isinstance(p, str) for p in prompts) else [
                prompt_text(path, body)]
            return web.json_response([_rendered(worker, body, text) for text in prompts])

        return handler

    app.router.add_get("/loads", loads)
    app.router.add_get("/v1/loads", loads)
    app.router.add_post("/tokenize", tokenize)
    for path in ("/v1/chat/completions", "/v1/completions"):
        app.router.add_post(f"{path}/render", render(path))


def _rendered(worker: "SimWorker", body: dict, text: str) -> dict:
    """vLLM's render of one prompt: the request as token ids, ready for generation."""
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    return {"request_id": f"render-{uuid.uuid4().hex}", "token_ids": prompt_token_ids(text), "features": None,
            "sampling_params": {"max_tokens": max_tokens(path, body)}, "model": worker.model,
            "stream": bool(body.get("stream"))}


async def _json_object(request: web.Request) -> dict | None:
    try:
        body = await request.json()
    except ValueError:
        return None
    return body if isinstance(body, dict) else None


def _bad_request(message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": "BadRequestError", "code": 400}}, status=400)
