"""One inference request on a simulated worker: its phases, pacing and faults.

Theory of operation
-------------------
``serve(job)`` runs a request the way its worker's PD role would:

* **prefill** (with a ``bootstrap_room``): wait for the decode peer to attach to the
  room and complete the handshake (prealloc queue), wait for a slot (queue), prefill
  for ``prompt_tokens / prefill_tokens_per_s`` (running), mark the room ready and
  wait for the decode side to take the KV cache (inflight queue), then answer with no
  generated text: the router drains that answer and never shows it to the client.
* **decode** (with a room): open the SSE response at once (as Starlette does), wait
  for the handshake (prealloc queue), then for the KV cache (transfer queue), then
  decode ``max_tokens`` tokens at ``decode_tokens_per_s`` (running).
* **decode without a room** (a worker used on its own): prefill locally, then decode.

That is SGLang's PD protocol (sglang-router, smg). In vLLM's (vllm-router; see
``pairing.py``) the router calls prefill first and decode after it answered:

* **prefill** (``kv_transfer_params.do_remote_decode``): open a room, queue, prefill,
  mark the room ready, answer at once with one token and the ``kv_transfer_params``
  naming the room; the KV cache stays counted in the inflight queue until the decode
  side has attached, completed the handshake and pulled it
  (``SimWorker.keep_kv_for_decode``, which ends the request's timeline then).
* **decode** (``kv_transfer_params.do_remote_prefill``): open the SSE response, pull
  the room's KV cache (transfer queue), decode.

The job is counted in exactly one SGLang gauge at a time (``Stage``), and its
``RequestTimeline`` (``stages.py``) is told each transition, so SGLang's stages end
(and their spans are exported) as the gauges move. Faults act at fixed points, each
in one SGLang stage: the handshake (``bootstrap_stall``: prefill_bootstrap and
decode_bootstrap), prefill compute (``prefill_stall``: prefill_forward), the KV
transfer (``kv_transfer_stall``: prefill_transfer_kv_cache and decode_transferred),
decode's receipt of the KV cache (``decode_waiting_stall``: decode_transferred, after
prefill finished), before token number N (``decode_stall``: decode_forward, after N
decode_loop steps; ``reset_mid_stream``), before the first token
(``slow_first_token``), after the first token (``malformed_sse``), at the end
(``no_done``, ``pinned_request``). The PD faults need a PD peer: a worker used alone
ignores them. A held request waits until its client goes away (aiohttp cancels the
handler), the worker stops or is told to let go (``POST /admin/release``), or
``HOLD_LIMIT``. A prefill that ends without its KV cache taken marks the room failed,
so its decode stops waiting.
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING

from aiohttp import web

from . import gauges as g
from .bootstrap import fetch_kv
from .faults import Fault
from .gauges import Stage
from .pairing import VLLM, Pairing, prefill_kv_params
from .shapes import Reply, sse, token_text
from .stages import CHUNKED_PREFILL_SIZE, RequestTimeline

if TYPE_CHECKING:
    from .engine import SimWorker

HOLD_LIMIT = 3600.0  # a held request is let go after an hour at most
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


@dataclass
class Job:
    worker: "SimWorker"
    request: web.Request
    path: str
    body: dict
    faults: dict[str, Fault]
    reply: Reply
    max_tokens: int
    stage: Stage
    timeline: RequestTimeline
    pairing: Pairing | None = None  # None: a request served alone
    tokens: int = 0
    status: int = 200
    result: str = "ok"
    error: str = ""  # why it failed, when it did
    timeline_kept: bool = False  # the timeline outlives the response (a vLLM prefill's KV cache kept)

    @property
    def room(self) -> int | None:
        return self.pairing.room if self.pairing is not None else None

    @property
    def bootstrap(self) -> tuple[str, int] | None:
        """Where the prefill's rooms are (its bootstrap host and port); None when the request does
        not say (a vLLM prefill opens a room of its own)."""
        return self.pairing.bootstrap if self.pairing is not None else None

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))

    def arg(self, name: str):
        fault = self.faults.get(name)
        return None if fault is None else fault.arg

    def has(self, name: str) -> bool:
        return name in self.faults


async def serve(job: Job) -> web.StreamResponse:
    metrics = job.worker.metrics
    metrics.count("sglang:num_requests")
    metrics.count("sglang:prompt_tokens", job.reply.prompt_tokens)
    if job.worker.role == "prefill":
        return await _serve_prefill(job)
    return await _serve_decode(job)


# ----------------------------------------------------------------------------------
# prefill
# ----------------------------------------------------------------------------------
async def _serve_prefill(job: Job) -> web.StreamResponse:
    if job.pairing is not None and job.pairing.protocol == VLLM:
        return await _serve_vllm_prefill(job)
    rooms = job.worker.rooms
    room = rooms.get(job.room) if job.room is not None else None
    try:
        return await _serve_sglang_prefill(job, room)
    finally:
        if room is not None and not room.taken and not room.failed:
            rooms.update(room, failed=f"prefill ended: {job.result}")  # its decode stops waiting


async def _serve_sglang_prefill(job: Job, room) -> web.StreamResponse:
    rooms, timeout = job.worker.rooms, job.worker.bootstrap_timeout
    job.stage.enter(g.PREFILL_PREALLOC)
    job.timeline.bootstrap_queue_entered()
    if room is not None:
        if not await rooms.wait_for(room, lambda r: r.attached, timeout):
            return await _room_failed(job, room, "bootstrap timeout", "sglang:num_bootstrap_failed_reqs",
                                      f"no decode peer attached to room {job.room} within {timeout:g} s")
        if job.has("bootstrap_stall"):
            return await _hold(job, None)
        rooms.update(room, handshaken=True)
    held = await _prefill_compute(job)
    if held is not None:
        return held
    job.stage.enter(g.PREFILL_INFLIGHT)
    job.timeline.transfer_queue_entered()
    if room is not None:
        if job.has("kv_transfer_stall"):
            return await _hold(job, None)
        rooms.update(room, ready=True)
        if not await rooms.wait_for(room, lambda r: r.taken, timeout):
            return await _room_failed(job, room, "transfer timeout", "sglang:num_transfer_failed_reqs",
                                      f"KV cache of room {job.room} not taken within {timeout:g} s")
    job.timeline.kv_transfer_finished()
    _maybe_pin(job)
    if job.stream:
        resp = await _open_stream(job)
        await resp.write(sse(job.reply.final_event(0)))
        await resp.write(sse("[DONE]"))
        await resp.write_eof()
        return resp
    return web.json_response(job.reply.complete(0))


async def _serve_vllm_prefill(job: Job) -> web.StreamResponse:
    """Prefill first: compute, answer with the room's ``kv_transfer_params``, keep the cache."""
    worker = job.worker
    job.timeline.bootstrap_queue_entered()  # vLLM's handshake comes later, when decode pulls
    held = await _prefill_compute(job)
    if held is not None:
        return held
    if not job.has("kv_transfer_stall"):
        worker.rooms.update(worker.rooms.get(job.room), ready=True)
    worker.keep_kv_for_decode(job)
    _maybe_pin(job)
    job.tokens = 1  # the one token the router asked for (max_tokens 1), which it discards
    first = job.reply.token_event(token_text(0), 1)
    worker.metrics.count("sglang:generation_tokens")
    params = {"kv_transfer_params": prefill_kv_params(job.room, worker.advertised_host, worker.bootstrap_port,
                                                      worker.engine_id, job.reply.prompt_tokens)}
    if job.stream:
        resp = await _open_stream(job)
        await resp.write(sse(first))
        await resp.write(sse({**job.reply.final_event(1), **params}))
        await resp.write(sse("[DONE]"))
        await resp.write_eof()
        return resp
    return web.json_response({**job.reply.complete(1), **params})


