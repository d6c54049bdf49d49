"""Which PD stage and component hold a request, from its workers' stages or the gauges (pure)."""

from __future__ import annotations

import pytest

from traceproxy.lifecycle.pd_stages import (
    COMPONENT_OF, STAGE_ORDER, EngineStage, Worker, WorkerProgress, from_gauges, gauge_sentence, holding,
    not_opened, role_of_stage, role_of_thread, stage_in,
)

PREFILL_DONE = STAGE_ORDER["prefill"]
DECODE_ORDER = STAGE_ORDER["decode"]
W_PRE, W_DEC = Worker("sglang", "aaaa1111", 11), Worker("sglang", "bbbb2222", 22)


def prefill(*ended, finished=False, at=100):
    return WorkerProgress("prefill", tuple(ended), at, finished, W_PRE)


def decode(*ended, finished=False, at=100, nested=""):
    return WorkerProgress("decode", tuple(ended), at, finished, W_DEC, nested)


def test_the_stage_a_worker_is_in_is_the_one_after_the_last_that_ended():
    assert stage_in("prefill", []) == "prefill_prepare"
    assert stage_in("prefill", ["prefill_prepare", "prefill_bootstrap"]) == "prefill_waiting"
    assert stage_in("decode", ["decode_prepare", "decode_bootstrap"]) == "decode_transferred"
    assert stage_in("decode", ["decode_bootstrap", "decode_prepare"]) == "decode_transferred"  # any arrival order
    assert stage_in("prefill", PREFILL_DONE) is None


# The faults of the simulated workers (traceproxy.sim.faults), each as its spans leave it:
# (prefill's stages that ended or None when it finished, decode's) -> component, role, stage.
HUNG = [
    pytest.param(PREFILL_DONE[:1], DECODE_ORDER[:1], ("bootstrap", "prefill", "prefill_bootstrap"),
                 id="bootstrap_stall"),
    pytest.param(PREFILL_DONE[:3], DECODE_ORDER[:2], ("prefill", "prefill", "prefill_forward"), id="prefill_stall"),
    pytest.param(PREFILL_DONE[:4], DECODE_ORDER[:2], ("kv_transfer", "prefill", "prefill_transfer_kv_cache"),
                 id="kv_transfer_stall"),
    pytest.param(None, DECODE_ORDER[:2], ("kv_transfer", "decode", "decode_transferred"), id="decode_waiting_stall"),
    pytest.param(None, DECODE_ORDER[:4], ("decode", "decode", "decode_forward"), id="decode_stall"),
]


@pytest.mark.parametrize("prefill_ended, decode_ended, expected", HUNG)
def test_the_worker_least_far_along_holds_a_pd_request(prefill_ended, decode_ended, expected):
    pre = prefill(*PREFILL_DONE, finished=True, at=50) if prefill_ended is None else prefill(*prefill_ended, at=50)
    held = holding([decode(*decode_ended, at=70), pre])
    assert (held.component, held.role, held.stage, held.state) == (*expected, "in")
    assert held.worker == (W_PRE if expected[1] == "prefill" else W_DEC)
    assert held.since_ns == (50 if expected[1] == "prefill" else 70) and held.source == "spans"


def test_a_forward_stage_says_how_far_it_got():
    held = holding([decode(*DECODE_ORDER[:4], nested="decode_loop")])
    assert (held.stage, held.detail) == ("decode_forward", "after decode_loop")


def test_when_every_worker_finished_the_stage_is_the_last_that_ended():
    held = holding([prefill(*PREFILL_DONE, finished=True, at=10), decode(*DECODE_ORDER, finished=True, at=20)])
    assert (held.component, held.role, held.stage, held.state) == ("decode", "decode", "decode_forward", "ended")
    assert holding([]) is None


def test_a_request_no_engine_opened_is_the_routers():
    stage = not_opened(5)
    assert (stage.component, stage.role, stage.stage, stage.since_ns, stage.source) == ("router", "router", None, 5,
                                                                                         "spans")
    assert stage.words() == "router (no engine has opened it; from spans)"
    assert from_gauges({"prefill": {}}, 1, False).words() == "router (prefill 0, router 1 running; from gauges)"


