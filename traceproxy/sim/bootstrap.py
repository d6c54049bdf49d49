"""The PD bootstrap between a simulated prefill and decode worker: who waits for whom.

Theory of operation
-------------------
sglang-router and smg send one request to a prefill and a decode worker at the same
time, with the prefill's bootstrap address (``bootstrap_host``, ``bootstrap_port``)
and a random ``bootstrap_room`` in the body. Like a real pair:

1. the decode side *attaches* to the room on the prefill's bootstrap server (it may
   get there before the prefill has the request: the room is created by whoever
   comes first), and waits for the handshake (its prealloc queue);
2. the prefill side waits for that attachment (its bootstrap queue) and completes
   the *handshake*; decode now waits for the KV cache (its transfer queue); prefill
   runs, then marks the room *ready* (its KV cache is in flight);
3. the decode side *takes* the ready room (the KV transfer), which releases the
   prefill's answer, and starts decoding.

vllm-router calls decode only once prefill has answered; its prefill opens a room of
its own, ready by the time decode attaches (``pairing.py``), completes the handshake
when decode attaches, and the same take ends it. A room is taken only once handshaken
and ready; a prefill that gives up on a room marks it failed, so its decode learns it.

The prefill worker keeps its rooms in ``Rooms``. A decode worker in the same process
and on the same event loop finds them through an in-process registry keyed by the
bootstrap address; otherwise it long-polls ``GET /bootstrap/{room}?wait=S`` (each
poll attaches; the poll that finds the room ready takes it) on the prefill's
bootstrap listener, or on the prefill's main port when the decode worker was given
the prefill's URL (``--prefill-url``: containers where the router's bootstrap port
is not the one the prefill listens on). Both ports serve the poll. Every wait is bounded by the caller's timeout; the room table is bounded
and forgets the oldest rooms first.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

from .aioserve import start_app

MAX_ROOMS = 4096
POLL_WAIT = 2.0  # seconds one long poll may wait on the prefill side
RETRY_PAUSE = 0.2  # after a failed poll (prefill restarting, refused)

log = logging.getLogger("traceproxy.sim.bootstrap")


@dataclass
class Room:
    id: int
    attached: bool = False  # decode came
    handshaken: bool = False  # prefill saw it: decode may wait for the KV cache
    ready: bool = False  # prefill's KV cache is on its way
    taken: bool = False
    failed: str = ""
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def state(self) -> str:
        if self.failed:
            return "failed"
        if self.taken:
            return "transferred"
        if not self.handshaken:
            return "waiting"
        return "ready" if self.ready else "prefilling"


class Rooms:
    """The prefill worker's rooms; all methods run on its event loop."""

    def __init__(self, max_rooms: int = MAX_ROOMS) -> None:
        self.max_rooms = max_rooms
        self._rooms: OrderedDict[int, Room] = OrderedDict()

    def get(self, room_id: int) -> Room:
        room = self._rooms.get(room_id)
        if room is None:
            room = self._rooms[room_id] = Room(room_id)
            while len(self._rooms) > self.max_rooms:
                self._rooms.popitem(last=False)
        return room

    def update(self, room: Room, **changes) -> None:
        for name, value in changes.items():
            setattr(room, name, value)
        event, room.changed = room.changed, asyncio.Event()
        event.set()

    async def wait_for(self, room: Room, predicate: Callable[[Room], bool], timeout: float) -> bool:
        """Until ``predicate(room)`` or the room failed; False on timeout or failure."""
        deadline = time.monotonic() + timeout
        for _ in range(100):  # a room changes state a handful of times
            if room.failed:
                return False
            if predicate(room):
                return True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            try:
                await asyncio.wait_for(room.changed.wait(), remaining)
            except asyncio.TimeoutError:
                return predicate(room) and not room.failed
        return False

    def take(self, room: Room) -> bool:
        if room.handshaken and room.ready and not room.failed and not room.taken:
            self.update(room, taken=True)
        return room.taken

    async def poll(self, room_id: int, wait: float) -> str:
        """A remote decode's poll: attach, wait up to ``wait`` for ready, take it."""
        room = self.get(room_id)
        if not room.attached:
            self.update(room, attached=True)
        await self.wait_for(room, lambda r: r.handshaken and r.ready, wait)
        self.take(room)
        return room.state


# ----------------------------------------------------------------------------------
# In-process pairing
# ----------------------------------------------------------------------------------
_LOCAL: dict[tuple[str, int], tuple[Rooms, asyncio.AbstractEventLoop]] = {}


