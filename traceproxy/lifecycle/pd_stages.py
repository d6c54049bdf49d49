"""Which PD stage holds a request: SGLang's request stages, the component each one is
part of, and the stage a request is in. Pure: no clock, no I/O.

Theory of operation
-------------------
SGLang launched with ``--enable-trace`` exports one span per request stage, named after
its ``RequestStage`` table, when that stage ends (``python/sglang/srt/tracing/trace.py``).
Each stage is the interval that ends at one queue transition, so on one worker:

* **prefill**: ``prefill_prepare`` (to the bootstrap queue), ``prefill_bootstrap`` (the
  handshake with decode), ``prefill_waiting``, ``prefill_forward`` (with one nested
  ``chunked_prefill`` per chunk), ``prefill_transfer_kv_cache`` (until the KV cache
  reached decode);
* **decode**: ``decode_prepare``, ``decode_bootstrap`` (the handshake),
  ``decode_transferred`` (until the KV cache arrived), ``decode_waiting`` (for a slot),
  ``decode_forward`` (with nested ``fake_output`` and one ``decode_loop`` per step);
* **unified** (a worker used alone): ``request_process``, ``prefill_waiting``,
  ``prefill_forward``, ``decode_waiting``, ``decode_forward``.

While a request hangs, the stages that ended are known; **the stage it is in is the
next after the last that ended**, in its role's order (``stage_in``). A worker's
request span, its scheduler-thread span and its Bootstrap Room span end when the
request ends there, so a worker whose thread span arrived has finished its part.

Each stage belongs to one **component** of the PD pipeline, the words a verdict uses:
``router`` (no engine has the request), ``prefill``, ``bootstrap`` (the handshake,
either side), ``kv_transfer`` (prefill sending, or decode waiting for, the KV cache)
and ``decode``. A PD request is on two workers at once; the one that **holds** it is
the one least far along the pipeline (``RANK``): while prefill computes, decode waits
for the KV cache, and the hang is prefill's. Ties go to prefill, the sender. When
every worker has finished, the request is past the engines: the stage is then the
last one that ended (``state`` "ended").

Without spans the engines' gauges say as much for the engines as a whole, not per
request (``from_gauges``): each gauge counts requests in one queue, which is one of the
stages above. With one request hung and the rest moving it names the same stage;
with many, it names where the work piles up.

What this module does not know: span formats, which trace a request has, clocks. It
takes what observe/ read from spans and gauges, and times in the caller's clock.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import lru_cache

COMPONENTS = ("router", "prefill", "bootstrap", "kv_transfer", "decode")
ROUTER, PREFILL_C, BOOTSTRAP, KV_TRANSFER, DECODE_C = COMPONENTS
PREFILL, DECODE, UNIFIED = "prefill", "decode", "unified"
ROLES = (PREFILL, DECODE, UNIFIED)

STAGE_ORDER: dict[str, tuple[str, ...]] = {
    PREFILL: ("prefill_prepare", "prefill_bootstrap", "prefill_waiting", "prefill_forward",
              "prefill_transfer_kv_cache"),
    DECODE: ("decode_prepare", "decode_bootstrap", "decode_transferred", "decode_waiting", "decode_forward"),
    UNIFIED: ("request_process", "prefill_waiting", "prefill_forward", "decode_waiting", "decode_forward"),
}
# Stages nested in an open forward stage: they say how far it got, never move a request on.
NESTED_IN = {"chunked_prefill": "prefill_forward", "fake_output": "decode_forward", "decode_loop": "decode_forward"}

COMPONENT_OF: dict[str, str] = {
    "prefill_prepare": PREFILL_C, "prefill_bootstrap": BOOTSTRAP, "prefill_waiting": PREFILL_C,
    "prefill_forward": PREFILL_C, "chunked_prefill": PREFILL_C, "prefill_transfer_kv_cache": KV_TRANSFER,
    "decode_prepare": DECODE_C, "decode_bootstrap": BOOTSTRAP, "decode_transferred": KV_TRANSFER,
    "decode_waiting": DECODE_C, "decode_forward": DECODE_C, "fake_output": DECODE_C, "decode_loop": DECODE_C,
    "request_process": PREFILL_C,
}
STAGES = frozenset(COMPONENT_OF)
# How far along the PD pipeline each stage is; the lowest among a request's workers holds it.
RANK: dict[str, int] = {
    "prefill_prepare": 0, "decode_prepare": 0, "request_process": 0,
    "prefill_bootstrap": 1, "decode_bootstrap": 1,
    "prefill_waiting": 2, "prefill_forward": 3, "chunked_prefill": 3,
    "prefill_transfer_kv_cache": 4, "decode_transferred": 4,
    "decode_waiting": 5, "decode_forward": 6, "fake_output": 6, "decode_loop": 6,
}
# The stages only one role has: one of them names a worker's role.
_ROLE_OF_STAGE = {name: role for role in (PREFILL, DECODE) for name in STAGE_ORDER[role]
                  if sum(name in order for order in STAGE_ORDER.values()) == 1}
_ROLE_OF_STAGE.update({"request_process": UNIFIED, "chunked_prefill": PREFILL, "fake_output": DECODE})


def role_of_stage(name: str) -> str | None:
    """The role a stage name says, when only one role has it."""
    return _ROLE_OF_STAGE.get(name)


@lru_cache(maxsize=1024)  # a worker's label (or thread span name) comes with every request it finishes
def role_of_thread(label: str) -> str | None:
    """``Prefill Scheduler`` -> prefill, ``Decode Scheduler`` -> decode, ``Scheduler`` -> unified
    (SGLang's thread labels, also the start of its thread span names)."""
    first = label.strip().split(" ", 1)[0].lower()
    if first in (PREFILL, DECODE):
        return first
    return UNIFIED if first == "scheduler" else None


def stage_in(role: str, ended: Iterable[str]) -> str | None:
    """The stage a request is in on a worker of ``role``: the one after the last of its
    stages that ended, in the role's order; None once the last one ended."""
    order = STAGE_ORDER[role]
    done = [order.index(name) for name in ended if name in order]
    following = max(done) + 1 if done else 0
    return order[following] if following < len(order) else None


# ----------------------------------------------------------------------------------
# One request's workers, from their spans
# ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Worker:
    """Who exported a worker's spans: the resource's service.name, and the host and pid
    of its scheduler thread (SGLang's thread span; empty and None until known)."""

    service: str = ""
    host: str = ""
    pid: int | None = None

    def as_dict(self) -> dict:
        return {"service": self.service or None, "host": self.host or None, "pid": self.pid}

    def __str__(self) -> str:
        where = f"{self.service or '?'}"
        if self.host:
            where += f" host {self.host[:8]}"
        if self.pid is not None:
            where += f" pid {self.pid}"
        return where


@dataclass(frozen=True)
class WorkerProgress:
    """One worker's part of one request, as its spans tell it.

    ``ended``: its top-level stages that ended; ``last_end_ns``: when the latest stage
    (nested ones too) ended; ``finished``: its request ended there."""

    role: str
    ended: tuple[str, ...]
    last_end_ns: int
    finished: bool = False
    worker: Worker = Worker()
    nested: str = ""  # the latest nested stage that ended, e.g. decode_loop


@dataclass(frozen=True)
class EngineStage:
    """Where the engines have a request: ``state`` "in" (the stage it is in now) or
    "ended" (every worker finished; ``stage`` is the last that ended). ``since_ns`` in
    the caller's clock, None when not known; ``source`` "spans" or "gauges"."""

    component: str
    role: str
    stage: str | None
    state: str
    since_ns: int | None
    worker: Worker | None
    source: str
    detail: str = ""  # the gauges' words, or how far a forward stage got

    def as_dict(self, now_ns: int) -> dict:
        since = None if self.since_ns is None else round(max(now_ns - self.since_ns, 0) / 1e9, 3)
        out = {"component": self.component, "role": self.role, "stage": self.stage, "state": self.state,
               "worker": self.worker.as_dict() if self.worker is not None else None, "since_s": since,
               "source": self.source}
        if self.detail:
            out["detail"] = self.detail
        return out

    def words(self) -> str:
        """``kv_transfer (prefill prefill_transfer_kv_cache, sglang host 1a2b3c4d pid 12; from spans)``,
        for log lines."""
        role = self.role if self.role != self.component or self.stage else ""
        parts = [" ".join(part for part in (role, self.stage or "", "ended" if self.state == "ended" else "")
                          if part)]
        if self.worker is not None:
            parts[0] += f", {self.worker}" if parts[0] else str(self.worker)
        parts += [self.detail, f"from {self.source}"]
        return f"{self.component} ({'; '.join(part for part in parts if part)})"


def position(progress: WorkerProgress) -> tuple[str, str]:
    """(stage, state) of one worker: the stage it is in, or its last stage that ended."""
    return _position(progress.role, progress.ended, progress.finished, progress.nested)


@lru_cache(maxsize=4096)
def _position(role: str, ended: tuple[str, ...], finished: bool, nested: str) -> tuple[str, str]:
    # Cached: the span store asks at every export request for each trace it touched, and a
    # request's workers go through a handful of (role, stages ended) on their way.
    if not finished:
        current = stage_in(role, ended) if role in STAGE_ORDER else None
        if current is not None:
            return current, "in"
    order = STAGE_ORDER.get(role, ())
    done = [name for name in ended if name in order]
    last = max(done, key=order.index) if done else nested
    return last, "ended"


def holding(workers: Iterable[WorkerProgress]) -> EngineStage | None:
    """The engines' hold on one request: the worker least far along, among those that have
    not finished; when all have, the one that ended last. None without any worker."""
    workers = [w for w in workers if w.role in STAGE_ORDER]
    if not workers:
        return None
    placed = [(w, *position(w)) for w in workers]
    open_ones = [p for p in placed if p[2] == "in"]
    if open_ones:
        held = min(open_ones, key=lambda p: (RANK.get(p[1], 99), _ROLE_PREFERENCE.get(p[0].role, 9)))
    else:
        held = max(placed, key=lambda p: p[0].last_end_ns)
    progress, stage, state = held
    detail = f"after {progress.nested}" if state == "in" and progress.nested and \
        NESTED_IN.get(progress.nested) == stage else ""
    return EngineStage(COMPONENT_OF.get(stage, progress.role), progress.role, stage or None, state,
                       progress.last_end_ns or None, progress.worker, "spans", detail)


_ROLE_PREFERENCE = {PREFILL: 0, UNIFIED: 1, DECODE: 2}


def not_opened(since_ns: int) -> EngineStage:
    """A request the proxy sent upstream that no engine has opened (no span of it): the router has it."""
    return EngineStage(ROUTER, "router", None, "in", since_ns, None, "spans", "no engine has opened it")


# ----------------------------------------------------------------------------------
# The same from the engines' gauges, by role
# ----------------------------------------------------------------------------------
# (role, gauge short name as correlation.WORK_GAUGES names it) -> (the stage that queue is, its words)
GAUGE_STAGES: dict[tuple[str, str], tuple[str, str]] = {
    (PREFILL, "prefill_prealloc"): ("prefill_bootstrap", "bootstrap queue"),
    (PREFILL, "prefill_bootstrap"): ("prefill_bootstrap", "bootstrap queue"),
    (PREFILL, "queued"): ("prefill_waiting", "waiting queue"),
    (PREFILL, "running"): ("prefill_forward", "running"),
    (PREFILL, "prefill_inflight"): ("prefill_transfer_kv_cache", "KV-transfer queue"),
    (DECODE, "decode_prealloc"): ("decode_bootstrap", "bootstrap queue"),
    (DECODE, "decode_transfer"): ("decode_transferred", "KV-transfer queue"),
    (DECODE, "queued"): ("decode_waiting", "waiting queue"),
    (DECODE, "running"): ("decode_forward", "running"),
}


def from_gauges(by_role: Mapping[str, Mapping[str, float]], router_running: float | None,
                streaming: bool) -> EngineStage | None:
    """Where the engines hold work, from gauges summed per role (``by_role``: "prefill" and
    "decode" -> short gauge name -> value; ``router_running``: the router's requests in
    flight, None when no router endpoint is labelled). ``streaming``: the request's
    response has started, so only decode's side can hold it. None when no labelled
    worker reports work and the router reports none either."""
    candidates = _gauge_candidates(by_role)
    sentence = gauge_sentence(by_role, router_running, candidates)
    if streaming:
        candidates = [c for c in candidates if c[2] == DECODE]
    if candidates:
        _, _, role, stage, _, _ = min(candidates)
        return EngineStage(COMPONENT_OF[stage], role, stage, "in", None, None, "gauges", sentence)
    if router_running and not streaming:
        return EngineStage(ROUTER, "router", None, "in", None, None, "gauges", sentence)
    return None


def _gauge_candidates(by_role: Mapping[str, Mapping[str, float]]) -> list[tuple]:
    """(rank, role preference, role, stage, words, value) for every queue holding work."""
    found = []
    for (role, gauge), (stage, words) in GAUGE_STAGES.items():
        value = (by_role.get(role) or {}).get(gauge, 0.0)
        if value > 0:
            found.append((RANK[stage], _ROLE_PREFERENCE[role], role, stage, words, value))
    return found


def gauge_sentence(by_role: Mapping[str, Mapping[str, float]], router_running: float | None,
                   candidates: list | None = None) -> str:
    """``prefill holds 1 in its KV-transfer queue, decode 0, router 1 running``."""
    if candidates is None:
        candidates = _gauge_candidates(by_role)
    parts = []
    for role in (PREFILL, DECODE):
        if role not in by_role:
            continue
        mine = [c for c in candidates if c[2] == role]
        if mine:
            _, _, _, _, words, value = min(mine)
            parts.append(f"{role} holds {value:g} in its {words}" if words != "running"
                         else f"{role} {value:g} running")
        else:
            parts.append(f"{role} 0")
    if router_running is not None:
        parts.append(f"router {router_running:g} running")
    return ", ".join(parts)
