"""``traceproxy bench``: direct-to-upstream against through-the-proxy, in one run.

Every part runs in its own process so they do not share one CPU by construction:

* ``upstream_proc``: the fast simulated upstream (``traceproxy.sim.fast``);
* ``proxy_proc``: the proxy under test (or any command given by ``--proxy-cmd``);
* ``loadgen``: raw asyncio protocol clients that time every request and SSE event.

``runner`` starts them (each in its own session, stopped by process group),
runs each scenario of ``scenarios`` against the upstream and then the proxy,
alternately, and ``report`` prints the comparison. Entry: ``runner.main(argv)``.
"""
