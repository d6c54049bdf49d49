"""Wiring of the engine side: the gauge scraper, the engine span receiver and the join,
for one process, for a worker of several, and for the service's parent.

What runs where (``docs/decisions/0028``: one view of the service):

* one process: the scraper and the join in the proxy's process; the engine span
  receivers in a process of their own (``observe.engine_receiver_proc``), at the
  exporter's lower priority, which sends the proxy the stages that changed as a
  service's parent sends its workers: taking the engines' exports is CPU the proxy's
  loop would otherwise give up;
* several workers: the parent scrapes the gauges and receives the engine spans, once
  for the service, and sends each worker the readings and the stages that changed
  over its link (``workers.py``, as ``engines`` messages); each worker joins them with
  its own requests (``EngineStageJoin``) for its in-flight entries, stall lines, stall
  spans and access log lines.

With neither metrics URLs nor a receiver configured, nothing here is built and no
path of the proxy changes.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time

from .config import ConfigError, Settings
from .config.addresses import HostPort
from .hostnames import is_loopback

log = logging.getLogger("traceproxy")
CLAIM_EVERY_S = 1.0
RECEIVER_KEYS = ("otlp_receiver", "otlp_receiver_grpc")


def role_urls(settings: Settings) -> dict[str, tuple[str, ...]]:
    engines = settings.engines
    return {role: urls for role, urls in (("router", engines.router_metrics_urls),
                                          ("prefill", engines.prefill_metrics_urls),
                                          ("decode", engines.decode_metrics_urls)) if urls}


def scraping(settings: Settings) -> bool:
    return bool(settings.engines.metrics_urls or role_urls(settings))


def receiving(settings: Settings) -> bool:
    return any(getattr(settings.engines, key) is not None for key in RECEIVER_KEYS)


def check_receiver_exposure(settings: Settings) -> None:
    """The receivers take anyone's spans and relay them: loopback only, unless
    ``engines.otlp_receiver_public`` (as the admin listener and admin_public)."""
    engines = settings.engines
    if engines.otlp_receiver_public:
        return
    for key in RECEIVER_KEYS:
        address = getattr(engines, key)
        if address is not None and not is_loopback(address.host):
            raise ConfigError(
                f"engines.{key} = {str(address)!r} (from {settings.source('engines.' + key)}): {address.host} is "
                "not a loopback address; expected a loopback HOST:PORT (127.0.0.1, [::1] or localhost) or off, "
                "or set engines.otlp_receiver_public = true")


def engine_receivers(settings: Settings) -> str:
    """``OTLP/HTTP 127.0.0.1:4318/v1/traces, OTLP/gRPC 127.0.0.1:4317``; empty when both are off."""
    engines = settings.engines
    found = [f"{kind} {address}{path}" for kind, address, path in (
        ("OTLP/HTTP", engines.otlp_receiver, "/v1/traces"), ("OTLP/gRPC", engines.otlp_receiver_grpc, ""))
        if address is not None]
    relayed = "" if engines.otlp_receiver_relay else " (kept for the join, relayed nowhere)"
    return ", ".join(found) + relayed if found else ""


def _scraper(settings: Settings, count_at_engines):
    from .observe.engines import EngineScraper

    engines = settings.engines
    scraper = EngineScraper(engines.metrics_urls, count_at_engines, interval=engines.scrape_interval,
                            timeout=engines.scrape_timeout, orphan_after=engines.orphan_after,
                            roles=role_urls(settings))
    scraper.scraping = scraping(settings)
    return scraper


def _receiver(settings: Settings, relay):
    from .observe.engine_receiver import EngineSpans

    engines = settings.engines
    return EngineSpans(engines.otlp_receiver, engines.otlp_receiver_grpc, max_traces=engines.span_traces,
                       relay=relay)


def _join(settings: Settings, stages, readings):
    """The join, when engine spans or gauges by role can place a request: with unlabelled
    metrics URLs alone, none (and the request path is as it was)."""
    if stages is None and not role_urls(settings):
        return None
    from .observe.engine_join import EngineStageJoin

    return EngineStageJoin(stages, readings, settle_s=settings.engines.span_settle,
                           clock_offset_ns=time.time_ns() - time.monotonic_ns())


def _relay_for(settings: Settings, span_export, export_config):
    """The exporter the receiver relays to: the proxy's own, when its spans go somewhere and
    the engines' spans are to be relayed there."""
    relays = settings.engines.otlp_receiver_relay and export_config is not None and export_config.exporter != "off"
    return span_export if relays else None


# ----------------------------------------------------------------------------------
# One process, or one worker of several
# ----------------------------------------------------------------------------------
class LocalEngines:
    """What a proxy process runs of the engine side: ``readings`` (correlation and the
    join), and in one process ``scraper`` and ``receiver``."""

    def __init__(self, readings, scraper=None, receiver=None, claim_timer=None) -> None:
        self.readings, self.scraper, self.receiver = readings, scraper, receiver
        self._claim_timer = claim_timer

    async def stop(self) -> None:
        if self._claim_timer is not None:
            self._claim_timer.stop()
        if self.receiver is not None:
            await self.receiver.stop()
        if self.scraper is not None:
            await self.scraper.stop()


