"""Named faults for the simulated SGLang workers: the one table, and its parser.

Theory of operation
-------------------
A fault is a name with an optional argument, written ``name[:arg]``, several
joined with commas: ``decode_stall:3,idle_close:2``. ``FAULTS`` below is the single
source of truth: the CLI help, the docs and the parser all read it.

A worker has worker-wide faults (``--fault`` flags, ``POST /admin/faults``) and every
request may add its own, which win over worker-wide faults of the same name. A
request names its faults in the ``x-sim-fault`` header. Every router (sglang-router
0.3.2, smg 1.13, vllm-router 0.1.17) forwards only an allow-list of headers, so
behind a router the header never arrives; what survives all three is a top-level
``"sim_fault"`` field on ``/v1/completions`` and ``"metadata": {"sim_fault": ...}``
on ``/v1/chat/completions``. They re-serialise bodies into typed structs, and differ
on the rest: smg keeps a top-level ``sim_fault`` on every route, vllm-router on the
OpenAI routes only, sglang-router 0.3.2 on ``/v1/completions`` only. Behind
sglang-router or vllm-router, use the worker-wide faults on ``/generate``.

Every fault has a *home*: the PD role whose work it disturbs. A worker applies a
fault when it is the fault's home, or when it is a decode worker serving a
request on its own (no ``bootstrap_room``: it then does the prefill itself, so
every fault applies; the ones that need a PD peer, ``bootstrap_stall``,
``kv_transfer_stall`` and ``decode_waiting_stall``, have nothing to act on).
Behind a PD router a decode worker never serves on its own (every router sends it
the prefill's room or ``kv_transfer_params``), so there it refuses the prefill's
faults as the prefill refuses decode's; only a decode worker used without a router
takes them. ``SimDeployment(faults=...)`` uses the home to send each fault to the
right worker.

The stalls hang a request in one of SGLang's stages each (``stages.py``), which is
where its spans stop: ``bootstrap_stall`` in the handshake, ``prefill_stall`` in
prefill_forward, ``kv_transfer_stall`` in the KV transfer, ``decode_waiting_stall``
in decode's wait for the KV cache, ``decode_stall`` in the decode loop.

Faults act on inference only. The deployment's own traffic never meets them: the
router's registration calls and health checks are not inference (and a connection
that carried none is not idle-closed), and ``SimDeployment`` arms the workers'
faults only after the router's warm-up request went through.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

FAULT_HEADER = "x-sim-fault"
FAULT_FIELD = "sim_fault"
ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class FaultKind:
    name: str
    metavar: str | None  # the argument's name in help text, None when it takes none
    convert: type | None  # int, float or str
    default: object  # the argument when omitted
    home: str  # "prefill", "decode" or "any"
    meaning: str


_ARGUMENT_WORDS = {int: "a whole number", float: "a number", str: "a word"}  # by FaultKind.convert

FAULTS: dict[str, FaultKind] = {kind.name: kind for kind in (
    FaultKind("bootstrap_stall", None, None, None, "prefill",
              "the PD handshake never completes: prefill holds in prefill_bootstrap, decode waits in "
              "decode_bootstrap (behind vllm-router: prefill answered and keeps its KV cache, decode waits in "
              "decode_bootstrap)"),
    FaultKind("prefill_stall", None, None, None, "prefill",
              "prefill never finishes: the request is held in prefill_forward, so through the router no response "
              "headers reach the client"),
    FaultKind("kv_transfer_stall", None, None, None, "prefill",
              "the KV transfer never completes: prefill holds in prefill_transfer_kv_cache with "
              "num_prefill_inflight_queue_reqs at 1, decode waits in decode_transferred"),
    FaultKind("decode_waiting_stall", None, None, None, "decode",
              "decode never receives the KV cache: prefill finishes, decode holds in decode_transferred "
              "(num_decode_transfer_queue_reqs 1)"),
    FaultKind("decode_stall", "N", int, 3, "decode",
              "stop after N tokens (default 3) and leave the connection open: held in decode_forward, after N "
              "decode_loop steps"),
    FaultKind("slow_first_token", "MS", float, 2000.0, "decode",
              "wait MS milliseconds (default 2000) before the first token: a stall that resolves"),
    FaultKind("pinned_request", None, None, None, "prefill",
              "answer normally, but leave the request counted in num_prefill_inflight_queue_reqs forever "
              "(a leaked KV-transfer slot; no work runs)"),
    FaultKind("reset_mid_stream", "N", int, 3, "decode",
              "abort the TCP connection (RST) after N tokens (default 3)"),
    FaultKind("idle_close", "K", float, 5.0, "any",
              "close a keep-alive connection that carried inference once it has been idle K seconds "
              "(default 5)"),
    FaultKind("malformed_sse", "KIND", str, "line", "decode",
              "after one token, KIND line (default): an SSE event with truncated JSON, then a clean end "
              "without [DONE]; KIND chunk: an invalid chunk-size line, then close"),
    FaultKind("no_done", None, None, None, "decode",
              "end the stream cleanly without data: [DONE] and without a finish reason"),
)}

MALFORMED_KINDS = ("line", "chunk")


class FaultError(ValueError):
    """A fault spec names an unknown fault or carries a bad argument."""


class Fault(NamedTuple):
    name: str
    arg: object = None

    def __str__(self) -> str:
        return self.name if self.arg is None else f"{self.name}:{_format_arg(self.arg)}"

    @property
    def home(self) -> str:
        return FAULTS[self.name].home


def _format_arg(arg: object) -> str:
    if isinstance(arg, float) and arg.is_integer():
        return str(int(arg))
    return str(arg)


def parse_fault(spec: str) -> Fault:
    """``"decode_stall:3"`` -> ``Fault("decode_stall", 3)``; defaults fill a missing argument."""
    name, sep, raw = spec.strip().partition(":")
    kind = FAULTS.get(name.strip())
    if kind is None:
        raise FaultError(f"unknown fault {name!r}; known: {', '.join(FAULTS)}")
    if kind.convert is None:
        if sep:
            raise FaultError(f"fault {kind.name} takes no argument, got {raw!r}")
        return Fault(kind.name)
    if not sep or not raw.strip():
        return Fault(kind.name, kind.default)
    try:
        arg = kind.convert(raw.strip())
    except ValueError:
        words = _ARGUMENT_WORDS.get(kind.convert, "a valid value")
        raise FaultError(f"fault {kind.name}:{kind.metavar} needs {words}, got {raw!r}") from None
    if isinstance(arg, float) and not math.isfinite(arg):
        # An infinite delay would be a hang nothing ends (not even /admin/release).
        raise FaultError(f"fault {kind.name}: {kind.metavar} must be a finite number, got {raw!r}")
    if isinstance(arg, (int, float)) and arg < 0:
        raise FaultError(f"fault {kind.name}: {kind.metavar} must not be negative, got {raw!r}")
    if kind.name == "malformed_sse" and arg not in MALFORMED_KINDS:
        raise FaultError(f"fault malformed_sse:KIND takes one of {MALFORMED_KINDS}, got {raw!r}")
    return Fault(kind.name, arg)


def parse_faults(specs: str | Iterable[str] | None) -> dict[str, Fault]:
    """Comma-separated specs (a string, or several) -> {name: Fault}; the last of a name wins."""
    if specs is None:
        return {}
    if isinstance(specs, str):
        specs = [specs]
    faults: dict[str, Fault] = {}
    for spec in specs:
        for part in str(spec).split(","):
            if part.strip():
                fault = parse_fault(part)
                faults[fault.name] = fault
    return faults


def applies(fault: Fault, role: str, standalone: bool) -> bool:
    """Whether a worker in ``role`` acts on ``fault`` (see the module docstring)."""
    return fault.home in ("any", role) or (role == "decode" and standalone)


# The faults that act between the two workers of a PD pair: none has anything to act on
# when decode serves a request on its own.
NEEDS_PD_PEER = ("bootstrap_stall", "kv_transfer_stall", "decode_waiting_stall")


def can_apply(fault: Fault, role: str, pd: bool = False) -> bool:
    """Whether a worker in ``role`` would ever act on ``fault``: paired (its home), or for
    decode serving alone (every fault but those that need a PD peer). A worker behind a PD
    router (``pd``) never serves alone: every request it gets names its peer."""
    if role == "decode" and not pd:
        return fault.name not in NEEDS_PD_PEER
    return applies(fault, role, standalone=False)


def check_role(faults: Mapping[str, Fault], role: str, pd: bool = False) -> None:
    """A FaultError naming the worker each fault belongs on, for any ``role`` would never act on
    (``pd``: behind a PD router): set there, it would be taken and do nothing."""
    wrong = [fault for fault in faults.values() if not can_apply(fault, role, pd)]
    if wrong:
        raise FaultError("; ".join(_why_not(fault, role, pd) for fault in wrong))


def _why_not(fault: Fault, role: str, pd: bool) -> str:
    if fault.home in ("any", role):  # its own worker, serving alone: the PD pair's fault has nothing to act on
        return _served_alone(fault)
    return f"fault {fault.name} acts on the {fault.home} worker, not on this {role} worker: set it on the {fault.home} worker"


def _served_alone(fault: Fault) -> str:
    return (f"fault {fault.name} acts on the PD handshake or KV transfer between prefill and decode, which only a "
            "router pairs; without one the decode worker serves alone and would never act on it")


def split_by_home(specs: str | Iterable[str] | None, pd: bool = True) -> dict[str, list[str]]:
    """Deployment-wide specs -> {"prefill": [...], "decode": [...]}: behind a router (``pd``),
    by each fault's home; without one, all to the decode worker, which serves every request
    alone. Raises FaultError for a fault the worker it would go to never acts on."""
    faults = parse_faults(specs)
    roles = ROLES if pd else ("decode",)
    out: dict[str, list[str]] = {role: [] for role in ROLES}
    for fault in faults.values():
        homes = [role for role in roles if can_apply(fault, role, pd)]
        if not homes:
            raise FaultError(_served_alone(fault))
        for role in homes:
            out[role].append(str(fault))
    return out


def request_fault_specs(headers: Mapping[str, str], body: object) -> list[str]:
    """The fault specs a request carries: header, ``sim_fault`` field, ``metadata.sim_fault``."""
    specs = [headers.get(FAULT_HEADER, "")]
    if isinstance(body, dict):
        specs.append(body.get(FAULT_FIELD) or "")
        metadata = body.get("metadata")
        if isinstance(metadata, dict):
            specs.append(metadata.get(FAULT_FIELD) or "")
    return [spec for spec in specs if isinstance(spec, str) and spec.strip()]


def fault_table() -> str:
    """One line per fault, for ``--help``."""
    lines = []
    for kind in FAULTS.values():
        usage = kind.name if kind.metavar is None else f"{kind.name}[:{kind.metavar}]"
        lines.append(f"  {usage:<24} ({kind.home}) {kind.meaning}")
    return "\n".join(lines)


def fault_markdown() -> str:
    """The same table as Markdown, for the docs."""
    rows = ["| fault | acts on | meaning |", "|---|---|---|"]
    for kind in FAULTS.values():
        usage = kind.name if kind.metavar is None else f"{kind.name}[:{kind.metavar}]"
        rows.append(f"| `{usage}` | {kind.home} | {kind.meaning} |")
    return "\n".join(rows)
