"""SGLang's Prometheus metrics for a simulated worker, fed by real in-flight state.

Theory of operation
-------------------
Every request walks through queues (prealloc, queue, running, KV transfer) and is
counted in exactly one gauge at a time: ``Stage.enter(gauge)`` moves it, and
``Stage.leave()`` (always, in a ``finally``) takes it out. ``Stage.pin()`` is the
``pinned_request`` fault: the request's current gauge stays incremented forever,
like a request SGLang forgot in a queue. Names, ``# TYPE`` lines and the
``model_name`` label follow SGLang; counters are rendered with ``_total`` as
prometheus_client does.

``observe_stage`` feeds SGLang's per-stage latency histogram,
``sglang:per_stage_req_latency_seconds`` (label ``stage``; SGLang's buckets:
``exponential_buckets(start=0.001, width=1.62, length=30)``, 1 ms to about 20 min),
from the request timelines (``stages.py``).
"""

from __future__ import annotations

GAUGES = {
    "sglang:num_running_reqs": "The number of running requests.",
    "sglang:num_queue_reqs": "The number of requests in the waiting queue.",
    "sglang:num_prefill_prealloc_queue_reqs": "Prefill: requests in the bootstrap (prealloc) queue.",
    "sglang:num_prefill_inflight_queue_reqs": "Prefill: requests whose KV cache is being transferred.",
    "sglang:num_decode_prealloc_queue_reqs": "Decode: requests waiting for their prefill peer.",
    "sglang:num_decode_transfer_queue_reqs": "Decode: requests waiting for their KV cache.",
}
COUNTERS = {
    "sglang:num_bootstrap_failed_reqs": "Requests whose PD bootstrap failed.",
    "sglang:num_transfer_failed_reqs": "Requests whose KV transfer failed.",
    "sglang:num_requests": "Inference requests received.",
    "sglang:num_aborted_requests": "Requests that ended early (client gone, reset, stall).",
    "sglang:prompt_tokens": "Prompt tokens processed.",
    "sglang:generation_tokens": "Tokens generated.",
}

STAGE_LATENCY = "sglang:per_stage_req_latency_seconds"
STAGE_LATENCY_HELP = "The latency of each stage of requests."
STAGE_LATENCY_BUCKETS = tuple(0.001 * 1.62 ** i for i in range(30))

RUNNING = "sglang:num_running_reqs"
QUEUED = "sglang:num_queue_reqs"
PREFILL_PREALLOC = "sglang:num_prefill_prealloc_queue_reqs"
PREFILL_INFLIGHT = "sglang:num_prefill_inflight_queue_reqs"
DECODE_PREALLOC = "sglang:num_decode_prealloc_queue_reqs"
DECODE_TRANSFER = "sglang:num_decode_transfer_queue_reqs"


class EngineMetrics:
    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.gauges = dict.fromkeys(GAUGES, 0)
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.stage_latency: dict[str, StageHistogram] = {}  # by stage name, in the order first seen

    def observe_stage(self, stage: str, seconds: float) -> None:
        histogram = self.stage_latency.get(stage)
        if histogram is None:
            histogram = self.stage_latency[stage] = StageHistogram()
        histogram.observe(seconds)

    def count(self, name: str, n: int = 1) -> None:
        self.counters[name] += n

    def stage(self) -> "Stage":
        return Stage(self)

    def render(self) -> str:
        model = self.model_name.replace("\\", "\\\\").replace('"', '\\"')
        label = '{model_name="%s"}' % model
        lines = []
        for name, help_text in GAUGES.items():
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge", f"{name}{label} {self.gauges[name]}"]
        for name, help_text in COUNTERS.items():
            lines += [f"# HELP {name}_total {help_text}", f"# TYPE {name}_total counter",
                      f"{name}_total{label} {self.counters[name]}"]
        # As prometheus_client does: the family's HELP and TYPE before any stage was observed.
        lines += [f"# HELP {STAGE_LATENCY} {STAGE_LATENCY_HELP}", f"# TYPE {STAGE_LATENCY} histogram"]
        for stage, histogram in self.stage_latency.items():
            lines += histogram.render(f'model_name="{model}",stage="{stage}"')
        return "\n".join(lines) + "\n"


class StageHistogram:
    """One stage's series of ``sglang:per_stage_req_latency_seconds``: cumulative buckets, count, sum."""

    def __init__(self) -> None:
        self.buckets = [0] * len(STAGE_LATENCY_BUCKETS)
        self.count = 0
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        self.count += 1
        self.sum += seconds
        for i, bound in enumerate(STAGE_LATENCY_BUCKETS):
            if seconds <= bound:
                self.buckets[i] += 1

    def render(self, labels: str) -> list[str]:
        # As prometheus_client writes it: float samples, le as Go formats a float.
        lines = [f'{STAGE_LATENCY}_bucket{{{labels},le="{bound!r}"}} {float(n)!r}'
                 for bound, n in zip(STAGE_LATENCY_BUCKETS, self.buckets)]
        lines += [f'{STAGE_LATENCY}_bucket{{{labels},le="+Inf"}} {float(self.count)!r}',
                  f"{STAGE_LATENCY}_count{{{labels}}} {float(self.count)!r}",
                  f"{STAGE_LATENCY}_sum{{{labels}}} {self.sum!r}"]
        return lines


class Stage:
    """Where one request is counted right now: one gauge, or none."""

    def __init__(self, metrics: EngineMetrics) -> None:
        self._metrics = metrics
        self.current: str | None = None

    def enter(self, gauge: str) -> None:
        self.leave()
        self._metrics.gauges[gauge] += 1
        self.current = gauge

    def leave(self) -> None:
        if self.current is not None:
            self._metrics.gauges[self.current] -= 1
            self.current = None

    def pin(self, gauge: str) -> None:
        """Count the request in ``gauge`` for good: this stage forgets it, nothing ever decrements it."""
        self.leave()
        self._metrics.gauges[gauge] += 1
