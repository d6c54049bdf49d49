"""Two socket-level facts the asyncio transport API does not offer.

* ``reset``: ``transport.abort()`` closes the socket without flushing, but the
  kernel still ends the connection with a FIN, queued behind any bytes the peer has
  not taken yet. A zero linger time makes the close send RST at once: the peer
  reads an error, not an end of data, even if it is not reading.
* ``peer_hung_up``: while a transport's reading is paused the loop does not watch
  its socket, so a peer's FIN or RST goes unseen. Linux reports a FIN as POLLRDHUP
  even behind unread bytes; POLLHUP and POLLERR cover a reset.
* ``unsent``: what was written and the peer has not acknowledged yet, the transport's
  own buffer included. Whether a client that is not draining its connection takes
  anything at all shows only here: the kernel lets the transport write again only
  once a third of its send buffer is free, which a slow reader takes long to free.
"""

from __future__ import annotations

import asyncio
import fcntl
import select
import socket
import struct
import termios

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


def unsent(transport: asyncio.WriteTransport) -> int | None:
    """Bytes written to ``transport`` that the peer has not acknowledged; None if unknown."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return None
    try:
        queued = struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0]
    except (OSError, ValueError):
        return None  # closed underneath (ValueError: a closed socket has no file number)
    return transport.get_write_buffer_size() + queued


FIN, RESET = "fin", "reset"


def peer_hung_up(transport: asyncio.BaseTransport) -> str | None:
    """FIN when the peer closed, RESET when it reset the connection (even with unread
    bytes); None while it has done neither."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return None
    poller = select.poll()
    poller.register(sock.fileno(), _HANG_UP)
    for _, events in poller.poll(0):
        if events & (select.POLLHUP | select.POLLERR):
            return RESET
        if events & _HANG_UP:
            return FIN
    return None
