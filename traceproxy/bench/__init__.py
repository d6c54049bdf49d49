"""``traceproxy bench``: direct-to-upstream against through-the-proxy, plain, traced and logged, in one run.

Every part runs in its own process so they do not share one CPU by construction:

* ``upstream_proc``: the fast simulated upstream (``traceproxy.sim.fast``);
* ``proxy_proc``: a proxy under test: ``proxy`` (tracing and access log off, or any
  command given by ``--proxy-cmd``), ``proxy-traced`` (tracing on, OTLP to the sink),
  ``proxy-logged`` (the access log to a file) and ``proxy-receiver`` (``-grpc``: the engine
  span receiver on), each its own process tree;
* ``sink_proc``: the OTLP/HTTP sink that ``proxy-traced`` exports to, counting spans;
* ``loadgen``: raw asyncio protocol clients that time every request and SSE event;
* ``span_load`` (with ``--engine-span-load``): two emulated SGLang workers exporting their
  spans during every run, to a ``proxy-receiver`` target's receiver or else to
  ``discard_proc``, a sink that drops them, so every target pays their CPU alike.

``runner`` starts them (each in its own session, stopped by process group), runs
each scenario of ``scenarios`` against every target, interleaved and rotated per
rep, and ``report`` prints the comparison and what tracing and the access log
cost. Entry:
``runner.main(argv)``.
"""
