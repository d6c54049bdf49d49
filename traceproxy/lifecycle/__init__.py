"""The lifecycle core: pure rules about requests and connections.

Standard library only. No asyncio, no sockets, no clock reads, no sleeping: callers
pass events and an explicit ``now`` (monotonic nanoseconds) in, and read phase,
outcome and verdict out. ``proxy/`` reports what happens here; ``observe/`` reads it.
"""
