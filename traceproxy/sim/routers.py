"""The routers a simulated deployment can put in front of its workers, and how each is launched.

Theory of operation
-------------------
Three routers put one prefill and one decode worker behind one HTTP endpoint. They
share a lineage (smg succeeds sglang-router; vllm-router was forked from it) and most
flags, and differ in the PD protocol they speak to the workers:

* **sglang-router** 0.3.2 and **smg** 1.13 speak SGLang's: each request goes to prefill
  and decode *at once*, with the prefill's bootstrap address and a random
  ``bootstrap_room`` in the body; decode waits for the prefill of that room.
* **vllm-router** 0.1.17 speaks vLLM's: the request goes to prefill first (with
  ``max_tokens`` 1 and ``kv_transfer_params.do_remote_decode``), and to decode only once
  prefill answered, with the ``kv_transfer_params`` prefill returned.

``ROUTERS`` is the one table: the name ``traceproxy sim --router`` takes (the name on
PyPI), the module that says it is installed, the command, and the few ways their
flags differ (vllm-router's log levels and PD flag; it has no shutdown grace period).
Each router is launched as a module of the running interpreter, never by its console
script: sglang-router 0.3.2 installs an ``smg`` script too, so with both installed
``smg`` is whichever was installed last.

The default router is the first one installed, in the table's order.

Each router's ``behaviour`` is what it does to a request on its way to the engines, as
observed with the version named: the router tests assert it against the installed
router, so a router that changes fails them, and the demo and the docs
(docs/routers.md) read it from here.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from dataclasses import dataclass
from typing import NamedTuple

SGLANG_PROTOCOL = "sglang"  # prefill and decode at once, paired by bootstrap_room
VLLM_PROTOCOL = "vllm"  # prefill, then decode, paired by kv_transfer_params
LOG_LEVELS = ("debug", "info", "warning", "error")


class RouterBehaviour(NamedTuple):
    keeps_rid_on_chat: bool  # the body's rid reaches the engines on /v1/chat/completions
    engines_get_client_request_id: bool  # the client's x-request-id reaches the engines unchanged
    forwards_baggage: bool
    keeps_authorization: bool  # the client's Authorization reaches the engines unchanged
    cancels_silent_decode: bool  # a decode that sends nothing is dropped when the router's client leaves
    reports_stream_errors_in_band: bool  # an engine failing mid-stream: an SSE error event, [DONE], a clean end


@dataclass(frozen=True)
class RouterKind:
    name: str  # the distribution on PyPI, and the --router value
    module: str  # its importable package: installed means importable
    launch: tuple[str, ...]  # what follows ``python -m``
    pd_flag: str
    protocol: str  # SGLANG_PROTOCOL or VLLM_PROTOCOL
    process_title: str  # what the router renames its process to
    warning_level: str  # its --log-level spelling of "warning"
    takes_bootstrap_port: bool  # whether --prefill URL takes the bootstrap port after it
    has_shutdown_grace: bool  # whether it has --shutdown-grace-period-secs
    behaviour: RouterBehaviour

    @property
    def decode_waits_for_prefill(self) -> bool:
        """Whether decode is called only once prefill has answered (vLLM's protocol)."""
        return self.protocol == VLLM_PROTOCOL

    @property
    def installed(self) -> bool:
        return importlib.util.find_spec(self.module) is not None

    @property
    def version(self) -> str:
        try:
            return importlib.metadata.version(self.name)
        except importlib.metadata.PackageNotFoundError:
            return "unknown version"

    def log_level(self, level: str) -> str:
        """Its spelling of one of ``LOG_LEVELS`` (``warn`` is taken for ``warning``)."""
        level = "warning" if level == "warn" else level
        if level not in LOG_LEVELS:
            raise ValueError(f"log level must be one of {', '.join(LOG_LEVELS)}, not {level!r}")
        return self.warning_level if level == "warning" else level

    def command(self, python: str, *, host: str, port: int, prometheus_port: int, prefill_url: str,
                bootstrap_port: int, decode_url: str, log_level: str, request_timeout: float,
                extra_args: tuple[str, ...] = ()) -> list[str]:
        """The router in PD mode in front of one prefill and one decode worker."""
        prefill = [prefill_url, str(bootstrap_port)] if self.takes_bootstrap_port else [prefill_url]
        grace = ["--shutdown-grace-period-secs", "1"] if self.has_shutdown_grace else []
        return [
            python, "-m", *self.launch,
            "--host", host, "--port", str(port),
            "--prometheus-host", host, "--prometheus-port", str(prometheus_port),
            self.pd_flag, "--prefill", *prefill, "--decode", decode_url,
            "--log-level", self.log_level(log_level),
            # The workers are up first: these only bound how long a broken setup takes to fail.
            "--worker-startup-timeout-secs", "30", "--worker-startup-check-interval", "1",
            "--request-timeout-secs", str(max(1, int(request_timeout))),
            *grace, *extra_args,
        ]


ROUTERS: tuple[RouterKind, ...] = (
    RouterKind("sglang-router", "sglang_router", ("sglang_router.launch_router",), "--pd-disaggregation",
               SGLANG_PROTOCOL, "sglang::router", "warn", takes_bootstrap_port=True, has_shutdown_grace=True,
               behaviour=RouterBehaviour(  # 0.3.2
                   keeps_rid_on_chat=False, engines_get_client_request_id=True, forwards_baggage=False,
                   keeps_authorization=True, cancels_silent_decode=False, reports_stream_errors_in_band=False)),
    RouterKind("smg", "smg", ("smg", "launch"), "--pd-disaggregation",
               SGLANG_PROTOCOL, "smg::router", "warn", takes_bootstrap_port=True, has_shutdown_grace=True,
               behaviour=RouterBehaviour(  # 1.13
                   keeps_rid_on_chat=True, engines_get_client_request_id=True, forwards_baggage=False,
                   keeps_authorization=True, cancels_silent_decode=False, reports_stream_errors_in_band=True)),
    RouterKind("vllm-router", "vllm_router", ("vllm_router.launch_router",), "--vllm-pd-disaggregation",
               VLLM_PROTOCOL, "vllm::router", "warning", takes_bootstrap_port=False, has_shutdown_grace=False,
               behaviour=RouterBehaviour(  # 0.1.17
                   keeps_rid_on_chat=True, engines_get_client_request_id=False, forwards_baggage=True,
                   keeps_authorization=False, cancels_silent_decode=True, reports_stream_errors_in_band=False)),
)
ROUTER_NAMES = tuple(kind.name for kind in ROUTERS)


class UnknownRouter(ValueError):
    """A router name that is not in ``ROUTERS``."""


def router_kind(name: str) -> RouterKind:
    for kind in ROUTERS:
        if kind.name == name:
            return kind
    raise UnknownRouter(f"unknown router {name!r}; known: {', '.join(ROUTER_NAMES)}")


def installed_routers() -> list[RouterKind]:
    """The routers this interpreter can launch, in the table's order."""
    return [kind for kind in ROUTERS if kind.installed]


def default_router() -> RouterKind | None:
    """The first installed router, or None when none is."""
    return next(iter(installed_routers()), None)
