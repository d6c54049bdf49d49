"""What a proxy process loads: the admin listener's web framework only when it is on.

aiohttp (the admin listener's server) is about 12 MB of a proxy process; a service
run with the admin listener off, as behind another metrics path, does not pay for it.
Each case runs in its own interpreter, since this one has imported everything."""

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


@pytest.mark.parametrize("admin, loads_aiohttp", [("off", False), ("127.0.0.1:0", True)])
def test_the_admin_listeners_framework_is_loaded_only_when_it_is_on(admin, loads_aiohttp):
    result = subprocess.run([sys.executable, "-c", SERVE_AND_REPORT, admin], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == str(loads_aiohttp)
