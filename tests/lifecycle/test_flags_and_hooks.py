"""The outcome vocabulary and the observer fanout."""

from __future__ import annotations

from pathlib import Path

from traceproxy.lifecycle.flags import BY_CODE, Blame, Flag, outcomes_markdown
from traceproxy.lifecycle.hooks import Fanout
from traceproxy.lifecycle.marks import Mark
from traceproxy.lifecycle.timeline import ClientConnectionRecord, RequestRecord

DOCS = Path(__file__).resolve().parents[2] / "docs" / "outcomes.md"
BLAME_WORDS = {"client", "proxy", "engine", "unknown"}


def test_codes_are_unique_and_blame_uses_the_four_words():
    assert len(BY_CODE) == len(Flag.ALL)
    for outcome in Flag.ALL:
        if outcome.is_ok:
            assert outcome.blame is Blame.NONE
        else:
            assert outcome.blame.value in BLAME_WORDS, outcome.code
            assert outcome.meaning.endswith(".")


def test_envoy_codes_keep_envoy_meanings():
    assert Flag.UF.blame is Blame.ENGINE and Flag.UT.local_status == 504
    assert Flag.DC.blame is Blame.CLIENT and Flag.DPE.local_status == 400


def test_docs_outcome_table_is_generated_from_the_code():
    assert DOCS.read_text() == outcomes_markdown()


class _Raises:
    def on_request_start(self, record): raise RuntimeError("boom")
    def on_mark(self, record, mark): raise RuntimeError("boom")
    def on_done(self, record): raise RuntimeError("boom")


class _Counts:
    def __init__(self): self.calls = []
    def on_request_start(self, record): self.calls.append("start")
    def on_mark(self, record, mark): self.calls.append(mark.label)
    def on_done(self, record): self.calls.append("done")


def test_an_observer_that_raises_is_counted_and_the_others_still_run():
    counts = _Counts()
    fanout = Fanout([_Raises(), counts])
    record = RequestRecord(connection=ClientConnectionRecord(peer="p", opened_ns=0), sequence=1, idle_gap_ns=None)
    fanout.request_start(record)
    fanout.mark(record, Mark.FIRST_DOWNSTREAM_RX_BYTE)
    fanout.done(record)
    assert counts.calls == ["start", "first_downstream_rx_byte", "done"]
    assert fanout.observer_errors == 3
