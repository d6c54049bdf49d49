"""What a proxy process loads: no web framework, with the admin listener on or off.

aiohttp's server (``aiohttp.web``) was about 15 MB of a proxy process of about 45; the
admin listener has a server of its own (``admin_http``). aiohttp is loaded only to scrape
engines' metrics (``[engines] metrics_urls``). Each case runs in its own interpreter,
since this one has imported everything."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

SERVE_AND_REPORT = textwrap.dedent("""
    import asyncio, sys
    from traceproxy.app import ProxyServer
    from traceproxy.config import default_settings

    async def main():
        settings = default_settings().replace(**{
            "listen": "127.0.0.1:0", "upstream": "http://127.0.0.1:9", "admin": sys.argv[1],
            "tracing.exporter": "off", "access_log.path": ""})
        server = ProxyServer(settings)
        await server.start()
        loaded = "aiohttp" in sys.modules
        await server.shutdown(grace=0, exporter_stop=1.0)
        print(loaded)

    asyncio.run(main())
""")


@pytest.mark.parametrize("admin", ["off", "127.0.0.1:0"])
def test_a_proxy_loads_no_web_framework_whether_its_admin_listener_is_on_or_off(admin):
    result = subprocess.run([sys.executable, "-c", SERVE_AND_REPORT, admin], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "False"