async def _room_failed(job: Job, room, why: str, counter: str, message: str) -> web.StreamResponse:
    """The decode peer never came (or never took the KV cache): mark the room (before the
    answer is written: the peer learns it at once), count it as SGLang does, and fail the request."""
    job.worker.rooms.update(room, failed=room.failed or why)
    job.worker.metrics.count(counter)
    return await _fail(job, None, message)


async def _prefill_compute(job: Job) -> web.StreamResponse | None:
    """Queue, then run prefill (in chunks, for a long prompt); returns a response only when
    the request was held."""
    job.stage.enter(g.QUEUED)
    job.timeline.wait_queue_entered()
    async with job.worker.slots:
        job.stage.enter(g.RUNNING)
        job.timeline.forward_entered()
        if job.has("prefill_stall"):
            return await _hold(job, None)
        remaining = job.reply.prompt_tokens
        for _ in range(job.reply.prompt_tokens // CHUNKED_PREFILL_SIZE + 1):
            chunk = min(remaining, CHUNKED_PREFILL_SIZE)
            await asyncio.sleep(chunk / job.worker.prefill_tokens_per_s)
            remaining -= chunk
            if remaining <= 0:
                break
            job.timeline.chunk_finished()
        job.timeline.prefill_finished()
    return None


def _maybe_pin(job: Job) -> None:
    if job.has("pinned_request"):
        job.stage.pin(g.PREFILL_INFLIGHT)


# ----------------------------------------------------------------------------------
# decode
# ----------------------------------------------------------------------------------
async def _serve_decode(job: Job) -> web.StreamResponse:
    resp = await _open_stream(job) if job.stream else None
    paired = job.room is not None and job.bootstrap is not None
    if paired:
        error = await _wait_for_kv(job)
        if error:
            job.worker.metrics.count("sglang:num_transfer_failed_reqs")
            return await _fail(job, resp, error)
        if job.has("decode_waiting_stall"):
            return await _hold(job, resp)  # taken from prefill, never arrived: still in the transfer queue
    else:
        held = await _prefill_compute(job)
        if held is not None:
            return held
    _maybe_pin(job)
    job.stage.enter(g.QUEUED)
    if paired:
        job.timeline.wait_queue_entered()
    async with job.worker.slots:
        job.stage.enter(g.RUNNING)
        if paired:
            job.timeline.forward_entered()
            job.timeline.prebuilt_finished()
        else:
            job.timeline.decode_scheduled()
        return await _decode(job, resp)


async def _wait_for_kv(job: Job) -> str:
    job.stage.enter(g.DECODE_PREALLOC)
    job.timeline.prealloc_queue_entered()

    def on_state(state: str) -> None:
        if state != "waiting" and job.stage.current != g.DECODE_TRANSFER:
            job.stage.enter(g.DECODE_TRANSFER)
            job.timeline.transfer_queue_entered()

    host, port = job.bootstrap
    return await fetch_kv(job.worker.session, host, port, job.room, job.worker.bootstrap_timeout, on_state,
                          prefill_url=job.worker.prefill_url)


async def _decode(job: Job, resp: web.StreamResponse | None) -> web.StreamResponse:
    stall_at, reset_at = job.arg("decode_stall"), job.arg("reset_mid_stream")
    first_delay = (job.arg("slow_first_token") or 0.0) / 1000
    pace = 1.0 / job.worker.decode_tokens_per_s
    for n in range(job.max_tokens + 1):  # n tokens are out
        if stall_at is not None and n >= stall_at:
            return await _hold(job, resp)
        if reset_at is not None and n >= reset_at:
            return await _reset(job, resp)
        if n == job.max_tokens:
            break
        await asyncio.sleep(pace + (first_delay if n == 0 else 0.0))
        event = job.reply.token_event(token_text(n), n + 1)
        job.tokens = n + 1
        job.worker.metrics.count("sglang:generation_tokens")
        job.timeline.decode_step_finished()
        if resp is not None:
            await resp.write(sse(event))
        if job.has("malformed_sse"):
            return await _malformed(job, resp)
    return await _finish(job, resp)


async def _finish(job: Job, resp: web.StreamResponse | None) -> web.StreamResponse:
    no_done = job.has("no_done")
    if resp is None:
        return web.json_response(job.reply.complete(job.tokens, None if no_done else "length"))
    if not no_done:
        await resp.write(sse(job.reply.final_event(job.tokens)))
        await resp.write(sse("[DONE]"))
    await resp.write_eof()
    return resp


# ----------------------------------------------------------------------------------
# faults and failures
# ----------------------------------------------------------------------------------
async def _open_stream(job: Job) -> web.StreamResponse:
    resp = web.StreamResponse(status=200, headers=SSE_HEADERS)
    await resp.prepare(job.request)
    return resp


async def _fail(job: Job, resp: web.StreamResponse | None, message: str, status: int = 503) -> web.StreamResponse:
    job.status, job.result, job.error = status, "failed", message
    error = job.reply.error_event(message, status)
    if resp is None:
        return web.json_response(error, status=status)
    await resp.write(sse(error))  # SGLang reports a failure inside a started stream like this
    await resp.write(sse("[DONE]"))
    await resp.write_eof()
    return resp


async def _hold(job: Job, resp: web.StreamResponse | None) -> web.StreamResponse:
    """Send nothing more until the client leaves (the handler is cancelled), or the worker stops
    or is told to let go (``POST /admin/release``)."""
    job.result = "held"
    let_go = job.worker.let_go
    try:
        await asyncio.wait_for(let_go.wait(), HOLD_LIMIT)
    except asyncio.TimeoutError:
        pass
    return _drop(job, resp)


async def _reset(job: Job, resp: web.StreamResponse | None) -> web.StreamResponse:
    job.result = "reset"
    transport = job.request.transport
    if transport is not None:
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:  # linger 0: close() sends RST instead of FIN
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            except OSError:
                pass
        transport.abort()
    # The connection is gone; aiohttp cancels this handler as soon as it notices.
    await asyncio.sleep(1.0)
    return _drop(job, resp)


async def _malformed(job: Job, resp: web.StreamResponse | None) -> web.StreamResponse:
    job.result = "malformed"
    if job.arg("malformed_sse") == "chunk":
        transport = job.request.transport
        if transport is not None:
            transport.write(b"zz\r\nnot a chunk\r\n")  # an invalid chunk-size line, under aiohttp's framing
            transport.close()
        await asyncio.sleep(1.0)
        return _drop(job, resp)
    event = json.dumps(job.reply.token_event("", job.tokens), separators=(",", ":"))
    cut = event[: len(event) // 2].encode()  # JSON cut short
    if resp is None:
        return web.Response(body=cut, content_type="application/json")
    await resp.write(b"data: " + cut + b"\n\n")
    await resp.write_eof()
    return resp


def _drop(job: Job, resp: web.StreamResponse | None) -> web.StreamResponse:
    """Close the connection under a request that will never complete."""
    transport = job.request.transport
    if transport is not None:
        transport.close()
    return resp if resp is not None else web.Response(status=503)
