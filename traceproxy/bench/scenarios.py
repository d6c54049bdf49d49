"""The benchmark scenarios S1..S5: what is sent, how many at once, for how long.

A scenario is either a closed loop for ``duration`` seconds (each connection sends
its next request as soon as the previous answer ended) or a fixed number of
``rounds`` per connection. Connection ``i`` sends ``requests[(i + round) % n]``,
so a scenario with two request kinds alternates them and mixes them across
connections. ``--scale`` multiplies connection counts, rounds and durations.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace

CHAT = "/v1/chat/completions"


@dataclass(frozen=True)
class RequestSpec:
    path: str = CHAT
    stream: bool = False
    tokens: int = 16
    ttft_ms: float = 0.0  # x-fake-ttft-ms
    tps: float = 0.0  # x-fake-tps; 0 = unpaced
    body_bytes: int = 0  # pad the JSON body to exactly this many bytes (0 = no padding)

    def body(self) -> bytes:
        doc = {"model": "bench", "messages": [{"role": "user", "content": "hello"}],
               "max_tokens": self.tokens, "stream": self.stream}
        raw = _dumps(doc)
        if self.body_bytes <= len(raw):
            return raw
        doc["padding"] = ""
        doc["padding"] = "x" * (self.body_bytes - len(_dumps(doc)))
        return _dumps(doc)

    def encode(self, authority: str) -> bytes:
        """The whole request, head and body, as sent on a keep-alive connection."""
        body = self.body()
        lines = [f"POST {self.path} HTTP/1.1", f"Host: {authority}", "Content-Type: application/json",
                 f"Content-Length: {len(body)}"]
        if self.stream:
            lines.append("Accept: text/event-stream")
        if self.ttft_ms:
            lines.append(f"x-fake-ttft-ms: {self.ttft_ms:g}")
        if self.tps:
            lines.append(f"x-fake-tps: {self.tps:g}")
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body

    @property
    def expected_events(self) -> int:
        """SSE events in a complete stream: one per token, the usage event and [DONE]."""
        return self.tokens + 2 if self.stream else 0


def _dumps(doc: dict) -> bytes:
    return json.dumps(doc, separators=(",", ":")).encode()


@dataclass(frozen=True)
class Scenario:
    name: str
    title: str
    connections: int
    requests: tuple[RequestSpec, ...]
    metrics: tuple[str, ...]  # keys of report.METRICS shown in the table
    duration: float = 0.0  # > 0: closed loop for this long
    rounds: int = 1  # when duration == 0: requests per connection
    think_ms: float = 0.0  # pause of up to this long between a connection's requests
    timeout: float = 10.0  # per request; longer counts as a hang
    detail: bool = False  # time every SSE event (TTFT, gaps, delivery latency)

    @property
    def budget(self) -> float:
        """Bound on one run of the load generator; what has not started by then is skipped."""
        if self.duration:
            return self.duration + self.timeout + 5
        return self.timeout + 5 + self.rounds * (1.0 + self.think_ms / 1000)

    def to_spec(self) -> dict:
        spec = asdict(self)
        spec["budget"] = self.budget
        return spec


def request_from_dict(doc: dict) -> RequestSpec:
    return RequestSpec(**doc)


_SMALL = RequestSpec(tokens=4)
_PACED = RequestSpec(stream=True, tokens=64, ttft_ms=20, tps=50)
_UNPACED = RequestSpec(stream=True, tokens=256)
_UPLOAD = RequestSpec(tokens=4, body_bytes=1 << 20)
_ROUND_SSE = RequestSpec(stream=True, tokens=16, ttft_ms=5, tps=400)
_ROUND_JSON = RequestSpec(tokens=16)

SCENARIOS: tuple[Scenario, ...] = (
    Scenario("S1", "small non-streaming POST, keep-alive", connections=64, requests=(_SMALL,),
             duration=5.0, timeout=5.0,
             metrics=("req_s", "latency_p50", "ttfb_p50", "ttfb_p99", "failures", "cpu", "cpu_us")),
    Scenario("S2", "concurrent paced SSE, 64 tok at 50 tok/s, TTFT 20 ms", connections=256, requests=(_PACED,),
             rounds=1, timeout=15.0, detail=True,
             metrics=("ttfb_p50", "ttft_p50", "ttft_p99", "gap_p99", "delivery_p99", "failures", "cpu", "cpu_us")),
    Scenario("S3", "unpaced SSE, 256 tokens per stream", connections=64, requests=(_UNPACED,),
             duration=5.0, timeout=10.0, metrics=("events_s", "streams_s", "failures", "cpu", "cpu_us")),
    Scenario("S4", "1 MiB JSON request bodies", connections=16, requests=(_UPLOAD,),
             duration=5.0, timeout=10.0, metrics=("upload_mb_s", "failures", "cpu", "cpu_us")),
    Scenario("S5", "multi-round keep-alive, SSE and JSON alternating", connections=32,
             requests=(_ROUND_SSE, _ROUND_JSON), rounds=20, think_ms=10, timeout=10.0,
             metrics=("ok", "reconnects", "ttfb_p50", "cpu", "cpu_us")),
)

BY_NAME = {s.name: s for s in SCENARIOS}


def scaled(scenario: Scenario, factor: float) -> Scenario:
    """Counts and durations times ``factor``, kept large enough to still mean something."""
    if factor == 1:
        return scenario
    rounds = scenario.rounds if scenario.rounds <= 1 else max(2, round(scenario.rounds * factor))
    return replace(scenario,
                   connections=max(2, round(scenario.connections * factor)),
                   rounds=rounds,
                   duration=max(0.3, scenario.duration * factor) if scenario.duration else 0.0)


def select(names: str | None, factor: float) -> list[Scenario]:
    """Scenarios by comma-separated names (case-insensitive), all when None, scaled. Names
    given empty ('--scenarios ""') name nothing: an error, never all of them."""
    if names is None:
        chosen = list(SCENARIOS)
    else:
        wanted = [n.strip().upper() for n in names.split(",") if n.strip()]
        unknown = [n for n in wanted if n not in BY_NAME]
        if not wanted:
            raise ValueError(f"no scenario named in {names!r}; choose from {', '.join(BY_NAME)}")
        if unknown:
            raise ValueError(f"unknown scenario {', '.join(unknown)}; choose from {', '.join(BY_NAME)}")
        chosen = [BY_NAME[n] for n in dict.fromkeys(wanted)]
    return [scaled(s, factor) for s in chosen]
