"""The engine scraper: the engines' own gauges, read in the background, for correlation.

Theory of operation
-------------------
One background task. Every ``scrape_interval`` it GETs each metrics URL at once
(aiohttp, each bounded by ``scrape_timeout``), keeps the SGLang work gauges and the
router's ``smg_*`` active/error series (``correlation.is_kept``), summed over label
sets per name, and then runs the orphan rule (``correlation.check_orphans``) against
the proxy's count of requests at the engines.

Endpoints may be labelled by role (``router_metrics_urls``, ``prefill_metrics_urls``,
``decode_metrics_urls``; ``metrics_urls`` are unlabelled): the work gauges are then
also summed per role (``by_role``), and a router's requests in flight read from its
request and response totals (``router_running``), so that without engine spans the
join (``engine_join``) can still name the PD component where the engines hold work
(``lifecycle.pd_stages.from_gauges``).

When engine spans are received (``receiver``: ``engine_receiver.EngineSpans``), the
engine work no request in flight explains, idle for ``orphan_after``, is named by worker
and stage (``unexplained``): in ``/debug/inflight`` and, while an orphan is reported, in
a log line each. With spans and no metrics URL the scraper exists for that alone, and
scrapes nothing.

Nothing here is on the request path: requests never await a scrape, and what the
readers want (``/debug/inflight``, a stall log line, a stall span, a metrics scrape)
is derived once per scrape (``_derive``) and read as attributes. A failing or slow
endpoint costs at most one timeout per interval in this task; it is counted (its
``Endpoint.errors``), shown with its error,
and logged once when it starts failing and once when it recovers. The scraper is
only built when ``[engines] metrics_urls`` is not empty.

One scraper per service. With several workers it runs in the service's parent
(the engines hold every worker's requests, so the orphan rule needs the service's
count, not one worker's): ``count_at_engines`` is an awaitable that asks every
worker, and answers None when one did not answer in time, and then the orphan rule
waits for the next scrape rather than judge a partial count (which would read as
engine work nobody explains). After each scrape the readings a worker needs for its
own requests (``EngineReadings``: the engines' work, streaming work, when they were
read and the summary for log lines and stall spans) go to ``on_readings``
listeners; each worker keeps them in an ``EngineReadings`` of its own.

``count_at_engines`` is passed in by the composition root: this module imports
``lifecycle`` and the exposition parser of ``metrics`` (which itself imports
``lifecycle`` only).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field

import aiohttp

from ..lifecycle import correlation
from ..lifecycle.machine import phase_of
from ..lifecycle.timeline import RequestRecord
from .metrics import prometheus_totals

log = logging.getLogger("traceproxy.engines")

# An engine's exposition is tens to hundreds of KiB; far past that, the URL is wrong.
MAX_BODY_BYTES = 4 << 20
ROLES = ("router", "prefill", "decode")
# A router's requests in flight (sglang-router, smg): HTTP requests received minus responses
# sent. Hazard: sglang-router 0.3.2 counts no response for a request whose client left first,
# so after such requests the difference stays above the truth (its per-worker
# smg_worker_requests_active does not have that fault, but counts /generate only).
ROUTER_REQUESTS, ROUTER_RESPONSES = "smg_http_requests_total", "smg_http_responses_total"


@dataclass
class Endpoint:
    url: str
    role: str = ""  # router, prefill, decode; "" unlabelled
    gauges: dict[str, float] = field(default_factory=dict)
    router_running: float | None = None  # a router's requests in flight (ROUTER_REQUESTS - ROUTER_RESPONSES)
    scraped_ns: int | None = None  # last successful scrape
    error: str | None = None  # the last scrape's failure; None when it succeeded
    errors: int = 0  # failed scrapes


def _parse(body: bytes) -> dict[str, float]:
    """The kept gauges of one answer; raises ValueError for an answer that is not
    Prometheus text (an HTML page at a wrong URL must not read as engines holding nothing)."""
    text = body.decode("utf-8")
    gauges = prometheus_totals(text, correlation.is_kept, finite_only=True)
    if not gauges and text.strip() and not prometheus_totals(text) and \
            not any(line.startswith("#") for line in text.splitlines()):
        raise ValueError("the answer holds no Prometheus samples (is this a /metrics URL?)")
    return gauges


def _parse_for(body: bytes, role: str) -> tuple[dict[str, float], float | None]:
    """``_parse``, and for a router endpoint its requests in flight."""
    gauges = _parse(body)
    if role != "router":
        return gauges, None
    totals = prometheus_totals(body.decode("utf-8"), (ROUTER_REQUESTS, ROUTER_RESPONSES).__contains__,
                               finite_only=True)
    return gauges, max(totals.get(ROUTER_REQUESTS, 0.0) - totals.get(ROUTER_RESPONSES, 0.0), 0.0)


def by_role(endpoints: Iterable[Endpoint]) -> tuple[dict[str, dict[str, float]], float | None]:
    """The work gauges summed per worker role (short names), and the routers' requests in
    flight (None: no router endpoint answered); only endpoints labelled and answering."""
    roles: dict[str, dict[str, float]] = {}
    running = None
    for ep in endpoints:
        if ep.scraped_ns is None or not ep.role:
            continue
        if ep.role == "router":
            running = (running or 0.0) + (ep.router_running or 0.0)
            continue
        totals = roles.setdefault(ep.role, {})
        for name, short in correlation.WORK_GAUGES.items():
            totals[short] = totals.get(short, 0.0) + ep.gauges.get(name, 0.0)
    return roles, running


def proxy_upstream_count(records: Iterable[RequestRecord]) -> int:
    return sum(1 for r in records if phase_of(r) in correlation.UPSTREAM_PHASES)  # finished ones are DONE


class EngineReadings:
    """What correlates one waiting request with the engines, read as attributes: set by
    the scraper once per scrape, or, in a worker of several, from the service's scraper
    (``update`` with what ``message`` gave there)."""

    FIELDS = ("work", "streaming", "oldest_scrape_ns", "summary", "by_role", "router_running")

    def __init__(self) -> None:
        self.work: float | None = None  # the engines' requests in flight; None before any answer
        self.streaming = 0.0
        self.oldest_scrape_ns: int | None = None
        self.summary = "no data"  # "running=1 queued=0 prefill_inflight=1", for log lines and stall spans
        self.by_role: dict[str, dict[str, float]] = {}  # labelled endpoints' work gauges, per worker role
        self.router_running: float | None = None
        # Set by the composition root: whether gauges are scraped at all (a worker's readings
        # may carry engine span stages only); in a worker of several, the engine spans'
        # stages its parent sends with the readings (an engine_join.StageFacts); and the
        # process's join (an engine_join.EngineStageJoin), read by /debug/inflight entries,
        # stall log lines and stall spans.
        self.scraping = True
        self.stage_facts = None
        self.join = None

    def message(self) -> dict:
        return {name: getattr(self, name) for name in self.FIELDS}

    def update(self, message: dict) -> None:
        """A scrape's readings, or (``stages``) the engine spans' stages that changed:
        a message carries either."""
        for name in self.FIELDS:
            if name in message:
                setattr(self, name, message[name])
        if "stages" in message and self.stage_facts is not None:
            self.stage_facts.update(message["stages"], time.monotonic_ns())

    def correlate(self, phase, waiting_since_ns: int) -> "correlation.Outcome | None":
        if self.work is None:
            return None
        return correlation.correlate(phase, waiting_since_ns, self.work, self.streaming, self.oldest_scrape_ns)


def counting(in_flight: Callable[[], Iterable[RequestRecord]]) -> Callable[[], Awaitable[int]]:
    """``count_at_engines`` for a scraper beside the records themselves (one process)."""

    async def count() -> int:
        return proxy_upstream_count(in_flight())

    return count


class EngineScraper(EngineReadings):
    """``urls``: unlabelled metrics URLs; ``roles``: more, by role ("router", "prefill", "decode")."""

    def __init__(self, urls: Iterable[str], count_at_engines: Callable[[], Awaitable[int | None]], *,
                 interval: float, timeout: float, orphan_after: float,
                 roles: dict[str, Iterable[str]] | None = None) -> None:
        super().__init__()
        self.endpoints = {url: Endpoint(url) for url in urls}
        for role, role_urls in (roles or {}).items():
            for url in role_urls:
                self.endpoints[url] = Endpoint(url, role)
        self.receiver = None  # engine_receiver.EngineSpans, when engine spans are received in this process
        # The trace ids in flight in the service (None: a worker did not say), for unexplained().
        self.traces_in_flight: Callable[[], Awaitable[frozenset[int] | None]] | None = None
        self._named: set[int] = set()  # engine work named in the orphan episode under way
        self.count_at_engines = count_at_engines
        self.interval, self.timeout = interval, timeout
        self.orphan_after_ns = int(orphan_after * 1e9)
        self.orphan = correlation.OrphanState()
        self.orphans_total = 0  # orphan episodes reported
        self.proxy_at_engines: int | None = None  # the count the orphan rule last compared with
        self.checks_skipped = 0  # orphan checks left for the next scrape: a worker did not give its count
        self.on_readings: list[Callable[[dict], None]] = []
        self._task: asyncio.Task | None = None
        self._session: aiohttp.ClientSession | None = None

    # -- running -------------------------------------------------------------------
    def start(self) -> None:
        if self.endpoints:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="traceproxy-engine-scraper")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
            self._task = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _run(self) -> None:
        # One session, no connection reuse limits beyond aiohttp's: a handful of URLs.
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout))
        while True:
            await self.scrape_once()
            await asyncio.sleep(self.interval)

    async def scrape_once(self) -> None:
        await asyncio.gather(*(self._scrape(ep) for ep in self.endpoints.values()))
        self._derive()
        if self.work is not None:
            self._check_orphans(await self.count_at_engines(), time.monotonic_ns())
            if self.orphan.reported:
                await self._name_orphans()
            else:
                self._named.clear()
        message = self.message()
        for listener in self.on_readings:
            listener(message)

    def _derive(self) -> None:
        answered = [ep for ep in self.endpoints.values() if ep.scraped_ns is not None]
        if not answered:
            return
        fresh = [ep.gauges for ep in answered]
        self.work, self.streaming = correlation.engines_work(fresh), correlation.engines_streaming(fresh)
        self.oldest_scrape_ns = min(ep.scraped_ns for ep in answered)
        self.summary = correlation.summary(fresh) or "no data"
        self.by_role, self.router_running = by_role(answered)

    async def _scrape(self, ep: Endpoint) -> None:
        try:
            # wait_for as well as the session timeout: a server that accepts and never
            # answers must not hold this task past the timeout whatever aiohttp does.
            body = await asyncio.wait_for(self._get(ep.url), self.timeout)
            # Parsed in a thread: even a body at the size cap is tens of milliseconds of
            # Python, which on the loop would hold up every request for that long.
            gauges, running = await asyncio.to_thread(_parse_for, body, ep.role)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # any failure of one endpoint is that endpoint's state
            self._failed(ep, f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)
            return
        ep.gauges, ep.router_running, ep.scraped_ns = gauges, running, time.monotonic_ns()
        if ep.error is not None:
            log.info("engine metrics %s answer again", ep.url)
        ep.error = None

    async def _get(self, url: str) -> bytes:
        async with self._session.get(url) as resp:
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}")
            body = bytearray()
            async for piece in resp.content.iter_chunked(65536):
                body += piece
                if len(body) > MAX_BODY_BYTES:
                    raise ValueError(f"the answer is larger than {MAX_BODY_BYTES >> 20} MiB")
            return bytes(body)

    def _failed(self, ep: Endpoint, error: str) -> None:
        ep.errors += 1
        if ep.error is None:  # log once per state change, not once per interval
            log.warning("engine metrics %s failing: %s (correlation uses the last good values)", ep.url, error)
        ep.error = error

    # -- the orphan rule -------------------------------------------------------------
    def _check_orphans(self, proxy: int | None, now: int) -> None:
        work = self.work
        if proxy is None:  # a worker's count is missing: a partial count would read as orphans
            self.checks_skipped += 1
            return
        prev = self.orphan
        self.proxy_at_engines = proxy
        self.orphan = correlation.check_orphans(prev, work, proxy, now, self.orphan_after_ns)
        if self.orphan.reported and not prev.reported:
            self.orphans_total += 1
            log.warning("engine orphan %s: the engines report %g requests in flight, the proxy has %d at the "
                        "engines, for %.1f s; blame engine (no client request is blamed); engines: %s",
                        correlation.ORPHAN.code, work, proxy, (now - self.orphan.since_ns) / 1e9, self.summary)
        elif prev.reported and not self.orphan.reported:
            log.warning("engine orphan %s cleared; engines: %s", correlation.ORPHAN.code, self.summary)

    async def _name_orphans(self) -> None:
        """While an orphan is reported, each engine work no request in flight explains, by
        worker and stage, once, when spans say. The requests in flight are asked for (all the
        workers', with several) only when there is such work not named yet."""
        if self.receiver is None or self.traces_in_flight is None:
            return
        now = time.time_ns()
        if not [trace_id for trace_id, _ in self.unexplained(frozenset(self._named), now)]:
            return
        in_flight = await self.traces_in_flight()
        if in_flight is None:  # a worker did not say: a partial list would name requests in flight
            return
        for trace_id, stage in self.unexplained(in_flight | self._named, now):
            self._named.add(trace_id)
            log.warning("engine orphan %s: trace_id=%032x is held at the engines and in flight nowhere in the "
                        "proxy: %s", correlation.ORPHAN.code, trace_id, stage.words())

    def unexplained(self, in_flight: frozenset[int], now_wall_ns: int) -> list:
        """(trace id, EngineStage), oldest first, of the engine spans' work not finished that
        no request in ``in_flight`` (trace ids) has, idle for ``orphan_after`` (since its last
        stage ended). Empty without spans."""
        if self.receiver is None:
            return []
        return [(trace_id, stage) for trace_id, stage in self.receiver.open_work()
                if trace_id not in in_flight and stage.since_ns is not None
                and now_wall_ns - stage.since_ns >= self.orphan_after_ns]

    # -- reading (cheap: no I/O) -------------------------------------------------------
    def orphaned(self) -> float:
        return self.orphan.excess if self.orphan.reported else 0.0

    def snapshot(self, now: int) -> dict:
        """The ``engines`` object of ``/debug/inflight``."""
        return {
            url: {"gauges": dict(ep.gauges),
                  "last_scrape_age_s": None if ep.scraped_ns is None else round((now - ep.scraped_ns) / 1e9, 3),
                  "error": ep.error, "errors": ep.errors}
            for url, ep in self.endpoints.items()
        }

    def top_level(self, proxy_at_engines: int | None) -> dict:
        """The top-level ``correlation`` object of ``/debug/inflight``; ``proxy_at_engines``
        as counted with the entries it goes with."""
        o = self.orphan
        return {
            "engine_in_flight": self.work,
            "proxy_at_engines": proxy_at_engines,
            "orphan": {"outcome": correlation.ORPHAN.code, "name": correlation.ORPHAN.name,
                       "blame": correlation.ORPHAN.blame.value, "unexplained": o.excess,
                       "reported": o.reported, "orphaned": self.orphaned(), "episodes": self.orphans_total},
        }
