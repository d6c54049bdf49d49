"""Observers: they watch the lifecycle and never touch the proxy's sockets."""