def test_every_stage_has_a_component_and_roles_are_read_from_names():
    assert {COMPONENT_OF[s] for order in STAGE_ORDER.values() for s in order} <= {
        "prefill", "bootstrap", "kv_transfer", "decode"}
    assert role_of_stage("prefill_transfer_kv_cache") == "prefill"
    assert role_of_stage("decode_transferred") == "decode"
    assert role_of_stage("prefill_forward") is None  # unified workers have it too
    assert role_of_stage("request_process") == "unified"
    assert role_of_thread("Prefill Scheduler") == "prefill" and role_of_thread("Scheduler") == "unified"
    assert role_of_thread("Detokenizer") is None


def test_as_dict_and_words():
    stage = EngineStage("kv_transfer", "prefill", "prefill_transfer_kv_cache", "in", 1_000_000_000, W_PRE, "spans")
    assert stage.as_dict(3_500_000_000) == {
        "component": "kv_transfer", "role": "prefill", "stage": "prefill_transfer_kv_cache", "state": "in",
        "worker": {"service": "sglang", "host": "aaaa1111", "pid": 11}, "since_s": 2.5, "source": "spans"}
    assert stage.words() == "kv_transfer (prefill prefill_transfer_kv_cache, sglang host aaaa1111 pid 11; from spans)"


# Gauges summed per role -> the component and stage they point at, and the sentence.
GAUGES = [
    pytest.param({"prefill": {"prefill_inflight": 1}, "decode": {"decode_transfer": 1}}, 1, False,
                 ("kv_transfer", "prefill", "prefill_transfer_kv_cache"),
                 "prefill holds 1 in its KV-transfer queue, decode holds 1 in its KV-transfer queue, router 1 running",
                 id="kv_transfer_stall"),
    pytest.param({"prefill": {"running": 1}, "decode": {"decode_transfer": 1}}, None, False,
                 ("prefill", "prefill", "prefill_forward"),
                 "prefill 1 running, decode holds 1 in its KV-transfer queue", id="prefill_stall"),
    pytest.param({"prefill": {"prefill_prealloc": 1}, "decode": {"decode_prealloc": 1}}, None, False,
                 ("bootstrap", "prefill", "prefill_bootstrap"),
                 "prefill holds 1 in its bootstrap queue, decode holds 1 in its bootstrap queue", id="bootstrap_stall"),
    pytest.param({"prefill": {}, "decode": {"decode_transfer": 1}}, None, False,
                 ("kv_transfer", "decode", "decode_transferred"),
                 "prefill 0, decode holds 1 in its KV-transfer queue", id="decode_waiting_stall"),
    pytest.param({"prefill": {"running": 2}, "decode": {"running": 1}}, None, True,
                 ("decode", "decode", "decode_forward"), "prefill 2 running, decode 1 running",
                 id="streaming-only-decode"),
    pytest.param({"prefill": {}, "decode": {}}, 1, False, ("router", "router", None),
                 "prefill 0, decode 0, router 1 running", id="only-the-router"),
]


@pytest.mark.parametrize("by_role, router, streaming, expected, sentence", GAUGES)
def test_gauges_by_role_name_a_component(by_role, router, streaming, expected, sentence):
    stage = from_gauges(by_role, router, streaming)
    assert (stage.component, stage.role, stage.stage, stage.source) == (*expected, "gauges")
    assert stage.detail == sentence and stage.worker is None and stage.since_ns is None


def test_gauges_with_nothing_anywhere_name_nothing():
    assert from_gauges({"prefill": {}, "decode": {}}, 0, False) is None
    assert from_gauges({"prefill": {"running": 1}}, None, True) is None  # streaming: prefill cannot hold it
    assert gauge_sentence({"prefill": {}, "decode": {}}, 0) == "prefill 0, decode 0, router 0 running"
