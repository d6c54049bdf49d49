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

from dataclasses import dataclass
from typing import Iterable, NamedTuple

from .attribution import Verdict, verdict
from .timeline import RequestRecord

THRESHOLD_KEYS = ("client_headers", "client_body", "pool_wait", "first_byte", "stream_gap", "client_drain")


@dataclass(frozen=True)
class StallThresholds:
    """Seconds per kind of wait; 0 = never a stall."""

    client_headers: float = 10.0
    client_body: float = 30.0
    pool_wait: float = 5.0
    first_byte: float = 120.0
    stream_gap: float = 30.0
    client_drain: float = 30.0

    def ns(self, key: str) -> int:
        return int(getattr(self, key) * 1e9)


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
