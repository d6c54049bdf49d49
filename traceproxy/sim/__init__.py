"""Simulated upstreams. This package talks HTTP only and never imports the rest of
traceproxy: a black-box peer cannot share the proxy's bugs."""
