"""traceproxy: a keep-alive-correct HTTP/1.1 reverse proxy that says where a request got stuck."""

__version__ = "0.1.0"
