"""Two socket-level facts the asyncio transport API does not offer.

* ``reset``: ``transport.abort()`` closes the socket without flushing, but the
  kernel still ends the connection with a FIN, queued behind any bytes the peer has
  not taken yet. A zero linger time makes the close send RST at once: the peer
  reads an error, not an end of data, even if it is not reading.
* ``peer_hung_up``: while a transport's reading is paused the loop does not watch
  its socket, so a peer's FIN or RST goes unseen. Linux reports a FIN as POLLRDHUP
  even behind unread bytes; POLLHUP and POLLERR cover a reset.
"""

from __future__ import annotations

import asyncio
import select
import socket
import struct

_LINGER_ZERO = struct.pack("ii", 1, 0)
_HANG_UP = select.POLLHUP | select.POLLERR | getattr(select, "POLLRDHUP", 0)


def reset(transport: asyncio.BaseTransport) -> None:
    """Close ``transport`` with RST; what was written but not yet sent is dropped."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_ZERO)
        except OSError:
            pass  # already closed underneath: abort() below is all there is to do
    transport.abort()


def peer_hung_up(transport: asyncio.BaseTransport) -> bool:
    """True when the peer closed (FIN) or reset the connection, even with unread bytes."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return False
    poller = select.poll()
    poller.register(sock.fileno(), _HANG_UP)
    return any(events & _HANG_UP for _, events in poller.poll(0))
