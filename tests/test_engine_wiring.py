"""What the engine side's wiring says of itself when it starts."""

from __future__ import annotations

import logging
from types import SimpleNamespace

from traceproxy.config.addresses import HostPort
from traceproxy.engine_wiring import _log_receiver


def test_the_receivers_log_line_names_the_bound_ports_with_ipv6_in_brackets(caplog):
    receiver = SimpleNamespace(http_address=HostPort("::1", 0), http_port=43117,
                               grpc_address=HostPort("127.0.0.1", 0), grpc_port=43118, pid=4242)
    with caplog.at_level(logging.INFO, logger="traceproxy"):
        _log_receiver(receiver)
    assert "OTLP receiver on http [::1]:43117, grpc 127.0.0.1:43118 (pid 4242)" in caplog.text


def test_a_receiver_that_is_off_is_not_named(caplog):
    receiver = SimpleNamespace(http_address=None, http_port=0, grpc_address=HostPort("127.0.0.1", 0),
                               grpc_port=43118, pid=4242)
    with caplog.at_level(logging.INFO, logger="traceproxy"):
        _log_receiver(receiver)
    assert "OTLP receiver on grpc 127.0.0.1:43118 (pid 4242)" in caplog.text
