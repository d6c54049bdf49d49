"""The simulated PD deployment (``traceproxy.sim``), alone and behind each real router.

Part 1 checks the simulated workers on their own: the fault table, what the routers
call, PD pairing by ``bootstrap_room`` and by vLLM's ``kv_transfer_params`` (in one
process and across processes), pacing, per-request faults, idle closes, the faulty
keep-alive proxy and the CLI.

Part 2 runs traceproxy in front of each real router (sglang-router, smg,
vllm-router; PD mode) in front of the simulated workers, with fast stall thresholds,
and checks for each named fault what the client gets, which verdict and blame
traceproxy gives, and the engine-side stage the request hangs in. The router sits in
the middle, so the assertions are about what really comes out of it; where the
routers differ, each one's behaviour is asserted, and the comments say what it did.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import selectors
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from traceproxy.cli import main as cli_main
from traceproxy.sim.shapes import prompt_tokens
from traceproxy.sim.engine import SimWorker
from traceproxy.sim.faults import FAULTS, FaultError, parse_fault, parse_faults, split_by_home
from traceproxy.sim.faultyproxy import FaultyProxy
from traceproxy.sim import launch
from traceproxy.sim.launch import SimDeployment, free_port
from traceproxy.sim.routers import (ROUTER_NAMES, ROUTERS, VLLM_PROTOCOL, RouterKind, default_router,
                                    installed_routers, router_kind)
from traceproxy.sim.startup import ListenerError
from traceproxy.sim.otel import make_tracing
from traceproxy.sim.stages import STAGE_ORDER

from .otlp_receiver import OtlpGrpcReceiver
from .router_harness import ROUTERS_UNDER_TEST, RouterHarness, reset_around_the_test
from .support import Done, LoopThread, RawClient, recv_until, start_worker, wait_until  # noqa: F401  (start_worker: a fixture)

REPO = Path(__file__).resolve().parents[1]
FAST = {"stall.first_byte": 0.5, "stall.stream_gap": 0.5}
GAUGE_NAMES = ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:num_prefill_inflight_queue_reqs",
               "sglang:num_decode_transfer_queue_reqs", "sglang:num_prefill_prealloc_queue_reqs",
               "sglang:num_decode_prealloc_queue_reqs")
JSON = [("Content-Type", "application/json")]


# ----------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------
def chat_body(stream: bool = True, max_tokens: int = 5, **extra) -> bytes:
    return json.dumps({"model": "sim-llama", "messages": [{"role": "user", "content": "Say hi"}],
                       "max_tokens": max_tokens, "stream": stream, **extra}).encode()


def completion_body(stream: bool = True, max_tokens: int = 5, **extra) -> bytes:
    return json.dumps({"model": "sim-llama", "prompt": "Say hi", "max_tokens": max_tokens, "stream": stream,
                       **extra}).encode()


def generate_body(room: int | None = None, bootstrap_port: int | None = None, text: str = "Say hi",
                  max_new_tokens: int = 4, stream: bool = False) -> bytes:
    body = {"text": text, "sampling_params": {"max_new_tokens": max_new_tokens}, "stream": stream}
    if room is not None:
        body.update(bootstrap_host="127.0.0.1", bootstrap_port=bootstrap_port, bootstrap_room=room)
    return json.dumps(body).encode()


def sse_events(body: bytes) -> list[str]:
    return [part[len(b"data: "):].decode() for part in body.split(b"\n\n") if part.startswith(b"data: ")]


def token_events(data: bytes) -> int:
    """Token events in a body or in raw (chunked) bytes: each carries a null finish reason."""
    return data.count(b'"finish_reason":null')


def send_next(client: RawClient, *args) -> None:
    """Send the next request on a kept-alive connection without waiting for the answer."""
    client.conn.start_next_cycle()
    client.request(*args)


def http_get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return resp.read()


def http_post_json(url: str, payload: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def gauge(worker: SimWorker, name: str) -> float:
    """One sample from the worker's /metrics, read over HTTP like Prometheus would."""
    return gauge_at(worker.url, name)


def gauge_at(url: str, name: str) -> float:
    for line in http_get(f"{url}/metrics").decode().splitlines():
        if line.startswith(f'{name}{{model_name="'):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in {url}/metrics")


def read_for(client: RawClient, seconds: float) -> bytes:
    """Whatever arrives on the client's socket within ``seconds`` (raw bytes)."""
    client.sock.settimeout(0.1)
    out = bytearray()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            data = client.sock.recv(65536)
        except socket.timeout:
            continue
        if not data:
            break
        out += data
    return bytes(out)


def inflight_entry(proxy, code: str, timeout: float = 5.0) -> dict:
    """The /debug/inflight entry of the request the watchdog has judged ``code``."""
    def find():
        entries = json.loads(http_get(f"http://127.0.0.1:{proxy.admin_port}/debug/inflight"))["requests"]
        return next((e for e in entries if any(s["outcome"] == code for s in e["stalls"])), None)

    assert wait_until(lambda: find() is not None, timeout=timeout), f"no {code} stall in /debug/inflight"
    entry = find()
    assert entry["verdict"]["outcome"] == code and entry["verdict"]["stalled"] is True, entry
    return entry


def read_lines(proc: subprocess.Popen, count: int, timeout: float, stream: str = "stdout") -> list[str]:
    """``count`` lines of a child's stdout (or stderr), bounded by ``timeout``."""
    pipe = getattr(proc, stream)
    lines: list[str] = []
    buf = b""
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as sel:
        sel.register(pipe, selectors.EVENT_READ)
        while len(lines) < count and time.monotonic() < deadline:
            if not sel.select(timeout=0.2):
                continue
            chunk = os.read(pipe.fileno(), 4096)
            if not chunk:
                break
            buf += chunk
            *done, buf = buf.split(b"\n")
            lines += [line.decode() for line in done]
    assert len(lines) >= count, f"got {lines!r} from {proc.args}"
    return lines[:count]


def sim_command(*args: str, stderr=subprocess.DEVNULL) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    return subprocess.Popen([sys.executable, "-m", "traceproxy", "sim", *args], cwd=REPO, env=env,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=stderr,
                            start_new_session=True)


def failed_start(*args: str, timeout: float = 30) -> tuple[int, str, str]:
    """``traceproxy sim`` that is expected not to start: (exit status, stdout, stderr).

    Bounded: a sim that starts after all is stopped, and reads as status None."""
    proc = sim_command(*args, stderr=subprocess.PIPE)
    try:
        out, err = proc.communicate(timeout=timeout)
        return proc.returncode, out.decode(), err.decode()
    except subprocess.TimeoutExpired:
        stop_child(proc)
        out, err = proc.communicate(timeout=10)
        return None, out.decode(), err.decode()