def register_local(host: str, port: int, rooms: Rooms) -> None:
    _LOCAL[(host, port)] = (rooms, asyncio.get_running_loop())


def unregister_local(host: str, port: int) -> None:
    _LOCAL.pop((host, port), None)


def local_rooms(host: str, port: int) -> Rooms | None:
    found = _LOCAL.get((host, port))
    if found is None or found[1] is not asyncio.get_running_loop():
        return None
    return found[0]


# ----------------------------------------------------------------------------------
# The decode side
# ----------------------------------------------------------------------------------
async def fetch_kv(session: aiohttp.ClientSession, host: str, port: int, room_id: int, timeout: float,
                   on_state: Callable[[str], None], prefill_url: str | None = None) -> str:
    """Wait for the prefill of ``room_id`` and take its KV cache; "" on success, else why not.

    ``on_state`` hears "waiting" (no handshake with the prefill yet) and "prefilling"
    (handshaken: the KV cache is awaited), so the caller can count the request in the
    right queue.
    """
    rooms = local_rooms(host, port)
    if rooms is not None:
        return await _fetch_local(rooms, room_id, timeout, on_state)
    base = prefill_url.rstrip("/") if prefill_url else f"http://{host}:{port}"
    return await _fetch_remote(session, f"{base}/bootstrap/{room_id}", timeout, on_state)


async def _fetch_local(rooms: Rooms, room_id: int, timeout: float, on_state: Callable[[str], None]) -> str:
    deadline = time.monotonic() + timeout
    room = rooms.get(room_id)
    rooms.update(room, attached=True)
    on_state("waiting")
    if not await rooms.wait_for(room, lambda r: r.handshaken, timeout):
        return room.failed or f"no handshake with the prefill of room {room_id} within {timeout:g} s"
    on_state("prefilling")
    if not await rooms.wait_for(room, lambda r: r.ready, max(0.0, deadline - time.monotonic())):
        return room.failed or f"prefill of room {room_id} not done within {timeout:g} s"
    return "" if rooms.take(room) else f"room {room_id} was taken already"


async def _fetch_remote(session: aiohttp.ClientSession, url: str, timeout: float,
                        on_state: Callable[[str], None]) -> str:
    deadline = time.monotonic() + timeout
    last = "no poll yet"
    for _ in range(int(timeout / RETRY_PAUSE) + 10):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        wait = min(POLL_WAIT, remaining)
        try:
            async with session.get(url, params={"wait": f"{wait:.3f}"},
                                   timeout=aiohttp.ClientTimeout(total=wait + 5)) as resp:
                state = (await resp.json())["state"]
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError) as exc:
            last = f"bootstrap poll failed: {exc!r}"
            await asyncio.sleep(min(RETRY_PAUSE, max(0.0, deadline - time.monotonic())))
            continue
        if state == "transferred":
            return ""
        if state == "failed":
            return f"prefill reported failure at {url}"
        on_state("prefilling" if state in ("prefilling", "ready") else "waiting")
        last = f"state {state}"
    return f"KV not transferred within {timeout:g} s ({last})"


# ----------------------------------------------------------------------------------
# The prefill's bootstrap listener
# ----------------------------------------------------------------------------------
class BootstrapServer:
    """``GET /bootstrap/{room}?wait=S`` and ``GET /health`` on their own port."""

    def __init__(self, rooms: Rooms, host: str, port: int = 0) -> None:
        self.rooms, self.host, self.port = rooms, host, port
        self._runner: web.AppRunner | None = None

    async def start(self) -> "BootstrapServer":
        app = web.Application()
        app.router.add_get("/bootstrap/{room}", poll_handler(self.rooms))
        app.router.add_get("/health", self._health)
        self._runner, self.port = await start_app(app, self.host, self.port)
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)


def poll_handler(rooms: Rooms):
    """The aiohttp handler for ``GET /bootstrap/{room}?wait=S`` over ``rooms``."""

    async def poll(request: web.Request) -> web.Response:
        try:
            room_id = int(request.match_info["room"])
            wait = min(max(float(request.query.get("wait", "0")), 0.0), POLL_WAIT)
        except ValueError:
            return web.json_response({"error": "room and wait must be numbers"}, status=400)
        state = await rooms.poll(room_id, wait)
        return web.json_response({"room": room_id, "state": state})

    return poll
