from .support import RawClient


def test_streaming_chat_turns_share_one_upstream_connection(fast_upstream, start_proxy):
    up = fast_upstream()
    proxy = start_proxy(up.url)
    client = RawClient(proxy.port)
    for _ in range(3):
        resp = client.roundtrip("POST", "/v1/chat/completions", body=b'{"stream": true, "max_tokens": 4}')
        assert resp.status == 200 and resp.complete
        assert resp.body.rstrip().endswith(b"data: [DONE]")
    assert proxy.ctx.pool.stats["opened"] == 1
    assert proxy.ctx.pool.stats["reused"] == 2
