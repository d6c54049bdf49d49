"""SGLang's request stages on a simulated worker: the stage table, and one request's timeline.

Theory of operation
-------------------
SGLang's scheduler times every request from one queue transition to the next and
names each interval after its ``RequestStage`` table (``observability/req_time_stats.py``):

* a PD **prefill** worker: ``prefill_prepare`` (received -> bootstrap queue),
  ``prefill_bootstrap`` (-> waiting queue: the handshake with decode is done),
  ``prefill_waiting`` (-> forward), ``prefill_forward`` (-> prefill done; one nested
  ``chunked_prefill`` per chunk when the prompt is chunked), ``prefill_transfer_kv_cache``
  (transfer queue -> the KV cache has reached decode);
* a PD **decode** worker: ``decode_prepare`` (received -> prealloc queue),
  ``decode_bootstrap`` (-> transfer queue: the handshake with prefill is done),
  ``decode_transferred`` (-> waiting queue: the KV cache arrived), ``decode_waiting``
  (-> forward), ``decode_forward`` (-> the end; a nested ``fake_output`` for the token
  prefill made, then one nested ``decode_loop`` per decode step, ``decode_ct`` 0, 1, ...);
* a **unified** worker (not in PD; here: a decode worker used alone): ``request_process``
  (received -> waiting queue), ``prefill_waiting``, ``prefill_forward``,
  ``decode_waiting`` (prefill done -> first decode step), ``decode_forward``.

``RequestTimeline`` has one method per transition, named after the SGLang timestamp it
sets, and does at each what SGLang does: ends the stage that transition ends (its
span, when the worker traces: ``otel.RequestTrace``) and observes it in the histogram
``sglang:per_stage_req_latency_seconds`` when SGLang does (``StageKind.observed``).
A stage's span is exported when it ends; the two forward stages are open spans, the
parents of their nested stages, ended when the forward ends.

Which stage a request is in: the stage after the last one that ended, in its role's
``STAGE_ORDER`` (``stage_in``). Nested stages say how far the open forward stage got.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .gauges import EngineMetrics
    from .otel import RequestTrace

PREFILL, DECODE, UNIFIED = "prefill", "decode", "unified"
CHUNKED_PREFILL_SIZE = 8192  # SGLang's default --chunked-prefill-size: longer prompts prefill in chunks


@dataclass(frozen=True)
class StageKind:
    name: str
    level: int  # SGLang's trace level: 1 leaf, 2 dispatch, 3 nested
    observed: bool  # observed in sglang:per_stage_req_latency_seconds
    nested_in: str | None = None  # the open stage whose span is its parent


REQUEST_STAGES: dict[str, StageKind] = {kind.name: kind for kind in (
    StageKind("request_process", 2, True),
    StageKind("prefill_waiting", 1, False),  # SGLang observes it as sglang:queue_time_seconds instead
    StageKind("prefill_forward", 1, True),
    StageKind("chunked_prefill", 3, True, nested_in="prefill_forward"),
    StageKind("decode_forward", 1, False),
    StageKind("decode_loop", 3, False, nested_in="decode_forward"),
    StageKind("prefill_prepare", 1, False),
    StageKind("prefill_bootstrap", 1, True),
    StageKind("prefill_transfer_kv_cache", 1, True),
    StageKind("decode_prepare", 1, True),
    StageKind("decode_bootstrap", 1, True),
    StageKind("decode_waiting", 1, True),
    StageKind("decode_transferred", 1, True),
    StageKind("fake_output", 3, True, nested_in="decode_forward"),
)}

# The stages a request passes through on each kind of worker, in order (nested ones aside).
STAGE_ORDER: dict[str, tuple[str, ...]] = {
    PREFILL: ("prefill_prepare", "prefill_bootstrap", "prefill_waiting", "prefill_forward",
              "prefill_transfer_kv_cache"),
    DECODE: ("decode_prepare", "decode_bootstrap", "decode_transferred", "decode_waiting", "decode_forward"),
    UNIFIED: ("request_process", "prefill_waiting", "prefill_forward", "decode_waiting", "decode_forward"),
}


def stage_in(mode: str, ended: list[str] | tuple[str, ...] | set[str]) -> str | None:
    """The stage a request is in, given the names of its stage spans that have ended: the one
    after the last ended, in ``mode``'s order; None once the last stage ended."""
    order = STAGE_ORDER[mode]
    done = [order.index(name) for name in ended if name in order]
    following = max(done) + 1 if done else 0
    return order[following] if following < len(order) else None


