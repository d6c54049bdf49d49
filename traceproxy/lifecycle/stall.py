"""Stall deadlines: when a waiting request becomes a stall. No clock, no sleeping.

Theory of operation
-------------------
Each verdict (``attribution``) names the ``[stall]`` threshold that bounds its
wait. The deadline is ``since + threshold``; a threshold of 0 turns that kind of
stall off. The watchdog asks ``next_deadline`` for the earliest deadline over all
in-flight requests, sleeps until then, and asks ``judge`` what is stalled now.
A request whose wait keeps moving (a healthy stream) keeps pushing its deadline
forward, so a wake-up finds nothing and simply aims at the new earliest deadline.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Iterable, NamedTuple

from .attribution import Verdict, verdict
from .timeline import RequestRecord

MEANING = "meaning"  # a threshold field's metadata: what passing it means, for the [stall] settings' help


def _kind(default_seconds: float, meaning: str) -> Any:
    return field(default=default_seconds, metadata={MEANING: meaning})


@dataclass(frozen=True)
class StallThresholds:
    """Seconds per kind of wait; 0 = never a stall.

    Its fields are the stall kinds, declared here once: each verdict names the one that
    bounds its wait, and the [stall] settings take one key per kind (this default, this
    meaning) and list them in abort_on.
    """

    client_headers: float = _kind(10.0, "A request head started and not finished for this long is a stall "
                                        "(blame client).")
    client_body: float = _kind(30.0, "A request body the client stopped sending for this long is a stall "
                                     "(blame client).")
    pool_wait: float = _kind(5.0, "Waiting this long for an upstream connection (pool cap: proxy; connecting: "
                                  "engine) is a stall.")
    first_byte: float = _kind(120.0, "The request sent and no response header for this long is a stall (blame "
                                     "engine: router queue or prefill). For an event stream (text/event-stream) "
                                     "it counts output events, not bytes: a response head and then only "
                                     "heartbeats (SSE comments, empty or role-only deltas, pings) for this long, "
                                     "from the head, is one too. Long because a long prefill under load is "
                                     "normal.")
    stream_gap: float = _kind(30.0, "The upstream silent this long between response chunks is a stall (blame "
                                    "engine: decode). For an event stream (text/event-stream) it counts output "
                                    "events, not bytes: this long since its last event with output is one, "
                                    "whatever heartbeats came since.")
    client_drain: float = _kind(30.0, "Response bytes waiting this long because the client is not reading is a "
                                      "stall (blame client).")

    def ns(self, key: str) -> int:
        return int(getattr(self, key) * 1e9)


STALL_KINDS: tuple[str, ...] = tuple(f.name for f in fields(StallThresholds))
THRESHOLD_KEYS = STALL_KINDS  # the earlier name


class Judgement(NamedTuple):
    record: RequestRecord
    verdict: Verdict
    deadline_ns: int | None  # None: this kind of stall is off
    stalled: bool
    waited_ns: int


def judge(record: RequestRecord, now_ns: int, thresholds: StallThresholds) -> Judgement | None:
    found = verdict(record)
    if found is None:
        return None
    limit = thresholds.ns(found.threshold)
    deadline = found.since_ns + limit if limit else None
    waited = now_ns - found.since_ns
    return Judgement(record, found, deadline, deadline is not None and now_ns >= deadline, waited)


def judge_all(records: Iterable[RequestRecord], now_ns: int,
              thresholds: StallThresholds) -> tuple[list[Judgement], int | None]:
    """Every request stalled now, and the earliest deadline still ahead (None: nothing to wait for)."""
    stalled, earliest = [], None
    for record in records:
        j = judge(record, now_ns, thresholds)
        if j is None or j.deadline_ns is None:
            continue
        if j.stalled:
            stalled.append(j)
        elif earliest is None or j.deadline_ns < earliest:
            earliest = j.deadline_ns
    return stalled, earliest
