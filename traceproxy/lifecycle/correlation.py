"""Cross-checks between the proxy's own view and the engines' ``/metrics``. Pure.

Theory of operation
-------------------
The proxy knows which of its requests are at the engines (sent, awaiting the
response head, or streaming). The engines (SGLang prefill/decode workers, the
router) publish gauges of the work they hold. Comparing the two once per scrape
gives three verdicts, each a row of ``flags``:

* ``EOR`` engine orphan: the engines hold more work than the proxy has requests at
  the engines, for longer than ``orphan_after``. Nobody is waiting for that work
  (a leaked queue slot, a request whose client is gone): blame the engine, and no
  client request, since no client request explains it.
* ``LST`` lost before the engine: a request waits for its response head while the
  engines hold nothing at all. Its bytes went somewhere between the proxy and the
  engines, i.e. the router or the network: blame unknown (not the client, not the
  proxy's socket, not the engines' work).
* ``ESL`` engine slow: a request waits at a phase and the engines report work at
  that phase: the engine side has it and is taking its time (blame engine).

Counting the engines' work: a PD request is counted on its prefill worker and on
its decode worker at the same time (decode preallocates while prefill runs), so
summing every endpoint would double-count every request in flight and make a busy
healthy deployment look orphaned. The engines' count is therefore the largest
per-endpoint total: a lower bound that never double-counts. Hazard: with several
workers of one role, an orphan on one worker can be hidden by load on another; and
clients that bypass the proxy put work at the engines that no proxied request
explains, so orphans are over-reported. Both are documented limits. The proxy's
side is the whole service's: with ``--workers N`` the count is every worker's
(``observe.engines``), never one worker's share of the traffic.

The gauges and the proxy's count are not sampled at the same instant, which is
why an orphan must persist for ``orphan_after`` and a request must have waited
``LOST_SETTLE_NS`` before the scrape for ``LST`` to apply.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from .flags import Flag, Outcome
from .machine import Phase

# Short names used in summaries, /debug/inflight and span attributes.
WORK_GAUGES: dict[str, str] = {
    "sglang:num_running_reqs": "running",
    "sglang:num_queue_reqs": "queued",
    "sglang:num_prefill_inflight_queue_reqs": "prefill_inflight",
    "sglang:num_prefill_prealloc_queue_reqs": "prefill_prealloc",
    "sglang:num_prefill_bootstrap_queue_reqs": "prefill_bootstrap",
    "sglang:num_decode_transfer_queue_reqs": "decode_transfer",
    "sglang:num_decode_prealloc_queue_reqs": "decode_prealloc",
}
# The gauges that mean "working on a response already started" (decode side).
STREAMING_GAUGES = frozenset({"sglang:num_running_reqs", "sglang:num_decode_transfer_queue_reqs"})

# The phases in which a request is at the engines (the proxy cannot tell which one).
UPSTREAM_PHASES = frozenset({Phase.SENDING_REQUEST_UPSTREAM, Phase.AWAITING_UPSTREAM_HEADERS,
                             Phase.STREAMING_RESPONSE})
# How long a request must have been waiting when the gauges were read before
# "the engines hold nothing" says it is lost: the router needs a moment to hand it on.
LOST_SETTLE_NS = 1_000_000_000


def is_kept(name: str) -> bool:
    """The metric names the scraper keeps: SGLang work gauges, router active/error series."""
    return name in WORK_GAUGES or (name.startswith("smg_") and ("active" in name or "error" in name))


def endpoint_work(gauges: Mapping[str, float]) -> float:
    return sum(gauges.get(name, 0.0) for name in WORK_GAUGES)


def engines_work(endpoints: Iterable[Mapping[str, float]]) -> float:
    """The engines' requests in flight: the largest per-endpoint total (see the module doc)."""
    return max((endpoint_work(g) for g in endpoints), default=0.0)


def engines_streaming(endpoints: Iterable[Mapping[str, float]]) -> float:
    return max((sum(g.get(n, 0.0) for n in STREAMING_GAUGES) for g in endpoints), default=0.0)


def summary(endpoints: Iterable[Mapping[str, float]]) -> str:
    """``running=1 queued=0 prefill_inflight=1``: each short name summed over endpoints,
    only the gauges some endpoint reports."""
    totals: dict[str, float] = {}
    for gauges in endpoints:
        for name, short in WORK_GAUGES.items():
            if name in gauges:
                totals[short] = totals.get(short, 0.0) + gauges[name]
    return " ".join(f"{short}={value:g}" for short, value in totals.items())


# -- the orphan rule: a little state carried from scrape to scrape ---------------------------


@dataclass(frozen=True)
class OrphanState:
    excess: float = 0.0  # engine work the proxy does not explain, at the last check
    since_ns: int | None = None  # when the excess began; None: no excess
    reported: bool = False  # the excess has lasted orphan_after


def check_orphans(prev: OrphanState, engine_work: float, proxy_upstream: int, now_ns: int,
                  orphan_after_ns: int) -> OrphanState:
    excess = max(engine_work - proxy_upstream, 0.0)
    if excess <= 0:
        return OrphanState()
    since = prev.since_ns if prev.since_ns is not None else now_ns
    return OrphanState(excess, since, now_ns - since >= orphan_after_ns)


ORPHAN = Flag.EOR


# -- per-request correlation ------------------------------------------------------------------


def correlate(phase: Phase, waiting_since_ns: int, engine_work: float | None, engine_streaming: float,
              scraped_ns: int | None) -> Outcome | None:
    """The engines' side of one waiting request, or None when the gauges say nothing about it.

    ``engine_work`` None: no endpoint has answered yet.
    """
    if engine_work is None or scraped_ns is None:
        return None
    if phase is Phase.AWAITING_UPSTREAM_HEADERS:
        if engine_work > 0:
            return Flag.ESL
        if scraped_ns - waiting_since_ns >= LOST_SETTLE_NS:
            return Flag.LST
        return None
    if phase is Phase.STREAMING_RESPONSE and engine_streaming > 0:
        return Flag.ESL
    return None