async def start_local(settings: Settings, ctx, link, span_export, export_config) -> LocalEngines | None:
    """The engine side of one proxy process (``link``: it is a worker of several); None
    when neither gauges nor spans are configured."""
    if not scraping(settings) and not receiving(settings):
        return None
    from .observe.engine_join import in_flight_traces

    traces = in_flight_traces(ctx.in_flight.values)
    if link is not None:
        return _start_worker(settings, link, traces)
    from .observe.engines import counting

    scraper = _scraper(settings, counting(ctx.in_flight.values))
    receiver = timer = facts = None
    if receiving(settings):
        from .observe.engine_join import StageFacts
        from .observe.engine_receiver_proc import EngineReceiverProcess

        engines = settings.engines
        facts = StageFacts(engines.span_traces)
        receiver = EngineReceiverProcess(engines.otlp_receiver, engines.otlp_receiver_grpc,
                                         max_traces=engines.span_traces, facts=facts,
                                         relay=_relay_for(settings, span_export, export_config),
                                         nice=settings.tracing.exporter_nice)
        await receiver.start()
        timer = _ClaimTimer(facts, traces)
        scraper.stage_facts = facts
        scraper.receiver = receiver
        scraper.traces_in_flight = _async(traces)
        _log_receiver(receiver)
    scraper.join = _join(settings, facts, scraper)
    scraper.start()
    return LocalEngines(scraper, scraper, receiver, timer)


def _start_worker(settings: Settings, link, traces) -> LocalEngines:
    from .observe.engine_join import StageFacts
    from .observe.engines import EngineReadings

    readings = link.readings = EngineReadings()
    readings.scraping = scraping(settings)
    timer = None
    if receiving(settings):
        readings.stage_facts = StageFacts(settings.engines.span_traces)
        timer = _ClaimTimer(readings.stage_facts, traces)
    readings.join = _join(settings, readings.stage_facts, readings)
    return LocalEngines(readings, claim_timer=timer)


class _ClaimTimer:
    """Once a second, a worker's stage facts learn which traces it has in flight."""

    def __init__(self, facts, traces) -> None:
        self.facts, self.traces = facts, traces
        self._loop = asyncio.get_running_loop()
        self._handle = self._loop.call_later(CLAIM_EVERY_S, self._claim)

    def _claim(self) -> None:
        self.facts.claim(self.traces(), time.monotonic_ns())
        self._handle = self._loop.call_later(CLAIM_EVERY_S, self._claim)

    def stop(self) -> None:
        self._handle.cancel()


def _async(call):
    async def answer():
        return call()

    return answer


def _log_receiver(receiver) -> None:
    # The port actually bound (0 asks for any), with an IPv6 host in brackets as everywhere else.
    where = [f"{kind} {HostPort(address.host, port)}" for kind, address, port in (
        ("http", receiver.http_address, receiver.http_port), ("grpc", receiver.grpc_address, receiver.grpc_port))
        if port]
    log.info("engine spans: OTLP receiver on %s (pid %d)", ", ".join(where), receiver.pid)


# ----------------------------------------------------------------------------------
# The service's parent, with several workers
# ----------------------------------------------------------------------------------
class ServiceEngines:
    """The parent's engine side: the scraper (the service's ``engines`` for the admin
    view, also when only spans are received), the receiver and its relay."""

    def __init__(self, scraper, receiver=None, relay=None) -> None:
        self.scraper, self.receiver, self.relay = scraper, receiver, relay

    async def stop(self) -> None:
        if self.receiver is not None:
            await self.receiver.stop()
        await self.scraper.stop()
        if self.relay is not None:
            await self.relay.stop(timeout=5.0)


async def start_service(settings: Settings, links, export_config) -> ServiceEngines | None:
    if not scraping(settings) and not receiving(settings):
        return None
    scraper = _scraper(settings, links.count_at_engines)
    scraper.on_readings.append(links.tell_readings)
    receiver = relay = None
    try:
        if receiving(settings):
            relay = await _parent_relay(export_config if settings.engines.otlp_receiver_relay else None)
            receiver = _receiver(settings, relay)
            receiver.on_changes.append(lambda message: links.tell_readings({"stages": message}))
            await receiver.start()
            scraper.receiver = receiver
            scraper.traces_in_flight = _service_traces(links)
            _log_receiver(receiver)
    except BaseException:
        await ServiceEngines(scraper, receiver, relay).stop()
        raise
    scraper.start()
    return ServiceEngines(scraper, receiver, relay)


async def _parent_relay(export_config):
    """The parent's own exporter process, for the relay: the workers' are theirs."""
    if export_config is None or export_config.exporter == "off":
        return None
    from .observe.export import SpanExportPipe

    relay = SpanExportPipe(export_config)
    await relay.start()
    return relay


def _service_traces(links):
    async def traces() -> frozenset[int] | None:
        answers = await links.ask("inflight")
        if answers.missing:
            return None
        return frozenset(int(entry["trace_id"], 16) for answer in answers.answered.values()
                         for _, entry in answer["entries"] if entry.get("trace_id"))

    return traces