@pytest.fixture
def held_port():
    """A port some other process listens on (here: a bare listening socket)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)
        yield sock.getsockname()[1]


def stop_child(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> int:
    """Signal a child and wait (bounded); SIGKILL its group only if it lingers.

    Graceful first, also when a test failed: ``traceproxy sim`` stops the router it
    started (in the router's own session, out of reach of our killpg) and removes
    its temporary directories only when it is allowed to shut down.
    """
    if proc.poll() is None:
        proc.send_signal(sig)
    try:
        return proc.wait(20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return proc.wait(5)


# ----------------------------------------------------------------------------------
# 1. The workers on their own
# ----------------------------------------------------------------------------------
def test_fault_table_parses_every_fault_and_rejects_bad_specs(capsys):
    for name, kind in FAULTS.items():
        assert parse_fault(name) == (name, kind.default)
        assert kind.meaning and kind.home in ("prefill", "decode", "any")
    assert parse_faults("decode_stall:7, idle_close:0.5") == {"decode_stall": ("decode_stall", 7),
                                                              "idle_close": ("idle_close", 0.5)}
    assert str(parse_fault("slow_first_token:1500")) == "slow_first_token:1500"
    for bad in ("no_such_fault", "decode_stall:x", "decode_stall:-1", "no_done:3", "malformed_sse:json",
                "slow_first_token:inf", "slow_first_token:nan", "idle_close:nan"):  # inf: a hang nothing ends
        with pytest.raises(FaultError):
            parse_fault(bad)
    with pytest.raises(FaultError, match=r"^fault decode_stall:N needs a whole number, got 'x'$"):
        parse_fault("decode_stall:x")
    with pytest.raises(FaultError, match=r"needs a number, got 'soon'$"):
        parse_fault("slow_first_token:soon")
    assert split_by_home(["prefill_stall", "decode_stall:3", "idle_close:1"]) == {
        "prefill": ["prefill_stall", "idle_close:1"], "decode": ["decode_stall:3", "idle_close:1"]}
    # The CLI help is generated from the same table.
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["sim", "--help"])
    assert exit_info.value.code == 0
    help_text = capsys.readouterr().out
    for name, kind in FAULTS.items():
        assert name in help_text and kind.meaning.split(":")[0][:30] in help_text


def test_worker_answers_what_the_router_probes(start_worker):
    prefill = start_worker("prefill", model="probe-model")
    for path in ("/server_info", "/get_server_info"):
        info = json.loads(http_get(prefill.url + path))
        assert info["disaggregation_mode"] == "prefill" and info["tp_size"] == 1 and info["dp_size"] == 1
        assert info["served_model_name"] == "probe-model" and os.path.isdir(info["model_path"])
    for path in ("/model_info", "/get_model_info"):
        assert json.loads(http_get(prefill.url + path))["model_path"] == info["model_path"]
    assert json.loads(http_get(prefill.url + "/v1/models"))["data"][0]["id"] == "probe-model"
    for path in ("/health", "/health_generate"):
        assert http_get(prefill.url + path) == b""
    metrics = http_get(prefill.url + "/metrics").decode()
    for name in GAUGE_NAMES:
        assert f"# TYPE {name} gauge" in metrics
    # As prometheus_client writes a counter: HELP, TYPE and the sample all name it with _total.
    assert "# HELP sglang:num_bootstrap_failed_reqs_total " in metrics
    assert "# TYPE sglang:num_bootstrap_failed_reqs_total counter" in metrics
    for name in GAUGE_NAMES:
        assert f'{name}{{model_name="probe-model"}} 0' in metrics


def test_worker_reports_its_load_as_sglang_does_for_smg(start_worker):
    decode = start_worker("decode", default_faults=["decode_stall:1"])
    held = RawClient(decode.port)
    held.request("POST", "/v1/chat/completions", JSON, chat_body())
    assert wait_until(lambda: gauge(decode, "sglang:num_running_reqs") == 1, timeout=5)
    for path in ("/loads?model=sim-llama", "/v1/loads?include=core,disagg,queues,memory", "/v1/loads"):
        report = json.loads(http_get(decode.url + path))
        assert report["dp_rank_count"] == 1 and report["aggregate"]["total_running_reqs"] == 1, path
        [rank] = report["loads"]
        assert rank["dp_rank"] == 0 and rank["num_running_reqs"] == 1 and rank["num_waiting_reqs"] == 0, path
        assert rank["disaggregation"]["mode"] == "decode" and rank["queues"]["waiting"] == 0, path
    [core] = json.loads(http_get(decode.url + "/v1/loads?include=core"))["loads"]
    assert {"memory", "disaggregation", "queues"}.isdisjoint(core) and core["num_running_reqs"] == 1
    with pytest.raises(urllib.error.HTTPError) as refused:
        http_get(decode.url + "/v1/loads?include=core,gpu")
    assert refused.value.code == 400 and "'gpu'" in json.loads(refused.value.read())["error"]["message"]
    held.close()


def test_worker_renders_and_tokenizes_as_vllm_does_for_vllm_router(start_worker):
    prefill = start_worker("prefill")
    chat = {"model": "sim-llama", "messages": [{"role": "user", "content": "Say hi to the world"}], "max_tokens": 7}
    status, rendered = http_post_json(prefill.url + "/v1/chat/completions/render", chat)
    assert status == 200 and rendered["model"] == "sim-llama" and rendered["sampling_params"]["max_tokens"] == 7
    status, tokens = http_post_json(prefill.url + "/tokenize", {"model": "sim-llama", "messages": chat["messages"]})
    assert status == 200 and tokens["tokens"] == rendered["token_ids"] and tokens["count"] == len(tokens["tokens"])
    # The same text gives the same ids, and a longer conversation starts with the shorter one's.
    longer = {**chat, "messages": [*chat["messages"], {"role": "assistant", "content": "Hello, world"}]}
    _, again = http_post_json(prefill.url + "/v1/chat/completions/render", longer)
    assert again["token_ids"][:len(rendered["token_ids"]) - 1] == rendered["token_ids"][:-1]
    status, prompts = http_post_json(prefill.url + "/v1/completions/render",
                                     {"model": "sim-llama", "prompt": ["one", "two two"], "max_tokens": 3})
    assert status == 200 and [len(p["token_ids"]) for p in prompts] == [1, 2]
    assert http_post_json(prefill.url + "/v1/chat/completions/render", {"messages": "hi"})[0] == 400
    assert prefill.requests == []  # neither is inference
    assert {(c.path, c.status) for c in prefill.calls} >= {("/tokenize", 200), ("/v1/completions/render", 200)}


@pytest.mark.parametrize("path, payload, field", [
    ("/v1/chat/completions", {"messages": [], "max_tokens": "abc"}, "max_tokens"),
    ("/v1/chat/completions", {"messages": [], "max_tokens": -1}, "max_tokens"),
    ("/v1/chat/completions", {}, "messages"),
    ("/v1/chat/completions", {"messages": "hi"}, "messages"),
    ("/v1/chat/completions", {"messages": [], "stream": "no"}, "stream"),
    ("/generate", {}, "text or input_ids"),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 1.5}}, "max_new_tokens"),
])
def test_requests_sglang_would_refuse_get_a_400_naming_the_field(start_worker, path, payload, field):
    worker = start_worker("decode")
    status, body = http_post_json(worker.url + path, payload)
    assert status == 400 and field in body["error"]["message"]
    assert worker.requests == []  # refused before any generation


def test_admin_faults_can_be_read_replaced_and_cleared(start_worker):
    decode = start_worker("decode", default_faults=["no_done"])
    assert json.loads(http_get(decode.url + "/admin/faults")) == {"faults": ["no_done"]}
    status, body = http_post_json(decode.url + "/admin/faults", {"faults": ["decode_stall:2", "idle_close:1.5"]})
    assert status == 200 and body == {"faults": ["decode_stall:2", "idle_close:1.5"]}
    status, body = http_post_json(decode.url + "/admin/faults", {"faults": ["bogus"]})
    assert status == 400 and "unknown fault" in body["error"]
    assert http_post_json(decode.url + "/admin/faults", {"faults": []}) == (200, {"faults": []})


@pytest.mark.parametrize("role, fault, home", [
    ("decode", "bootstrap_stall", "prefill"),  # decode alone has no handshake to hold
    ("decode", "kv_transfer_stall", "prefill"),
    ("prefill", "decode_stall:2", "decode"),
    ("prefill", "decode_waiting_stall", "decode"),
])
def test_a_fault_posted_to_a_worker_that_never_acts_on_it_is_refused_naming_its_role(start_worker, role, fault,
                                                                                       home):
    worker = start_worker(role, default_faults=["idle_close:5"])
    status, body = http_post_json(worker.url + "/admin/faults", {"faults": [fault]})
    assert status == 400, body
    assert f"acts on the {home} worker" in body["error"] and fault.split(":")[0] in body["error"], body
    assert json.loads(http_get(worker.url + "/admin/faults")) == {"faults": ["idle_close:5"]}  # unchanged


def test_a_decode_worker_without_a_router_takes_the_prefill_faults_it_acts_on_when_it_serves_alone(start_worker):
    decode = start_worker("decode")
    assert http_post_json(decode.url + "/admin/faults", {"faults": ["prefill_stall"]}) == (
        200, {"faults": ["prefill_stall"]})


def test_a_decode_worker_serving_alone_refuses_its_own_fault_of_the_pd_pair(start_worker):
    # decode_waiting_stall is decode's, but waits on a KV transfer that a lone decode never has.
    decode = start_worker("decode")
    status, body = http_post_json(decode.url + "/admin/faults", {"faults": ["decode_waiting_stall"]})
    assert status == 400 and "decode worker serves alone and would never act on it" in body["error"], body


@pytest.mark.parametrize("fault", ["prefill_stall", "pinned_request"])
def test_a_decode_worker_behind_a_pd_router_refuses_the_prefill_faults_it_never_acts_on(start_worker, fault):
    # Behind the router every request decode gets names its prefill: it never serves alone,
    # so a prefill fault set on it would be taken and ignored.
    decode = start_worker("decode", pd=True, default_faults=["idle_close:5"])
    status, body = http_post_json(decode.url + "/admin/faults", {"faults": [fault]})
    assert status == 400, body
    assert body["error"] == (f"fault {fault} acts on the prefill worker, not on this decode worker: "
                             "set it on the prefill worker")
    assert json.loads(http_get(decode.url + "/admin/faults")) == {"faults": ["idle_close:5"]}  # unchanged


def test_a_deployment_behind_a_router_puts_its_workers_in_pd_mode_and_one_without_does_not():
    assert SimDeployment(router=True).decode.pd and SimDeployment(router=True).prefill.pd
    assert not SimDeployment(router=False).decode.pd


def test_a_deployment_without_a_router_arms_the_prefill_faults_on_the_decode_worker_that_serves_alone():
    # `sim --no-router --fault prefill_stall`: every request reaches the decode worker only,
    # which does its own prefill; a fault left on the idle prefill worker would do nothing.
    alone = SimDeployment(router=False, faults=["prefill_stall", "decode_stall:3", "idle_close:5"])
    assert sorted(alone.decode.faults) == ["decode_stall", "idle_close", "prefill_stall"]
    behind = SimDeployment(router=True, faults=["prefill_stall", "decode_stall:3"])
    assert sorted(behind.decode.faults) == ["decode_stall"] and sorted(behind.prefill.faults) == ["prefill_stall"]


@pytest.mark.parametrize("fault, home", [("bootstrap_stall", "prefill"), ("prefill_stall", "prefill"),
                                         ("pinned_request", "prefill")])
def test_sim_worker_refuses_a_fault_its_role_never_acts_on(capsys, fault, home):
    assert _exit_status(["sim", "worker", "--role", "decode", "--fault", fault]) == 2
    err = capsys.readouterr().err
    assert f"fault {fault} acts on the {home} worker, not on this decode worker" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_sim_help_says_when_a_decode_worker_acts_on_the_prefill_faults(capsys):
    assert _exit_status(["sim", "--help"]) == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert "refuses the (prefill) faults too" in help_text and "--no-router" in help_text


def _pair_and_check(prefill_port: int, bootstrap_port: int, decode: SimWorker, room: int) -> None:
    """Decode first: it must wait (prealloc queue) until its prefill has run."""
    decode_client = RawClient(decode.port)
    decode_client.request("POST", "/generate", JSON, generate_body(room, bootstrap_port))
    assert wait_until(lambda: gauge(decode, "sglang:num_decode_prealloc_queue_reqs") == 1, timeout=5)
    assert read_for(decode_client, 0.3) == b"", "decode answered before its prefill arrived"
    prefill_answer = RawClient(prefill_port).roundtrip("POST", "/generate", JSON, generate_body(room, bootstrap_port))
    decoded = decode_client.response()
    assert prefill_answer.status == 200 and json.loads(prefill_answer.body)["text"] == ""
    assert decoded.status == 200 and json.loads(decoded.body)["meta_info"]["completion_tokens"] == 4
    assert gauge(decode, "sglang:num_decode_prealloc_queue_reqs") == 0


def vllm_prefill_body(text: str = "Say hi") -> bytes:
    """What vllm-router sends the prefill of a /generate request."""
    return json.dumps({"text": text, "sampling_params": {"max_new_tokens": 4}, "stream": False, "max_tokens": 1,
                       "min_tokens": 1, "kv_transfer_params": {
                           "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                           "remote_block_ids": None, "remote_host": None, "remote_port": None}}).encode()


def vllm_decode_body(params: dict, stream: bool = False) -> bytes:
    """What vllm-router sends decode once prefill answered: the client's body and prefill's parameters."""
    return json.dumps({"text": "Say hi", "sampling_params": {"max_new_tokens": 4}, "stream": stream,
                       "kv_transfer_params": params}).encode()


def _pair_vllm_and_check(prefill_url: str, decode: SimWorker) -> None:
    """Prefill first: it answers with kv_transfer_params and keeps the KV cache until decode pulls it."""
    answer = RawClient(int(prefill_url.rsplit(":", 1)[1])).roundtrip("POST", "/generate", JSON, vllm_prefill_body())
    assert answer.status == 200
    params = json.loads(answer.body)["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_request_id"].startswith("sim-room-") and params["remote_block_ids"] == [0]
    assert gauge_at(prefill_url, "sglang:num_prefill_inflight_queue_reqs") == 1  # kept for decode
    decoded = RawClient(decode.port).roundtrip("POST", "/generate", JSON, vllm_decode_body(params))
    assert decoded.status == 200 and json.loads(decoded.body)["meta_info"]["completion_tokens"] == 4
    [seen] = decode.requests
    assert f"sim-room-{seen.room}" == params["remote_request_id"]
    assert wait_until(lambda: gauge_at(prefill_url, "sglang:num_prefill_inflight_queue_reqs") == 0, timeout=5)


def test_decode_waits_for_its_prefill_room_in_one_process(start_worker):
    prefill, decode = start_worker("prefill"), start_worker("decode")
    _pair_and_check(prefill.port, prefill.bootstrap_port, decode, room=7)
    assert gauge(prefill, "sglang:num_prefill_inflight_queue_reqs") == 0


def test_a_decode_whose_client_left_as_its_prefill_failed_ends_quietly(start_worker, loop_thread, caplog):
    # At a deployment's stop the router's connections close as the prefill lets go of its
    # requests and fails their rooms: a waiting decode can learn of the failure before
    # aiohttp cancels it for its lost client. Writing the failure then finds the
    # connection closing: the client is gone, which is no error of the worker's.
    caplog.set_level("INFO", logger="traceproxy.sim")
    prefill, decode = start_worker("prefill"), start_worker("decode")
    client = RawClient(decode.port)
    client.request("POST", "/generate", JSON, generate_body(room=5, bootstrap_port=prefill.bootstrap_port, stream=True))
    assert wait_until(lambda: gauge(decode, "sglang:num_decode_prealloc_queue_reqs") == 1, timeout=5)

    async def fail_the_room_then_lose_the_client() -> int:
        prefill.rooms.update(prefill.rooms.get(5), failed="prefill let go")  # decode wakes first ...
        closed = 0
        for handler in decode._runner.server.connections:  # ... then learns its client is gone
            if handler.transport is not None and handler.transport.get_extra_info("peername")[1] == \
                    client.sock.getsockname()[1]:
                handler.transport.close()
                closed += 1
        return closed

    assert loop_thread.run(fail_the_room_then_lose_the_client()) == 1
    assert wait_until(lambda: gauge(decode, "sglang:num_decode_prealloc_queue_reqs") == 0, timeout=5)
    assert wait_until(lambda: any("room=5" in r.getMessage() for r in caplog.records
                                  if r.name == "traceproxy.sim.decode"), timeout=5)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
    client.close()


def test_vllm_decode_pulls_the_kv_cache_its_prefill_named_in_one_process(start_worker):
    prefill, decode = start_worker("prefill"), start_worker("decode")
    _pair_vllm_and_check(prefill.url, decode)
    [pre] = prefill.requests
    assert pre.room is not None and pre.faults == ()
    assert gauge(prefill, "sglang:num_transfer_failed_reqs_total") == 0


def test_a_vllm_kv_cache_never_pulled_is_a_failed_transfer(start_worker):
    prefill, decode = start_worker("prefill", bootstrap_timeout=0.3), start_worker("decode")
    answer = RawClient(prefill.port).roundtrip("POST", "/generate", JSON, vllm_prefill_body())
    params = json.loads(answer.body)["kv_transfer_params"]
    assert gauge(prefill, "sglang:num_prefill_inflight_queue_reqs") == 1
    assert wait_until(lambda: gauge(prefill, "sglang:num_prefill_inflight_queue_reqs") == 0, timeout=5)
    assert gauge(prefill, "sglang:num_transfer_failed_reqs_total") == 1
    late = RawClient(decode.port).roundtrip("POST", "/generate", JSON, vllm_decode_body(params))
    assert late.status == 503 and json.loads(late.body)["error"]["message"] == "transfer timeout"
    # A cache let go of (POST /admin/release) is dropped without counting a failed transfer.
    RawClient(prefill.port).roundtrip("POST", "/generate", JSON, vllm_prefill_body())
    assert gauge(prefill, "sglang:num_prefill_inflight_queue_reqs") == 1
    assert http_post_json(prefill.url + "/admin/release", {}) == (200, {"released": True})
    assert wait_until(lambda: gauge(prefill, "sglang:num_prefill_inflight_queue_reqs") == 0, timeout=5)
    assert gauge(prefill, "sglang:num_transfer_failed_reqs_total") == 1


def test_a_vllm_decode_given_no_prefill_room_is_served_alone(start_worker):
    # vllm-router passes decode whatever kv_transfer_params prefill answered, or none.
    decode = start_worker("decode")
    for params in (None, {"do_remote_prefill": False}, {"do_remote_prefill": True, "remote_request_id": "x"}):
        resp = RawClient(decode.port).roundtrip("POST", "/generate", JSON, vllm_decode_body(params))
        assert resp.status == 200 and json.loads(resp.body)["meta_info"]["completion_tokens"] == 4, params
    assert [seen.room for seen in decode.requests] == [None, None, None]


@pytest.mark.parametrize("via", ["bootstrap-port", "prefill-url"])
def test_decode_polls_the_bootstrap_of_a_prefill_in_another_process(start_worker, via):
    proc = sim_command("worker", "--role", "prefill", "--log-level", "warning")
    try:
        prefill_line, bootstrap_line = read_lines(proc, 2, timeout=20)
        assert prefill_line.startswith("prefill http://127.0.0.1:") and bootstrap_line.startswith("bootstrap http://")
        prefill_url = prefill_line.split(" ", 1)[1]
        prefill_port = int(prefill_url.rsplit(":", 1)[1])
        if via == "bootstrap-port":  # what the router writes into the body
            decode, bootstrap_port = start_worker("decode"), int(bootstrap_line.rsplit(":", 1)[1])
        else:  # docker-compose: the body's bootstrap port is not where the prefill listens
            decode, bootstrap_port = start_worker("decode", prefill_url=prefill_url), free_port()
        _pair_and_check(prefill_port, bootstrap_port, decode, room=8)
        decode.clear()
        _pair_vllm_and_check(prefill_url, decode)  # remote_host and remote_port name the bootstrap listener
        assert stop_child(proc, signal.SIGINT) == 0
    finally:
        stop_child(proc)


def test_prefill_time_grows_with_the_prompt_and_decode_runs_at_its_rate(start_worker):
    decode = start_worker("decode", prefill_tokens_per_s=4000, decode_tokens_per_s=50)

    def timed(text: str) -> float:
        t0 = time.monotonic()
        resp = RawClient(decode.port).roundtrip("POST", "/generate", JSON, generate_body(text=text, max_new_tokens=10))
        assert resp.status == 200
        return time.monotonic() - t0

    short, long = timed("hi"), timed("x" * 4000)  # ~1 vs ~1000 prompt tokens
    assert 0.2 <= short < 0.35  # 10 tokens at 50 tokens/s
    assert long - short >= 0.2  # + 1000 prompt tokens at 4000 tokens/s


def test_request_faults_from_the_header_act_on_a_worker_used_alone(start_worker):
    decode = start_worker("decode")
    client = RawClient(decode.port)
    client.request("POST", "/v1/chat/completions", [*JSON, ("x-sim-fault", "decode_stall:2")], chat_body())
    got = read_for(client, 0.6)
    assert got.startswith(b"HTTP/1.1 200") and b"[DONE]" not in got
    assert token_events(got) == 2
    [seen] = decode.requests
    assert seen.faults == ("decode_stall:2",)
    client.close()


def test_reset_mid_stream_aborts_the_connection_with_a_tcp_reset(start_worker):
    decode = start_worker("decode")
    sock = socket.create_connection(("127.0.0.1", decode.port), timeout=5)
    body = chat_body(max_tokens=8)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: sim\r\nContent-Type: application/json\r\n"
                 b"x-sim-fault: reset_mid_stream:2\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    got, ending = b"", "timeout"
    try:
        for _ in range(100):
            data = sock.recv(65536)
            if not data:
                ending = "FIN"
                break
            got += data
    except ConnectionResetError:
        ending = "RST"
    finally:
        sock.close()
    assert ending == "RST" and b"[DONE]" not in got
    assert token_events(got) <= 2  # a reset may discard bytes the client had not read yet


def test_idle_close_closes_an_idle_keepalive_connection(start_worker):
    decode = start_worker("decode")
    control = RawClient(decode.port)
    assert control.roundtrip("POST", "/v1/completions", JSON, chat_body(stream=False)).status == 200
    assert not control.is_closed_by_peer(wait=0.6)
    client = RawClient(decode.port)
    t0 = time.monotonic()
    resp = client.roundtrip("POST", "/v1/completions", [*JSON, ("x-sim-fault", "idle_close:0.3")],
                            chat_body(stream=False))
    assert resp.status == 200 and resp.complete
    assert client.is_closed_by_peer(wait=2.0)
    assert time.monotonic() - t0 >= 0.3
    assert decode.idle_closes == 1


def test_idle_close_spares_a_connection_that_carried_no_inference(start_worker):
    # The router's registration calls and health checks are its housekeeping, not traffic under test.
    decode = start_worker("decode", default_faults=["idle_close:0.3"])
    health = RawClient(decode.port)
    assert health.roundtrip("GET", "/health").status == 200
    inference = RawClient(decode.port)
    assert inference.roundtrip("POST", "/v1/completions", JSON, chat_body(stream=False)).status == 200
    assert inference.is_closed_by_peer(wait=2.0)
    assert not health.is_closed_by_peer(wait=0.3)
    assert health.roundtrip("GET", "/health").status == 200
    assert decode.idle_closes == 1


def test_no_otlp_endpoint_means_no_span_export(monkeypatch):
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    assert make_tracing("decode", None) is None


def test_faulty_proxy_limits_are_drawn_from_the_seeded_range(start_worker, loop_thread):
    decode = start_worker("decode", decode_tokens_per_s=1000)
    proxy = loop_thread.run(FaultyProxy(decode.url, hang_after=(1, 3), seed=11).start())
    try:
        answered = []
        for _ in range(6):
            client = RawClient(proxy.port, timeout=0.5)
            turns = 0
            for _ in range(5):  # more turns than any limit
                try:
                    resp = client.roundtrip("POST", "/v1/completions", JSON, chat_body(stream=False))
                except socket.timeout:
                    break
                assert resp.status == 200
                turns += 1
            answered.append(turns)
            client.close()
        assert answered == proxy.limits
        assert set(answered) <= {1, 2, 3} and len(set(answered)) > 1
        assert proxy.hung == 6
    finally:
        loop_thread.run(proxy.stop())


PARSERS = {"sglang-router": "sglang_router.launch_router", "smg": "smg.launch_router",
           "vllm-router": "vllm_router.launch_router"}


@pytest.mark.parametrize("router", ROUTERS_UNDER_TEST)
@pytest.mark.parametrize("level", ["debug", "info", "warn", "warning", "error"])
def test_each_routers_command_is_one_its_own_parser_accepts(router, level):
    # vllm-router spells "warning" in full and refuses "warn"; it has no shutdown grace
    # period, and in vLLM's PD mode the prefill takes no bootstrap port.
    kind = router_kind(router)
    argv = kind.command("python", host="127.0.0.1", port=30001, prometheus_port=30002,
                        prefill_url="http://127.0.0.1:30003", bootstrap_port=30004,
                        decode_url="http://127.0.0.1:30005", log_level=level, request_timeout=20,
                        extra_args=("--policy", "random"))
    assert argv[:2 + len(kind.launch)] == ["python", "-m", *kind.launch]
    parsed = importlib.import_module(PARSERS[router]).parse_router_args(argv[2 + len(kind.launch):])
    assert (parsed.host, parsed.port, parsed.prometheus_port) == ("127.0.0.1", 30001, 30002)
    assert parsed.decode_urls == ["http://127.0.0.1:30005"] and parsed.request_timeout_secs == 20
    assert parsed.policy == "random"
    if kind.protocol == VLLM_PROTOCOL:
        assert parsed.vllm_pd_disaggregation and parsed.prefill_urls == [("http://127.0.0.1:30003", None)]
    else:
        assert parsed.pd_disaggregation and parsed.prefill_urls == [("http://127.0.0.1:30003", 30004)]


def test_a_log_level_no_router_knows_is_refused():
    for kind in ROUTERS:
        with pytest.raises(ValueError, match="log level must be one of debug, info, warning, error"):
            kind.log_level("verbose")


def test_the_default_router_is_the_first_installed(monkeypatch):
    installed = {"smg", "vllm-router"}
    monkeypatch.setattr(RouterKind, "installed", property(lambda kind: kind.name in installed))
    assert [kind.name for kind in installed_routers()] == ["smg", "vllm-router"]
    assert default_router().name == "smg" and launch.resolve_router(True).name == "smg"
    assert launch.resolve_router("vllm-router").name == "vllm-router" and launch.resolve_router(False) is None
    with pytest.raises(launch.RouterUnavailable, match=r"^sglang-router is not installed \(pip install"):
        launch.resolve_router("sglang-router")
    installed.clear()
    assert default_router() is None
    with pytest.raises(launch.RouterUnavailable, match="no router is installed"):
        launch.resolve_router(True)


@pytest.mark.parametrize("argv, message", [
    (["--router", "vllm-router"], "traceproxy sim: --router vllm-router: vllm-router is not installed"
                                  " (pip install vllm-router)\n"),
    (["--router", "smg", "--no-router"], "traceproxy sim: --router and --no-router contradict each other\n"),
    (["--no-router", "--router-arg=--policy=random"],
     "traceproxy sim: --router-arg and --no-router contradict each other\n"),
])
def test_a_router_that_cannot_run_is_a_one_line_error_before_anything_starts(capsys, monkeypatch, argv, message):
    monkeypatch.setattr(RouterKind, "installed", property(lambda kind: kind.name != "vllm-router"))
    assert _exit_status(["sim", *argv]) == 2
    assert capsys.readouterr().err == message


@pytest.mark.parametrize("argv, said", [
    (["worker", "--role", "decode", "--prefill-url", "ftp://prefill:1"], "expected http://HOST:PORT (no path)"),
    (["worker", "--role", "decode", "--prefill-url", "http://[::1"], "expected http://HOST:PORT (no path)"),
    (["worker", "--role", "prefill", "--prefill-url", "http://prefill:1"], "--prefill-url is for a decode worker"),
    (["--model", ""], "expected a model name"),
])
def test_a_worker_argument_that_could_never_work_is_refused_at_once(capsys, argv, said):
    # Before, a bad --prefill-url showed only once a request polled the prefill.
    assert _exit_status(["sim", *argv]) == 2
    err = capsys.readouterr().err
    assert said in err and "Traceback" not in err, err


@pytest.mark.parametrize("argv, installed", [(["--no-router"], True), ([], False)])
def test_without_a_router_the_faults_of_the_pd_handshake_are_refused(capsys, monkeypatch, argv, installed):
    # The decode worker serves alone: it never waits on a handshake or a KV transfer.
    monkeypatch.setattr(RouterKind, "installed", property(lambda kind: installed))
    assert _exit_status(["sim", *argv, "--fault", "decode_stall:2,kv_transfer_stall"]) == 2
    err = capsys.readouterr().err
    assert err.endswith("traceproxy sim: fault kv_transfer_stall acts on the PD handshake or KV transfer between "
                        "prefill and decode, which only a router pairs; without one the decode worker serves alone "
                        "and would never act on it\n"), err


@pytest.mark.parametrize("argv, router, level", [
    ([], True, "warning"),  # SimDeployment takes True for the first router installed
    (["--router", "smg", "--router-log-level", "info"], "smg", "info"),
    (["--no-router"], False, "warning"),
])
def test_the_sim_command_starts_the_router_asked_for(monkeypatch, argv, router, level):
    monkeypatch.setattr(RouterKind, "installed", property(lambda kind: True))
    started = {}

    class Recorded:
        def __init__(self, **options) -> None:
            started.update(options)

    async def run_deployment(deployment) -> int:
        return 0

    monkeypatch.setattr(launch, "SimDeployment", Recorded)
    monkeypatch.setattr(launch, "run_deployment", run_deployment)
    assert _exit_status(["sim", *argv]) == 0
    assert (started["router"], started["router_log_level"]) == (router, level)


def test_an_unknown_router_is_a_usage_error(capsys):
    assert _exit_status(["sim", "--router", "nginx"]) == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'nginx'" in err and "sglang-router" in err and "vllm-router" in err


@pytest.mark.parametrize("router", ROUTERS_UNDER_TEST)
def test_cli_starts_the_deployment_prints_urls_and_stops_everything_on_sigterm(router):
    kind = router_kind(router)
    proc = sim_command("--router", router, "--faulty-proxy", "--log-level", "warning", stderr=subprocess.PIPE)
    children: list[psutil.Process] = []
    try:
        lines = read_lines(proc, 6, timeout=60)
        urls = dict(line.split(" ", 1) for line in lines)
        assert list(urls) == ["prefill", "decode", "router", "router-metrics", "faulty-proxy", "bootstrap"]
        assert all(url.startswith("http://127.0.0.1:") for url in urls.values())
        # The URL [engines] router_metrics_urls takes: the router's Prometheus endpoint.
        assert urls["router-metrics"].endswith("/metrics") and b"# TYPE " in http_get(urls["router-metrics"])
        which, placement = read_lines(proc, 2, timeout=5, stream="stderr")
        assert which.startswith(f"router {router} {kind.version} at {urls['router']}: ")
        assert placement.startswith(f"faulty-proxy {urls['faulty-proxy']} stands in front of the router"
                                    f" {urls['router']}:")
        router_port = int(urls["router"].rsplit(":", 1)[1])
        resp = RawClient(router_port).roundtrip("POST", "/generate", JSON, generate_body())
        assert resp.status == 200 and json.loads(resp.body)["meta_info"]["completion_tokens"] == 4
        children = psutil.Process(proc.pid).children(recursive=True)
        # Each router renames its process (sglang::router, smg::router, vllm::router).
        assert any(kind.process_title in " ".join(child.cmdline()) for child in children), children
        assert stop_child(proc) == 0
        assert wait_until(lambda: not any(c.is_running() and c.status() != psutil.STATUS_ZOMBIE for c in children),
                          timeout=10), "the router outlived traceproxy sim"
    finally:
        stop_child(proc)
        for child in children:  # only if traceproxy sim failed to stop what it started
            if child.is_running() and child.status() != psutil.STATUS_ZOMBIE:
                child.kill()


def needs_a_router() -> None:
    if default_router() is None:
        pytest.skip(f"no router is installed ({', '.join(ROUTER_NAMES)})")


def test_faults_are_armed_only_after_the_routers_warm_up(loop_thread):
    needs_a_router()
    # prefill_stall held the warm-up /generate, so the deployment never started;
    # pinned_request would have leaked the warm-up's slot into the gauge.
    deployment = SimDeployment(router=True, faults=["prefill_stall", "pinned_request"], startup_timeout=15)
    loop_thread.run(deployment.start(), timeout=30)
    try:
        assert set(deployment.prefill.faults) == {"prefill_stall", "pinned_request"}
        assert gauge(deployment.prefill, "sglang:num_prefill_inflight_queue_reqs") == 0
        client = RawClient(int(deployment.router_url.rsplit(":", 1)[1]))
        client.request("POST", "/generate", JSON, generate_body())
        assert wait_until(lambda: gauge(deployment.prefill, "sglang:num_running_reqs") == 1, timeout=5)
        assert read_for(client, 0.5) == b"", "the fault must hold the first request after the start"
        client.close()
    finally:
        loop_thread.run(deployment.stop(), timeout=30)


def test_a_sim_whose_router_is_never_ready_says_why_in_one_line():
    pytest.importorskip("sglang_router", exc_type=ImportError)
    # An API key the warm-up does not carry: every warm-up gets 401, the router never becomes ready.
    status, out, err = failed_start("--router", "sglang-router", "--startup-timeout", "2", "--log-level", "warning",
                                    "--router-arg=--api-key", "--router-arg=not-sent")
    assert status == 1 and out == ""
    [line] = err.splitlines()
    assert line.startswith("traceproxy sim: cannot start: sglang-router at http://127.0.0.1:")
    assert "not ready within 2 s" in line and "HTTP 401" in line


@pytest.mark.parametrize("flag", ["--prefill-port", "--decode-port", "--bootstrap-port", "--router-port"])
def test_a_port_in_use_is_a_one_line_startup_error(held_port, flag):
    if flag == "--router-port":
        needs_a_router()
    extra = [] if flag == "--router-port" else ["--no-router"]
    status, out, err = failed_start(flag, str(held_port), "--startup-timeout", "10", "--log-level", "warning", *extra)
    assert (status, out) == (2, ""), (status, out, err)
    listener = flag[2:].removesuffix("-port")
    assert err == (f"traceproxy sim: cannot start: the {listener} port {held_port} on 127.0.0.1 is already in use"
                   f" by another process ({flag})\n")


def test_a_worker_on_a_port_in_use_names_its_listen_flag(held_port):
    proc = subprocess.run([sys.executable, "-m", "traceproxy", "sim", "worker", "--role", "decode",
                           "--listen", f"127.0.0.1:{held_port}"], cwd=REPO, capture_output=True, timeout=30)
    assert proc.returncode == 2 and proc.stdout == b""
    assert proc.stderr.decode() == (f"traceproxy sim: cannot start: the decode port {held_port} on 127.0.0.1 is"
                                    " already in use by another process (--listen)\n")


def test_a_router_port_taken_by_another_deployment_is_never_adopted(fast_upstream, loop_thread, monkeypatch):
    needs_a_router()
    other = fast_upstream()  # answers every request with 200, as another deployment's router would
    check = launch.check_port_taken
    checks = []

    def taken_only_after_the_first_check(*args):
        # The port is taken between the check before the router starts and the router's own bind.
        checks.append(args)
        if len(checks) > 1:
            check(*args)

    monkeypatch.setattr(launch, "check_port_taken", taken_only_after_the_first_check)
    deployment = SimDeployment(router=True, router_port=other.port, startup_timeout=15)
    with pytest.raises(ListenerError) as failure:
        loop_thread.run(deployment.start(), timeout=30)
    assert failure.value.listener == "router" and failure.value.taken
    assert str(failure.value) == f"the router port {other.port} on 127.0.0.1 is already in use by another process"
    assert "Address already in use" in failure.value.detail  # the router's own log says the same
    assert deployment.router is None


def test_faulty_proxy_stands_in_front_of_a_given_traceproxy(start_worker, start_proxy):
    # harness -> faulty proxy -> traceproxy -> (here) the decode worker: the harness meets the hang,
    # and the swallowed request never reaches traceproxy.
    decode = start_worker("decode", decode_tokens_per_s=1000)
    done = Done()
    proxy = start_proxy(decode.url, observers=[done], **FAST)
    proc = sim_command("--no-router", "--faulty-proxy-upstream", f"http://127.0.0.1:{proxy.port}",
                       "--hang-after", "1", "--log-level", "warning", stderr=subprocess.PIPE)
    try:
        urls = dict(line.split(" ", 1) for line in read_lines(proc, 4, timeout=20))
        assert list(urls) == ["prefill", "decode", "faulty-proxy", "bootstrap"]
        [placement] = read_lines(proc, 1, timeout=5, stream="stderr")
        assert placement.startswith(f"faulty-proxy {urls['faulty-proxy']} stands in front of the given upstream"
                                    f" http://127.0.0.1:{proxy.port}:")
        client = RawClient(int(urls["faulty-proxy"].rsplit(":", 1)[1]))
        first = client.roundtrip("POST", "/v1/completions", JSON, chat_body(stream=False))
        assert first.status == 200 and first.complete
        assert done.one().outcome.code == "OK" and len(decode.requests) == 1
        send_next(client, "POST", "/v1/completions", JSON, chat_body(stream=False))
        assert read_for(client, 1.0) == b"", "turn 2 on the reused connection must hang"
        assert len(done.records) == 1 and len(decode.requests) == 1
        assert json.loads(http_get(f"http://127.0.0.1:{proxy.admin_port}/debug/inflight"))["requests"] == []
        client.close()
        assert stop_child(proc) == 0
    finally:
        stop_child(proc)


# ----------------------------------------------------------------------------------
# 2. traceproxy -> each real router (PD) -> the simulated workers
# ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def span_receiver():
    with OtlpGrpcReceiver() as receiver:  # SGLang exports over gRPC unless told otherwise
        yield receiver


@pytest.fixture(scope="module", params=ROUTERS_UNDER_TEST)
def sim(request, loop_thread: LoopThread, span_receiver):
    with RouterHarness(loop_thread, request.param, faulty_proxy=True, hang_after=1,
                       otlp_endpoint=f"127.0.0.1:{span_receiver.port}") as harness:
        yield harness


@pytest.fixture
def pd(sim):
    """The module's deployment with no faults, nothing held and empty records."""
    yield from reset_around_the_test(sim)


@pytest.fixture
def traced(pd, start_proxy):
    """traceproxy in front of the router, with an observer of finished requests."""
    done = Done()
    return start_proxy(pd.router_url, observers=[done], **FAST), done


def test_healthy_streaming_chat_completes_and_the_trace_reaches_both_workers(pd, traced, caplog):
    caplog.set_level("INFO", logger="traceproxy.sim")
    proxy, done = traced
    resp = RawClient(proxy.port).roundtrip("POST", "/v1/chat/completions", JSON, chat_body(max_tokens=5))
    assert resp.status == 200 and resp.complete
    events = sse_events(resp.body)
    assert events[-1] == "[DONE]"
    final = json.loads(events[-2])
    assert final["choices"][0]["finish_reason"] == "length"
    prompt = prompt_tokens("/v1/chat/completions", json.loads(chat_body(max_tokens=5)))
    assert prompt > 0
    assert final["usage"] == {"prompt_tokens": prompt, "completion_tokens": 5, "total_tokens": prompt + 5}
    assert token_events(resp.body) == 5
    assert done.one().outcome.code == "OK"

    trace_id = resp.headers["traceresponse"].split("-")[1]
    [pre], [dec] = pd.prefill.requests, pd.decode.requests
    # The trace id joins the client's view and both engines' records, behind every router.
    assert pre.trace_id == dec.trace_id == trace_id
    assert pre.request_id == dec.request_id
    assert (pre.request_id == resp.headers["x-request-id"]) is pd.behaviour.engines_get_client_request_id
    assert pre.room is not None and pre.room == dec.room  # paired, whichever PD protocol
    for role in ("prefill", "decode"):
        assert any(r.name == f"traceproxy.sim.{role}" and f"trace_id={trace_id}" in r.getMessage()
                   and f"x-request-id={pre.request_id}" in r.getMessage() for r in caplog.records), role


def test_workers_export_sglangs_spans_under_the_incoming_traceparent(pd, traced, span_receiver):
    proxy, _ = traced
    resp = RawClient(proxy.port).roundtrip("POST", "/generate", JSON, generate_body())
    assert resp.status == 200
    [pre], [dec] = pd.prefill.requests, pd.decode.requests
    _, trace_id, parent_id, _ = pre.headers["traceparent"].split("-")
    assert dec.headers["traceparent"] == pre.headers["traceparent"]

    def spans():
        return span_receiver.find(trace_id=trace_id)

    # Each worker's request ends with its Bootstrap Room span (vLLM's prefill: once decode took its KV cache).
    assert wait_until(lambda: len([s for s in spans() if s.name.startswith("Bootstrap Room")]) == 2, timeout=10)
    for role, seen in (("prefill", pre), ("decode", dec)):
        [room] = [s for s in spans() if s.name == f"Bootstrap Room {hex(seen.room)}" and
                  any(c.parent_span_id == s.span_id and c.name.startswith(f"{role} Req") for c in spans())]
        # The router forwarded the proxy's traceparent: the worker's spans hang under its CLIENT span.
        assert room.parent_span_id == parent_id and room.attributes == {"bootstrap_room": hex(seen.room)}
        assert room.resource["service.name"] == "sglang" and room.scope_name == "sglang server"
        [req] = [s for s in spans() if s.parent_span_id == room.span_id]
        assert req.name == f"{role} Req {seen.rid[:8]}" and req.attributes == {"rid": seen.rid}
        [thread] = [s for s in spans() if s.parent_span_id == req.span_id]
        assert thread.name.startswith(f"{role.title()} Scheduler [TP 0] (host:")
        stages = [s.name for s in sorted(spans(), key=lambda s: s.span.start_time_unix_nano)
                  if s.parent_span_id == thread.span_id]
        assert stages == list(STAGE_ORDER[role]), (pd.name, role, stages)


def test_every_call_each_router_makes_to_the_workers_is_answered(pd, traced):
    # Registration, health and load calls (smg polls /loads and /v1/loads), and what
    # vllm-router asks before each request (/v1/*/render, /tokenize): none is a 404.
    proxy, _ = traced
    for body in (chat_body(stream=False), chat_body(stream=True)):
        assert RawClient(proxy.port).roundtrip("POST", "/v1/chat/completions", JSON, body).status == 200
    assert RawClient(proxy.port).roundtrip("POST", "/v1/completions", JSON, completion_body()).status == 200
    calls = pd.deployment.startup_calls + pd.prefill.calls + pd.decode.calls
    assert calls and [c for c in calls if c.status >= 400] == []
    paths = {c.path.partition("?")[0] for c in calls}
    if pd.name == "smg":
        assert "/loads" in paths or "/v1/loads" in paths, sorted(paths)
    if pd.name == "vllm-router":
        assert {"/v1/chat/completions/render", "/v1/completions/render"} <= paths, sorted(paths)


def test_prefill_stall_is_a_first_byte_stall_blamed_on_the_engine(pd, traced):
    proxy, done = traced
    pd.prefill.set_faults(["prefill_stall"])
    client = RawClient(proxy.port)
    client.request("POST", "/v1/chat/completions", JSON, chat_body())
    entry = inflight_entry(proxy, "FBS")
    # Every router answers its client only once prefill has answered: no headers at all.
    assert entry["verdict"]["blame"] == "engine" and entry["phase"] == "awaiting_upstream_headers"
    # Meanwhile, in the engines: prefill is running; decode waits for the KV cache, or
    # (vLLM's protocol: decode only after prefill) has not been called.
    assert gauge(pd.prefill, "sglang:num_running_reqs") == 1
    if pd.kind.decode_waits_for_prefill:
        assert pd.decode.requests == []
    else:
        assert gauge(pd.decode, "sglang:num_decode_transfer_queue_reqs") == 1
    client.close()
    # Every router drops its engine requests once its own client (traceproxy) is gone.
    assert wait_until(lambda: gauge(pd.prefill, "sglang:num_running_reqs") == 0
                      and gauge(pd.decode, "sglang:num_decode_transfer_queue_reqs") == 0, timeout=5)
    record = done.one()
    assert record.outcome.code == "DC" and [s.code for s in record.stalls] == ["FBS"]


def test_decode_stall_is_a_mid_stream_stall_blamed_on_the_engine(pd, traced):
    proxy, done = traced
    pd.decode.set_faults(["decode_stall:3"])
    client = RawClient(proxy.port)
    client.request("POST", "/v1/chat/completions", JSON, chat_body(max_tokens=8))
    entry = inflight_entry(proxy, "MSS")
    assert entry["verdict"]["blame"] == "engine" and entry["phase"] == "streaming_response"
    got = read_for(client, 0.3)
    assert token_events(got) == 3 and b"[DONE]" not in got
    [dec] = pd.decode.requests
    assert dec.faults == ("decode_stall:3",)
    assert gauge(pd.decode, "sglang:num_running_reqs") == 1
    client.close()
    assert [s.code for s in done.one().stalls] == ["MSS"]
    if pd.behaviour.cancels_silent_decode:
        # vllm-router drops the decode request as soon as its client has gone.
        assert wait_until(lambda: gauge(pd.decode, "sglang:num_running_reqs") == 0, timeout=2)
    else:
        # sglang-router and smg do not cancel a *silent* decode stream when their client
        # leaves (they would notice on the next chunk); only their request timeout ends it.
        time.sleep(0.3)
        assert gauge(pd.decode, "sglang:num_running_reqs") == 1


def test_reset_mid_stream_reaches_the_client_as_each_router_passes_it_on(pd, traced):
    proxy, done = traced
    pd.decode.set_faults(["reset_mid_stream:3"])
    resp = RawClient(proxy.port).roundtrip("POST", "/v1/chat/completions", JSON, chat_body(max_tokens=8))
    assert resp.status == 200 and b'"finish_reason":"' not in resp.body
    # An RST may discard the last token in the router's receive buffer before it was read.
    assert 1 <= token_events(resp.body) <= 3
    record = done.one()
    if pd.behaviour.reports_stream_errors_in_band:
        # smg turns the engine's reset into an in-band error event and ends its stream
        # cleanly; what traceproxy must make of that is
        # test_routers.py::test_smg_in_band_stream_error_is_an_engine_failure.
        assert resp.complete
        *_, error, last = sse_events(resp.body)
        assert last == "[DONE]" and json.loads(error)["error"]["type"] == "stream_error"
        assert "Connection reset by peer" in json.loads(error)["error"]["message"]
    else:
        # sglang-router and vllm-router stream decode's body through; when decode's
        # connection is reset mid-body they cannot finish their own chunked response
        # and close the connection to traceproxy without the last chunk: UC.
        assert not resp.complete and b"[DONE]" not in resp.body
        assert record.outcome.code == "UC" and record.outcome.blame.value == "engine"


def test_malformed_sse_line_passes_through_the_router_and_is_ndn(pd, traced):
    proxy, done = traced
    pd.decode.set_faults(["malformed_sse"])
    resp = RawClient(proxy.port).roundtrip("POST", "/v1/chat/completions", JSON, chat_body())
    # No router parses decode's SSE: the truncated JSON event and the clean end without
    # [DONE] reach the client as they were sent.
    assert resp.status == 200 and resp.complete
    events = sse_events(resp.body)
    assert len(events) == 2 and json.loads(events[0])["choices"][0]["delta"]["content"]
    with pytest.raises(ValueError):
        json.loads(events[1])
    record = done.one()
    assert record.outcome.code == "NDN" and record.outcome.blame.value == "engine"


def test_malformed_chunk_is_cut_or_reported_in_band_by_the_router(pd, traced):
    proxy, done = traced
    pd.decode.set_faults(["malformed_sse:chunk"])
    resp = RawClient(proxy.port).roundtrip("POST", "/v1/chat/completions", JSON, chat_body())
    assert resp.status == 200 and b'"finish_reason":"' not in resp.body
    record = done.one()
    if pd.behaviour.reports_stream_errors_in_band:
        # As with a reset: an in-band error event, then [DONE] and a clean end.
        assert resp.complete
        *_, error, last = sse_events(resp.body)
        assert last == "[DONE]" and "Invalid chunk size line" in json.loads(error)["error"]["message"]
    else:
        # The router's HTTP client rejects the invalid chunk size and the router ends its
        # own response abruptly (headers sent, body cut): UC, not UPE, because the
        # framing traceproxy saw (the router's) was valid up to the cut.
        assert not resp.complete and b"[DONE]" not in resp.body
        assert record.outcome.code == "UC" and record.outcome.blame.value == "engine"


def test_no_done_is_a_stream_without_done(pd, traced):
    proxy, done = traced
    pd.decode.set_faults(["no_done"])
    resp = RawClient(proxy.port).roundtrip("POST", "/v1/chat/completions", JSON, chat_body(max_tokens=4))
    assert resp.status == 200 and resp.complete
    assert token_events(resp.body) == 4 and b"[DONE]" not in resp.body and b'"finish_reason":"' not in resp.body
    record = done.one()
    assert record.outcome.code == "NDN" and record.outcome.blame.value == "engine"


def test_slow_first_token_is_a_stall_that_resolves(pd, traced):
    proxy, done = traced
    pd.decode.set_faults(["slow_first_token:1200"])
    resp = RawClient(proxy.port).roundtrip("POST", "/v1/chat/completions", JSON, chat_body(max_tokens=3))
    assert resp.status == 200 and resp.complete and sse_events(resp.body)[-1] == "[DONE]"
    record = done.one()
    assert record.outcome.code == "OK"
    [stall] = record.stalls
    # Every router sends the headers once prefill answered and decode opened its stream;
    # the wait is for the first token.
    assert stall.code == "FBS" and stall.phase == "streaming_response" and stall.resolved_ns is not None


def test_pinned_request_leaves_the_inflight_gauge_at_one(pd, traced):
    proxy, _ = traced
    assert gauge(pd.prefill, "sglang:num_prefill_inflight_queue_reqs") == 0
    pd.prefill.set_faults(["pinned_request"])
    resp = RawClient(proxy.port).roundtrip("POST", "/v1/chat/completions", JSON, chat_body())
    assert resp.status == 200 and resp.complete and sse_events(resp.body)[-1] == "[DONE]"
    pd.prefill.set_faults([])
    assert RawClient(proxy.port).roundtrip("POST", "/generate", JSON, generate_body()).status == 200
    time.sleep(0.3)
    assert gauge(pd.prefill, "sglang:num_prefill_inflight_queue_reqs") == 1
    assert gauge(pd.prefill, "sglang:num_running_reqs") == 0


def test_an_engine_closing_idle_connections_costs_the_router_a_fresh_one_not_a_request(pd, traced):
    proxy, done = traced
    for worker in (pd.prefill, pd.decode):
        worker.set_faults(["idle_close:0.2"])
    client = RawClient(proxy.port)
    first = client.roundtrip("POST", "/v1/chat/completions", JSON, chat_body(stream=False))
    # Both engines close the router's connections once idle 0.2 s (as uvicorn does after 5 s)...
    assert wait_until(lambda: pd.prefill.idle_closes >= 1 and pd.decode.idle_closes >= 1, timeout=5)
    send_next(client, "POST", "/v1/chat/completions", JSON, chat_body(stream=False))
    second = client.response()
    # ... and the router notices: the next turn goes on new connections, and succeeds.
    assert first.status == second.status == 200 and second.complete
    assert wait_until(lambda: len(done.records) == 2, timeout=5)
    assert [r.outcome.code for r in done.records] == ["OK", "OK"]
    for worker in (pd.prefill, pd.decode):
        first_peer, second_peer = (seen.peer for seen in worker.requests)
        assert first_peer != second_peer, worker.role


def test_request_faults_through_the_router_only_survive_in_the_body(pd, traced):
    proxy, done = traced
    # Every router forwards an allow-list of headers: x-sim-fault never reaches decode.
    resp = RawClient(proxy.port).roundtrip("POST", "/v1/chat/completions", [*JSON, ("x-sim-fault", "no_done")],
                                           chat_body())
    assert resp.complete and sse_events(resp.body)[-1] == "[DONE]"
    [dec] = pd.decode.requests
    assert "x-sim-fault" not in dec.headers and dec.faults == ()
    assert done.one().outcome.code == "OK"
    # Chat's metadata map and the completion's sim_fault field are kept by every router.
    for path, body in (("/v1/chat/completions", chat_body(metadata={"sim_fault": "no_done"})),
                       ("/v1/completions", completion_body(sim_fault="no_done"))):
        done.records.clear()
        resp = RawClient(proxy.port).roundtrip("POST", path, JSON, body)
        assert resp.complete and b"[DONE]" not in resp.body, path
        assert done.one().outcome.code == "NDN", path


def test_faulty_proxy_hangs_a_reused_connection_and_serves_a_fresh_one(pd):
    port = int(pd.deployment.faulty_proxy_url.rsplit(":", 1)[1])
    client = RawClient(port)
    first = client.roundtrip("POST", "/v1/chat/completions", JSON, chat_body())
    assert first.status == 200 and first.complete and sse_events(first.body)[-1] == "[DONE]"
    send_next(client, "POST", "/v1/chat/completions", JSON, chat_body())
    assert read_for(client, 1.0) == b"", "turn 2 on the reused connection must hang"
    assert not client.is_closed_by_peer(wait=0.2)  # ... with the socket left open
    fresh = RawClient(port).roundtrip("POST", "/v1/chat/completions", JSON, chat_body())
    assert fresh.status == 200 and fresh.complete
    client.close()


def test_traceproxy_blames_the_faulty_proxys_hang_as_a_first_byte_stall(pd, start_proxy):
    done = Done()
    proxy = start_proxy(pd.deployment.faulty_proxy_url, observers=[done], **FAST)
    client = RawClient(proxy.port)
    assert client.roundtrip("POST", "/v1/chat/completions", JSON, chat_body()).complete
    send_next(client, "POST", "/v1/chat/completions", JSON, chat_body())  # reuses the pooled upstream connection
    entry = inflight_entry(proxy, "FBS")
    assert entry["verdict"]["blame"] == "engine" and entry["phase"] == "awaiting_upstream_headers"
    client.close()


@pytest.mark.parametrize("argv, message", [
    (["--no-router", "--faulty-proxy", "--hang-after", "0"], "--hang-after must be at least 1 turn"),
    (["--no-router", "--hang-after", "3-1"], "LOW <= HIGH"),
    (["--no-router", "--hang-after", "x"], "--hang-after takes N or LOW-HIGH"),
    (["--no-router", "--decode-tps", "0"], "--decode-tps must be a number of tokens per second above 0"),
    (["worker", "--role", "decode", "--listen", "127.0.0.1:abc"], "expected a port from 0 to 65535"),
    (["worker", "--role", "prefill", "--listen", "a b:0"], "expected a host name or IP address"),
    (["worker", "--role", "prefill", "--bootstrap-port", "99999"], "expected a port from 0 to 65535"),
    (["--no-router", "--prefill-port", "99999"], "expected a port from 0 to 65535"),
    (["--no-router", "--decode-port", "-1"], "expected a port from 0 to 65535"),
    (["--router-port", "70000"], "expected a port from 0 to 65535"),
    (["--no-router", "--host", "a b"], "expected a host name or IP address"),
    # an empty label: the resolver would refuse it only when binding, as an encoding error
    (["--no-router", "--host", "127.0.0..1"], "expected a host name or IP address"),
    (["--no-router", "--startup-timeout", "0"], "expected a number of seconds above 0"),
    (["--router-log-level", "warn"], "argument --router-log-level: invalid choice: 'warn'"),
    (["--no-router", "--startup-timeout", "nan"], "expected a number of seconds above 0"),
    (["--no-router", "--faulty-proxy-upstream", "127.0.0.1:8000"], "expected http://HOST:PORT (no path)"),
    (["--no-router", "--faulty-proxy-upstream", "https://127.0.0.1:8000"], "expected http://HOST:PORT (no path)"),
    (["--no-router", "--faulty-proxy-upstream", "http://127.0.0.1:8000/v1"], "expected http://HOST:PORT (no path)"),
    (["--no-router", "--faulty-proxy-upstream", "http://127.0.0.1:99999"], "expected http://HOST:PORT (no path)"),
])
def test_bad_sim_arguments_are_one_line_errors_with_exit_2(capsys, argv, message):
    assert _exit_status(["sim", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize("argv, message", [
    (["--listen", "127.0.0.1:99999"], "port 99999 is out of range"),
    (["--listen", "127.0.0.1"], "missing port"),
    (["--listen", "127.0.0.1:abc"], "expected HOST:PORT"),
    (["--listen", "a b:0"], "expected HOST:PORT"),
    (["--idle-close-after", "nan"], "expected a number of seconds, at least 0.001 s, or 0 for never"),
    (["--idle-close-after", "-1"], "expected a number of seconds, at least 0.001 s, or 0 for never"),
])
def test_bad_test_upstream_arguments_are_usage_errors(capsys, argv, message):
    assert _exit_status(["upstream", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def _exit_status(argv: list[str]) -> int:
    """The command's exit status, whether it returned it or argparse exited with it."""
    try:
        return cli_main(argv)
    except SystemExit as exc:
        return exc.code


def test_a_faulty_proxy_stopped_mid_response_ends_its_connections_without_a_traceback(start_worker, loop_thread,
                                                                                       caplog):
    # Stopping aborts the clients' transports while a response is being relayed: the
    # relay's next write meets a closed transport, which must end that connection
    # quietly (the demo's Ctrl-C printed a traceback from here).
    decode = start_worker("decode", decode_tokens_per_s=20)
    proxy = loop_thread.run(FaultyProxy(decode.url, hang_after=(5, 5), seed=1).start())
    client = RawClient(proxy.port, timeout=5)
    try:
        client.request("POST", "/v1/completions", JSON, chat_body(stream=True, max_tokens=40))
        recv_until(client.sock, b"data:")  # the response is streaming through the proxy
        with caplog.at_level(logging.ERROR, logger="asyncio"):
            loop_thread.run(proxy.stop())
            time.sleep(0.3)  # the relay's next token write comes within 50 ms
        assert not [r for r in caplog.records if r.name == "asyncio"], caplog.text
    finally:
        client.sock.close()
