"""A listening socket for the small HTTP servers of our own (the engine span receiver's
OTLP/HTTP, the admin listener): it makes one protocol per connection, keeps track of
them, and ends them when it stops."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


class ConnectionListener:
    """``make_connection(self)`` makes a connection's protocol, which adds itself to
    ``connections`` when made and discards itself when lost; ``stop`` ends each left
    with its ``end_now()``."""

    def __init__(self, make_connection: Callable[["ConnectionListener"], asyncio.Protocol]) -> None:
        self._make_connection = make_connection
        self._server: asyncio.AbstractServer | None = None
        self.connections: set = set()

    async def start(self, host: str, port: int) -> int:
        """Listens; the port bound (``port`` 0 asks for any)."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: self._make_connection(self), host, port)
        return self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is None:
            return
        self._server.close()
        for connection in list(self.connections):
            connection.end_now()
        await self._server.wait_closed()
        self._server = None
