"""Each real router in PD mode in front of the simulated workers, for the router tests.

The routers under test are the ones ``traceproxy sim --router`` knows
(``traceproxy.sim.routers.ROUTERS``: sglang-router 0.3.2, smg 1.13, vllm-router
0.1.17). ``ROUTERS_UNDER_TEST`` is one pytest param per router, skipped when that
router is not installed (CI installs all three: the ``test`` extra), so a test
parametrized with it runs against each::

    @pytest.fixture(scope="module", params=ROUTERS_UNDER_TEST)
    def harness(request, loop_thread):
        with RouterHarness(loop_thread, request.param) as h:
            yield h

    def test_x(harness):
        ...send to harness.router_port...
        [pre] = wait_for_requests(harness.prefill, 1)   # SeenRequest(path, headers, body, ...)
        pre.headers["traceparent"]                       # header names lower-cased
        pre.body                                         # the JSON body as the router re-serialised it

``RouterHarness`` is a ``SimDeployment`` (the workers the ``traceproxy sim`` command
runs, the same launcher) on the tests' event loop thread, with ``reset()`` between
tests: no faults, nothing held, default pacing, empty records. Starting one takes
about half a second per router, so fixtures share it per module; pytest groups a
module's tests by the router param, so each router starts once per module.

Where the routers differ, the tests assert what each one does: ``harness.behaviour``
(``traceproxy.sim.routers.RouterBehaviour``, the one table of those facts, which the
docs and the demo read too) and ``harness.kind.decode_waits_for_prefill``.

With ``otlp_endpoint`` the workers export SGLang's spans there, over OTLP/gRPC unless
``otlp_protocol="http/protobuf"`` (the variable SGLang reads,
``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL``, is set while the workers start), every
``SPAN_DELAY_MS`` (SGLang's ``SGLANG_OTLP_EXPORTER_SCHEDULE_DELAY_MILLIS``: a stage's
span reaches the receiver within that of the stage's end).
"""

from __future__ import annotations

import http.client
import time
import pytest

from traceproxy.sim.engine import SeenRequest, SimWorker
from traceproxy.sim.launch import SimDeployment
from traceproxy.sim.routers import ROUTERS, VLLM_PROTOCOL, RouterBehaviour, RouterKind, router_kind
from traceproxy.sim.startup import SimStartError

STARTUP_TIMEOUT = 60.0  # router start + worker registration, bounded
STEP_TIMEOUT = 10.0  # any single blocking step (one HTTP exchange, one loop call)
SPAN_DELAY_MS = 50  # how often the workers' span processors export (SGLang's default: 500)
SERVED_MODEL_NAME = "sim-llama"
PREFILL_TOKENS_PER_S = 8000.0


def _param(kind: RouterKind):
    reason = f"{kind.name} is not installed (pip install {kind.name}; the test extra installs it)"
    return pytest.param(kind.name, id=kind.name, marks=pytest.mark.skipif(not kind.installed, reason=reason))


ROUTERS_UNDER_TEST = [_param(kind) for kind in ROUTERS]


def router_param(name: str):
    """One router as a pytest param (skipped when it is not installed)."""
    return _param(router_kind(name))


