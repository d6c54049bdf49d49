"""``traceproxy repro``: a multi-turn agent harness that, when it hangs, says where.

It talks to the proxy over HTTP like any client (raw sockets driven by h11, so
connection reuse is exact and every byte is timed) and, for a hung turn, asks the
proxy's admin listener (``GET /debug/inflight``) where that request is.

``harness`` runs the conversations, ``client`` is the one-connection HTTP client,
``inflight`` asks the proxy and turns its answer into a ``Diagnosis``, ``report``
formats results as lines. Imports: h11 and the standard library only.
"""

from .harness import (BOTH, FRESH, REUSED, ReproResult, TargetUnreachable, TurnRecord, UsageError,
                      run_repro)
from .inflight import Diagnosis

__all__ = ["BOTH", "FRESH", "REUSED", "Diagnosis", "ReproResult", "TargetUnreachable", "TurnRecord",
           "UsageError", "run_repro"]