class RequestTimeline:
    """One request's stages on one worker (``mode``: prefill, decode or unified)."""

    def __init__(self, mode: str, metrics: "EngineMetrics", trace: "RequestTrace | None" = None) -> None:
        if mode not in STAGE_ORDER:
            raise ValueError(f"mode must be one of {', '.join(STAGE_ORDER)}, not {mode!r}")
        self.mode, self.metrics, self.trace = mode, metrics, trace
        self.received = self._mark = time.perf_counter()  # where the next stage begins
        self._wall_offset_ns = time.time_ns() - int(self._mark * 1e9)
        self._forward_start = 0.0  # when the open forward stage began
        self._nested_mark = 0.0  # where the next nested stage begins
        self._chunks_done = 0
        self._prefill_done = 0.0
        self._decode_steps = 0
        self._transfer_queued = False
        self.ended: list[str] = []  # the stages that ended, in order (nested ones included)
        self.completed = False

    # -- prefill ----------------------------------------------------------------------
    def bootstrap_queue_entered(self) -> None:
        self._end("prefill_prepare")

    def transfer_queue_entered(self) -> None:
        """Prefill: its KV cache is on its way (the transfer stage begins). Decode: the
        handshake is done, it waits for the KV cache. Only the first call counts."""
        if self._transfer_queued:
            return
        self._transfer_queued = True
        if self.mode == DECODE:
            self._end("decode_bootstrap")
        else:
            self._mark = time.perf_counter()

    def kv_transfer_finished(self) -> None:
        self._end("prefill_transfer_kv_cache")

    # -- decode -----------------------------------------------------------------------
    def prealloc_queue_entered(self) -> None:
        self._end("decode_prepare")

    def prebuilt_finished(self) -> None:
        """Decode: the first token, made by prefill, is out (SGLang's fake output)."""
        self._end_nested("fake_output")

    def decode_scheduled(self) -> None:
        """Unified: the first decode step is scheduled after prefill."""
        now = time.perf_counter()
        self._record("decode_waiting", self._prefill_done, now, observe=False)  # SGLang only traces this one
        self._open("decode_forward", now)

    def decode_step_finished(self) -> None:
        self._end_nested("decode_loop", {"decode_ct": self._decode_steps})
        self._decode_steps += 1

    # -- both -------------------------------------------------------------------------
    def wait_queue_entered(self) -> None:
        self._end({PREFILL: "prefill_bootstrap", DECODE: "decode_transferred", UNIFIED: "request_process"}[self.mode])

    def forward_entered(self) -> None:
        waiting, forward = (("decode_waiting", "decode_forward") if self.mode == DECODE
                            else ("prefill_waiting", "prefill_forward"))
        self._end(waiting)
        self._open(forward, self._mark)

    def chunk_finished(self) -> None:
        """Prefill: a chunk of a chunked prompt is done, and more follow."""
        self._end_nested("chunked_prefill")
        self._chunks_done += 1

    def prefill_finished(self) -> None:
        now = time.perf_counter()
        if self._chunks_done:  # a chunked prompt: its last chunk (SGLang traces it, does not observe it)
            self._record("chunked_prefill", self._nested_mark, now, observe=False)
        self._close("prefill_forward", now)
        self._prefill_done = self._mark = now

    def complete(self, error: str | None = None) -> None:
        """The request is done (``error``: why it ended early): open spans end, then the
        request's own. Only the first call counts."""
        if self.completed:
            return
        self.completed = True
        if self.trace is not None:
            self.trace.finish(self._wall_ns(time.perf_counter()), error)

    # -- the mechanics --------------------------------------------------------------------
    def _end(self, stage: str) -> None:
        now = time.perf_counter()
        self._record(stage, self._mark, now)
        self._mark = now

    def _end_nested(self, stage: str, attributes: dict | None = None) -> None:
        now = time.perf_counter()
        self._record(stage, self._nested_mark, now, attributes=attributes)
        self._nested_mark = now

    def _open(self, stage: str, start: float) -> None:
        self._forward_start = self._nested_mark = start
        if self.trace is not None:
            self.trace.open(stage, self._wall_ns(start))

    def _close(self, stage: str, end: float) -> None:
        self._observe(stage, end - self._forward_start)
        self.ended.append(stage)
        if self.trace is not None:
            self.trace.close(stage, self._wall_ns(end))

    def _record(self, stage: str, start: float, end: float, *, observe: bool = True,
                attributes: dict | None = None) -> None:
        if observe:
            self._observe(stage, end - start)
        self.ended.append(stage)
        if self.trace is not None:
            self.trace.stage(stage, self._wall_ns(start), self._wall_ns(end), attributes)

    def _observe(self, stage: str, seconds: float) -> None:
        if REQUEST_STAGES[stage].observed:
            self.metrics.observe_stage(stage, max(0.0, seconds))

    def _wall_ns(self, perf: float) -> int:
        return self._wall_offset_ns + int(perf * 1e9)