class RouterHarness:
    """A simulated PD deployment behind the real router ``router`` (a name), on ``loop``.

    Attributes once started: ``kind`` (``RouterKind``), ``name``, ``behaviour``
    (``RouterBehaviour``), ``deployment`` (``SimDeployment``), ``prefill`` and ``decode``
    (``SimWorker``), ``router_url``, ``router_port``, ``bootstrap_port``,
    ``startup_seconds``. ``deployment_options`` go to ``SimDeployment``.
    """

    def __init__(self, loop, router: str, *, startup_timeout: float = STARTUP_TIMEOUT,
                 otlp_protocol: str = "grpc", **deployment_options) -> None:
        self.loop, self.kind = loop, router_kind(router)
        self.startup_timeout = startup_timeout
        self.otlp_protocol = otlp_protocol
        self.deployment = SimDeployment(router=router, startup_timeout=startup_timeout, model=SERVED_MODEL_NAME,
                                        prefill_tokens_per_s=PREFILL_TOKENS_PER_S, **deployment_options)
        self.startup_seconds = 0.0

    @property
    def name(self) -> str:
        return self.kind.name

    @property
    def behaviour(self) -> RouterBehaviour:
        return self.kind.behaviour

    @property
    def speaks_vllm(self) -> bool:
        return self.kind.protocol == VLLM_PROTOCOL

    @property
    def prefill(self) -> SimWorker:
        return self.deployment.prefill

    @property
    def decode(self) -> SimWorker:
        return self.deployment.decode

    @property
    def router_url(self) -> str:
        return self.deployment.router_url

    @property
    def router_port(self) -> int:
        return self.deployment.router.port

    @property
    def bootstrap_port(self) -> int:
        return self.prefill.bootstrap_port

    # --- lifecycle ---

    def start(self) -> "RouterHarness":
        t0 = time.monotonic()
        try:
            with pytest.MonkeyPatch.context() as env:  # read once, when each worker starts
                env.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", self.otlp_protocol)
                env.setenv("SGLANG_OTLP_EXPORTER_SCHEDULE_DELAY_MILLIS", str(SPAN_DELAY_MS))
                self.loop.run(self.deployment.start(), timeout=self.startup_timeout + STEP_TIMEOUT)
        except SimStartError as exc:
            # The launcher's message is one line; a failing test wants the router's log too.
            raise RuntimeError(f"{exc}\n{exc.detail}" if exc.detail else str(exc)) from exc
        self.startup_seconds = time.monotonic() - t0
        return self

    def stop(self) -> None:
        self.loop.run(self.deployment.stop(), timeout=3 * STEP_TIMEOUT)

    def __enter__(self) -> "RouterHarness":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # --- between tests ---

    def reset(self) -> None:
        """No faults, nothing held, default pacing, empty records."""
        for worker in (self.prefill, self.decode):
            worker.set_faults([])
            self.loop.run(worker.release_held())
            worker.prefill_tokens_per_s = PREFILL_TOKENS_PER_S
        self.clear()

    def clear(self) -> None:
        """Forget what the workers received so far."""
        self.prefill.clear()
        self.decode.clear()

    def log_tail(self, lines: int = 40) -> str:
        router = self.deployment.router
        return router.log_tail(lines) if router is not None else "(no router)"


def wait_for_requests(worker: SimWorker, count: int, timeout: float = STEP_TIMEOUT) -> list[SeenRequest]:
    """Block until ``worker`` got at least ``count`` inference requests; return them all."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        seen = worker.requests
        if len(seen) >= count:
            return seen
        time.sleep(0.01)
    seen = worker.requests
    raise AssertionError(f"{worker.role} got {len(seen)} inference requests within {timeout} s, expected {count}:"
                         f" {[r.path for r in seen]}")


def http_exchange(port: int, method: str, path: str, headers: dict[str, str] | None = None,
                  body: bytes = b"", timeout: float = STEP_TIMEOUT) -> tuple[int, dict[str, str], bytes]:
    """One request on a fresh connection: (status, lower-cased headers, whole body)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, body=body or None, headers=headers or {})
        resp = conn.getresponse()
        data = resp.read()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, data
    finally:
        conn.close()


# The fixtures of a module that runs its tests once behind each router; it imports them by name.
@pytest.fixture(scope="module", params=ROUTERS_UNDER_TEST)
def harness(request, loop_thread):
    with RouterHarness(loop_thread, request.param) as started:
        yield started


@pytest.fixture
def pd_router(harness):
    """The module's router with empty records, no faults and default pacing."""
    yield from reset_around_the_test(harness)


def reset_around_the_test(harness: RouterHarness):
    """The body of a per-test fixture on a module's harness: reset before the test, so it starts from empty
    records, no faults and default pacing, and after it, so the next one does not inherit what it left."""
    harness.reset()
    yield harness
    harness.reset()
