"""How a PD request names its peer: SGLang's bootstrap room, or vLLM's ``kv_transfer_params``.

Theory of operation
-------------------
Two PD protocols reach the simulated workers, one per router family (``routers.py``):

* **SGLang** (sglang-router, smg): prefill and decode get the same body *at once*, with
  ``bootstrap_host``, ``bootstrap_port`` and ``bootstrap_room`` added. Decode attaches
  to the room on the prefill's bootstrap listener and waits there for the KV cache.
* **vLLM** (vllm-router, NIXL connector): prefill gets the body first, with
  ``max_tokens`` 1 and ``kv_transfer_params: {"do_remote_decode": true, ...}``. It
  computes, keeps the KV cache for the decode side to pull, and answers with its own
  ``kv_transfer_params``: ``do_remote_prefill`` true, where to pull from
  (``remote_host``, ``remote_port``), ``remote_engine_id``, ``remote_block_ids`` and
  ``remote_request_id``. The router calls decode only then, with the original body and
  those parameters, and decode pulls the cache.

The simulation pairs both the same way, through the prefill's rooms (``bootstrap.py``):
for vLLM the prefill opens a room of its own, names it in ``remote_request_id``
(``sim-room-<n>``) and gives its bootstrap listener as ``remote_host`` and
``remote_port``; decode takes the room from there. A decode request whose parameters
name no room (a router that got none from its prefill passes none on) is served on
its own, prefill included.
"""

from __future__ import annotations

import math
import random
from typing import NamedTuple

SGLANG = "sglang"
VLLM = "vllm"
ROOM_PREFIX = "sim-room-"
BLOCK_TOKENS = 16  # tokens per KV block, vLLM's default block size


class Pairing(NamedTuple):
    protocol: str  # SGLANG or VLLM
    room: int
    bootstrap: tuple[str, int] | None  # where the prefill's rooms are; None on the prefill itself


def pairing_of(role: str, body: dict) -> Pairing | None:
    """The PD pairing a request carries for a worker in ``role``; None for a request served alone."""
    room = body.get("bootstrap_room")
    if _is_int(room):
        host, port = body.get("bootstrap_host"), body.get("bootstrap_port")
        bootstrap = (host, port) if isinstance(host, str) and _is_int(port) else None
        return Pairing(SGLANG, room, bootstrap)
    params = body.get("kv_transfer_params")
    if not isinstance(params, dict):
        return None
    if role == "prefill" and params.get("do_remote_decode") is True:
        return Pairing(VLLM, random.getrandbits(62), None)  # the prefill opens the room
    if role == "decode" and params.get("do_remote_prefill") is True:
        room = _room_named(params.get("remote_request_id"))
        host, port = params.get("remote_host"), params.get("remote_port")
        if room is not None and isinstance(host, str) and _is_int(port):
            return Pairing(VLLM, room, (host, port))
    return None


def prefill_kv_params(room: int, host: str, port: int, engine_id: str, prompt_tokens: int) -> dict:
    """What a vLLM prefill answers in ``kv_transfer_params``: where decode pulls its KV cache."""
    blocks = max(1, math.ceil(prompt_tokens / BLOCK_TOKENS))
    return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": engine_id,
            "remote_block_ids": list(range(blocks)), "remote_host": host, "remote_port": port,
            "remote_request_id": f"{ROOM_PREFIX}{room}", "tp_size": 1}


def _room_named(value: object) -> int | None:
    if isinstance(value, str) and value.startswith(ROOM_PREFIX) and value[len(ROOM_PREFIX):].isdigit():
        return int(value[len(ROOM_PREFIX):])
    return None


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
