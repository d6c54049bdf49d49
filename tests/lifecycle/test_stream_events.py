"""Event-stream transcripts: response body bytes in, each event's kind and what the
stream held out. No event loop, no clock."""

from __future__ import annotations

import json

import pytest

from traceproxy.lifecycle.stream_events import DONE, ERROR, HEARTBEAT, KIND_NAMES, OUTPUT, EventScanner

O, H, D, E = OUTPUT, HEARTBEAT, DONE, ERROR
_ID = '"id":"0b7c6f1e2d3a4b5c","object":"chat.completion.chunk","created":1718000000,"model":"llama-8b"'


def chat(delta: str, finish: str = "null", usage: str = "null") -> bytes:
    """An SGLang chat chunk as pydantic writes it: compact, every optional field present."""
    return (f'data: {{{_ID},"choices":[{{"index":0,"delta":{delta},"logprobs":null,"finish_reason":{finish},'
            f'"matched_stop":null}}],"usage":{usage}}}\n\n').encode()


def content(text: str) -> bytes:
    return chat('{"role":null,"content":%s,"reasoning_content":null,"tool_calls":null}' % json.dumps(text))


def spaced(doc: dict) -> bytes:
    """An event as json.dumps writes it by default (LiteLLM, the fast sim): ": " and ", "."""
    return b"data: " + json.dumps(doc).encode() + b"\n\n"


def generate(text: str, ids: list[int] | None, completion: int | None, finish: str = "null") -> bytes:
    meta = '"id":"r1","finish_reason":%s,"prompt_tokens":9' % finish
    if completion is not None:
        meta += ',"completion_tokens":%d' % completion
    ids_field = "" if ids is None else ',"output_ids":%s' % json.dumps(ids).replace(" ", "")
    return ('data: {"text":%s%s,"meta_info":{%s,"cached_tokens":0}}\n\n' % (json.dumps(text), ids_field, meta)).encode()


USAGE = '{"prompt_tokens":9,"total_tokens":21,"completion_tokens":12,"prompt_tokens_details":null}'
TOOL_FIRST = ('{"tool_calls":[{"index":0,"id":"call_1","type":"function",'
              '"function":{"name":"get_weather","arguments":""}}]}')
TOOL_ARGS = '{"tool_calls":[{"index":0,"function":{"arguments":"{\\"city\\": \\"Pa"}}]}'
TOOL_EMPTY = '{"tool_calls":[{"index":0,"id":"call_1","type":"function","function":{"arguments":""}}]}'
# Three tokens: the first is judged in full, the second teaches where the text and
# the finish reason sit, the third and later are judged by feed's own check.
PRIMERS = (content("Hello"), content(" there"), content("!"))

# (id, event bytes, its kind). Each is judged fresh and after PRIMER (see the test).
EVENTS = [
    ("content-delta", content(" world"), O),
    ("content-with-escaped-quotes", content('"quoted"'), O),
    ("content-that-reads-like-an-empty-content-key", content('say "content":"" ok'), O),
    ("content-spaced-json", spaced({"choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": None}]}), O),
    ("content-empty", content(""), H),
    ("content-null", chat('{"role":null,"content":null,"reasoning_content":null,"tool_calls":null}'), H),
    ("role-only-delta", chat('{"role":"assistant"}'), H),
    ("role-and-empty-content", chat('{"role":"assistant","content":""}'), H),
    ("empty-delta", chat("{}"), H),
    ("empty-delta-spaced", spaced({"choices": [{"index": 0, "delta": {}, "finish_reason": None}]}), H),
    ("reasoning-content", chat('{"role":null,"content":null,"reasoning_content":"Let me think","tool_calls":null}'), O),
    ("reasoning-vllm", chat('{"reasoning":"hmm"}'), O),
    ("tool-call-name-first", chat(TOOL_FIRST), O),
    ("tool-call-arguments", chat(TOOL_ARGS), O),
    ("tool-call-without-name-or-arguments", chat(TOOL_EMPTY), H),
    ("legacy-function-call-name", chat('{"function_call":{"name":"f","arguments":""}}'), O),
    ("refusal", chat('{"refusal":"I cannot help with that"}'), O),
    ("finish-reason-alone", chat("{}", finish='"stop"'), O),
    ("finish-reason-with-the-last-token", chat('{"content":"."}', finish='"stop"'), O),
    ("finish-reason-spaced", spaced({"choices": [{"delta": {}, "finish_reason": "length"}]}), O),
    ("usage-only", f'data: {{{_ID},"choices":[],"usage":{USAGE}}}\n\n'.encode(), H),
    ("second-choice-has-content", b'data: {"choices":[{"index":0,"delta":{"content":""},"finish_reason":null},'
                                  b'{"index":1,"delta":{"content":"B"},"finish_reason":null}]}\n\n', O),
    ("completions-text", b'data: {"object":"text_completion",'
                         b'"choices":[{"index":0,"text":"tok","finish_reason":null}]}\n\n', O),
    ("completions-empty-text", b'data: {"choices":[{"index":0,"text":"","finish_reason":null}]}\n\n', H),
    ("responses-api-text-delta", b'data: {"type":"response.output_text.delta","delta":"Hi"}\n\n', O),
    ("messages-api-tool-input", b'data: {"type":"content_block_delta","delta":{"type":"input_json_delta",'
                                b'"partial_json":"{\\"a"}}\n\n', O),
    ("comment-ping", b": ping\n\n", H),
    ("comment-keepalive", b":keepalive\n\n", H),
    ("comment-empty", b":\n\n", H),
    ("blank-data", b"data: \n\n", H),
    ("blank-data-no-space", b"data:\n\n", H),
    ("empty-object", b"data: {}\n\n", H),
    ("event-ping", b"event: ping\n\n", H),
    ("event-ping-with-data", b'event: ping\ndata: {"type":"ping"}\n\n', H),
    ("id-alone", b"id: 7\n\n", H),
    ("retry-alone", b"retry: 3000\n\n", H),
    ("done", b"data: [DONE]\n\n", D),
    ("smg-stream-error", b'data: {"error":{"message":"Stream error: upstream closed","type":"stream_error"}}\n\n', E),
    ("openai-error-spaced", spaced({"error": {"object": "error", "message": "bad", "type": "BadRequestError"}}), E),
    ("error-object-top-level", b'data: {"object":"error","message":"overloaded","code":503}\n\n', E),
    ("error-string", b'data: {"error":"boom"}\n\n', E),
    ("event-named-error", b"event: error\ndata: upstream failed\n\n", E),
    ("nested-error-is-not-an-error", chat('{}').replace(b'"logprobs":null', b'"logprobs":{"error":{"x":1}}'), H),
    ("content-saying-error", content('"error"'), O),
    # Not known to be a heartbeat: judged output (see the module's theory of operation).
    ("not-json", b"data: hello world\n\n", O),
    ("json-array", b"data: [1, 2]\n\n", O),
    ("json-of-unknown-shape", b'data: {"foo":1}\n\n', O),
    ("multi-line-data", b'data: {"choices":[{"delta":\ndata: {"content":"hi"},"finish_reason":null}]}\n\n', O),
    ("multi-line-data-no-output", b'data: {"choices":[{"delta":\ndata: {},"finish_reason":null}]}\n\n', H),
    ("event-and-id-fields", b'event: message\nid: 12\ndata: {"choices":[{"delta":{"content":"x"}}]}\n\n', O),
    ("comment-before-data", b': note\ndata: {"choices":[{"delta":{"content":"x"}}]}\n\n', O),
]


def kinds(scanner: EventScanner, *events: bytes) -> list[str]:
    """The kind of each event, fed one at a time (a mask of several kinds would show as its number)."""
    return [KIND_NAMES.get(mask, str(mask)) for mask in map(scanner.feed, events)]


@pytest.mark.parametrize("primed", [False, True], ids=["fresh", "after-three-tokens"])
@pytest.mark.parametrize("event,kind", [c[1:] for c in EVENTS], ids=[c[0] for c in EVENTS])
def test_each_event_is_judged(event, kind, primed):
    scanner = EventScanner()
    if primed:
        assert kinds(scanner, *PRIMERS) == ["output"] * 3
    assert kinds(scanner, event) == [KIND_NAMES[kind]]
    # The same event again: judged the same (the inline judgement learns from the first).
    assert kinds(scanner, event) == [KIND_NAMES[kind]]


# SGLang /generate: each event repeats the whole text; new output is new text, new
# token ids or a higher completion_tokens.
GENERATE = [
    ("tokens-counted", [generate("Hi", [1], 1), generate("Hi there", [1, 2], 2)], [O, O]),
    ("count-rises-without-ids", [generate("Hi", None, 1), generate("Hi there", None, 2)], [O, O]),
    ("repeated-event", [generate("Hi", None, 1), generate("Hi", None, 1)], [O, H]),
    ("empty-ids-same-count", [generate("Hi", [1], 1), generate("Hi", [], 1)], [O, H]),
    ("text-grows-without-a-count", [generate("Hi", None, None), generate("Hi there", None, None)], [O, O]),
    ("same-text-without-a-count", [generate("Hi", None, None), generate("Hi", None, None)], [O, H]),
    ("empty-text-without-a-count", [generate("", None, None)], [H]),
    ("finish-with-nothing-new", [generate("Hi", None, 1), generate("Hi", None, 1, '{"type":"length","length":1}')],
     [O, O]),
    ("token-ids-field", [b'data: {"token_ids":[5],"meta_info":{"completion_tokens":0}}\n\n'], [O]),
    ("error-in-a-generate-stream", [generate("Hi", [1], 1), b'data: {"error":{"message":"aborted"}}\n\n'], [O, E]),
]


@pytest.mark.parametrize("events,expected", [c[1:] for c in GENERATE], ids=[c[0] for c in GENERATE])
def test_generate_events(events, expected):
    assert kinds(EventScanner(), *events) == [KIND_NAMES[k] for k in expected]


def sample_stream() -> bytes:
    """A stream with a bit of everything, in the order an engine behind a gateway sends it."""
    return b"".join([
        b": ping\n\n",
        chat('{"role":"assistant","content":""}'),
        b": keepalive\n\n",
        chat('{"role":null,"content":null,"reasoning_content":"Think \\"twice\\"","tool_calls":null}'),
        content("Hello"),
        content(" wörld, \\n ok"),
        b"data: \n\n",
        content(""),
        b"event: ping\nid: 4\n\n",
        chat(TOOL_FIRST),
        chat(TOOL_ARGS),
        b'data: {"choices":[{"delta":\ndata: {"content":"split"},"finish_reason":null}]}\n\n',
        content("!"),
        chat("{}", finish='"tool_calls"'),
        f'data: {{{_ID},"choices":[],"usage":{USAGE}}}\n\n'.encode(),
        b"data: [DONE]\n\n",
    ])


SAMPLE_KINDS = [H, H, H, O, O, O, H, H, H, O, O, O, O, O, H, D]


def byte_by_byte(body: bytes) -> tuple[list[int], EventScanner]:
    """Each byte fed alone: at most one event ends on a byte, so the masks are the kinds in order."""
    scanner = EventScanner()
    masks = [scanner.feed(body[i:i + 1]) for i in range(len(body))]
    return [m for m in masks if m], scanner


def test_the_sample_stream_event_by_event():
    scanner = EventScanner()
    whole = sample_stream()
    events = whole.replace(b"\n\n", b"\n\n\0").split(b"\0")[:-1]
    assert len(events) == len(SAMPLE_KINDS)
    assert [scanner.feed(e) for e in events] == SAMPLE_KINDS
    summary = scanner.summary()
    assert (summary.events, summary.output_events, summary.heartbeats, summary.done) == (16, 8, 7, True)
    assert summary.last_output_event == 14
    assert (summary.model, summary.prompt_tokens, summary.completion_tokens) == ("llama-8b", 9, 12)
    assert summary.finish_reasons == ("tool_calls",)


@pytest.mark.parametrize("ending", [b"\n", b"\r\n", b"\r"], ids=["lf", "crlf", "cr"])
def test_a_byte_at_a_time_gives_the_same_events(ending):
    body = sample_stream().replace(b"\n", ending)
    masks, scanner = byte_by_byte(body)
    assert masks == SAMPLE_KINDS[:-1] + ([] if ending == b"\r" else [D])
    if ending == b"\r":  # a CR at the end may be half a CRLF: the event ends with the next byte
        assert scanner.feed(b"\r") == D
    reference = EventScanner()
    reference.feed(sample_stream())
    assert scanner.summary() == reference.summary()


@pytest.mark.parametrize("ending", [b"\n", b"\r\n"], ids=["lf", "crlf"])
def test_every_split_in_two_gives_the_same_summary(ending):
    body = sample_stream().replace(b"\n", ending)
    reference = EventScanner()
    assert reference.feed(body) == O | H | D
    expected = reference.summary()
    for cut in range(1, len(body)):
        scanner = EventScanner()
        seen = scanner.feed(body[:cut]) | scanner.feed(body[cut:])
        assert (seen, scanner.summary()) == (O | H | D, expected), f"cut at byte {cut}"


def test_chunks_of_several_events_and_partial_ones():
    body = sample_stream()
    for size in (7, 64, 333, 1000):
        scanner = EventScanner()
        for at in range(0, len(body), size):
            scanner.feed(body[at:at + size])
        assert scanner.summary().output_events == 8, size
        assert scanner.summary().heartbeats == 7, size


def test_an_event_split_inside_the_crlf_of_its_blank_line():
    scanner = EventScanner()
    event = content("x").replace(b"\n", b"\r\n")
    assert scanner.feed(event[:-1]) == 0  # ends in CR: the LF may follow
    assert scanner.feed(event[-1:]) == O
    assert scanner.feed(b": ping\r") == 0
    assert scanner.feed(b"\n\r") == 0
    assert scanner.feed(b"\n") == H


@pytest.mark.parametrize("ending", [b"\n", b"\r\n"], ids=["lf", "crlf"])
def test_the_stream_ends_with_done_however_it_was_split(ending):
    """What a client that closes now had: the whole stream only if [DONE] was the last
    event and nothing of another came after it."""
    body = (content("a") + chat("{}", finish='"stop"') + b"data: [DONE]\n\n").replace(b"\n", ending)
    for size in (1, 2, 3, 5, 17, len(body)):
        scanner = EventScanner()
        for at in range(0, len(body), size):
            assert not scanner.ends_with_done
            scanner.feed(body[at:at + size])
        assert scanner.ends_with_done, size
        scanner.feed(b"\n")  # a blank line is not an event
        assert scanner.ends_with_done
        scanner.feed(b": pi")  # the start of another event is
        assert not scanner.ends_with_done


def test_usage_and_model_from_a_chat_stream():
    scanner = EventScanner()
    scanner.feed(content("a") + content("b") + chat("{}", finish='"length"', usage=USAGE) + b"data: [DONE]\n\n")
    summary = scanner.summary()
    assert (summary.model, summary.prompt_tokens, summary.completion_tokens) == ("llama-8b", 9, 12)
    assert summary.finish_reasons == ("length",)
    assert (summary.output_events, summary.done) == (3, True)


def test_usage_from_a_completions_stream_written_by_json_dumps():
    scanner = EventScanner()
    scanner.feed(spaced({"model": "m2", "choices": [{"index": 0, "text": "a", "finish_reason": None}]}))
    scanner.feed(spaced({"model": "m2", "choices": [{"index": 0, "text": "", "finish_reason": "stop"}],
                         "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}))
    summary = scanner.summary()
    assert (summary.model, summary.prompt_tokens, summary.completion_tokens) == ("m2", 3, 1)
    assert summary.finish_reasons == ("stop",)


def test_usage_from_generate_meta_info():
    scanner = EventScanner()
    scanner.feed(generate("a", [1], 1) + generate("ab", [1, 2], 2) + generate("ab", [1, 2], 2, '{"type":"stop"}'))
    summary = scanner.summary()
    assert (summary.prompt_tokens, summary.completion_tokens, summary.model) == (9, 2, None)
    assert summary.finish_reasons == ("stop",)
    assert summary.output_events == 3


def finish_first(text: str, finish: str = "null") -> bytes:
    """A chunk whose choice has its finish reason before the delta (LiteLLM's order)."""
    return b'data: {"choices":[{"finish_reason":%s,"index":0,"delta":{"content":"%s"}}]}\n\n' % (
        finish.encode(), text.encode())


# (id, a token, the last token with its finish reason)
LAST_TOKEN_WITH_FINISH = [
    ("same-fields", content, chat('{"role":null,"content":".","reasoning_content":null,"tool_calls":null}',
                                  finish='"stop"')),
    ("fewer-fields", content, chat('{"content":"."}', finish='"stop"')),
    ("finish-before-the-text", finish_first, finish_first(".", '"stop"')),
]


@pytest.mark.parametrize("token,last", [c[1:] for c in LAST_TOKEN_WITH_FINISH],
                         ids=[c[0] for c in LAST_TOKEN_WITH_FINISH])
def test_a_finish_reason_with_the_last_token_is_read_after_many_tokens(token, last):
    """The usual event is judged by feed's own check; it must not swallow the finish
    reason vLLM sends with the last token."""
    scanner = EventScanner()
    assert kinds(scanner, *[token(f"t{i}") for i in range(20)], last) == ["output"] * 21
    assert scanner.summary().finish_reasons == ("stop",)


def test_usual_events_in_one_chunk_are_each_counted():
    scanner = EventScanner()
    kinds(scanner, *PRIMERS)
    assert scanner.feed(content("a") + content("b")) == O
    assert scanner.feed(content("c") + content("d") + content("e")) == O
    assert scanner.feed(content("f") + b": ping\n\n" + content("g")) == O | H
    assert (scanner.summary().output_events, scanner.summary().heartbeats) == (3 + 7, 1)


# Chunks that look like the usual event to a quick glance, after three tokens.
LOOKALIKES = [
    ("two-events-split-by-a-blank-line-of-crs", content("a").replace(b"\n\n", b"\r\r") + content("b"), O, (2, 0)),
    ("a-comment-line-of-the-same-bytes", b":" + content("a")[1:], H, (0, 1)),
    ("an-unknown-field-of-the-same-bytes", b"dat4" + content("a")[4:], H, (0, 1)),
]


@pytest.mark.parametrize("chunk,kind,counts", [c[1:] for c in LOOKALIKES], ids=[c[0] for c in LOOKALIKES])
def test_chunks_that_only_look_like_the_usual_event(chunk, kind, counts):
    scanner = EventScanner()
    kinds(scanner, *PRIMERS)
    assert scanner.feed(chunk) == kind
    assert (scanner.output_events - 3, scanner.heartbeats) == counts


def test_a_usual_event_that_ends_a_partial_one_is_part_of_it():
    scanner = EventScanner()
    kinds(scanner, *PRIMERS)
    assert scanner.feed(b'data: {"x') == 0
    assert scanner.feed(content("a")) == O  # the end of one odd event, not an event of its own
    assert scanner.feed(b": ping\n\n") == H
    assert (scanner.events, scanner.output_events, scanner.heartbeats) == (5, 4, 1)


def test_an_empty_or_null_text_between_tokens_is_a_heartbeat():
    scanner = EventScanner()
    assert kinds(scanner, *PRIMERS, content(""), content("x"),
                 chat('{"role":null,"content":null,"reasoning_content":null,"tool_calls":null}'), content("y")) == [
        "output", "output", "output", "heartbeat", "output", "heartbeat", "output"]


def test_an_in_band_error_keeps_its_message():
    scanner = EventScanner()
    scanner.feed(content("a"))
    assert scanner.feed(b'data: {"error":{"message":"Stream error: worker died","type":"stream_error"}}\n\n') == E
    assert (scanner.summary().errors, scanner.summary().error) == (1, "Stream error: worker died")


class CountingDecoder:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, raw: bytes):
        self.calls += 1
        return json.loads(raw)


def test_a_healthy_stream_is_judged_without_decoding_json():
    decode = CountingDecoder()
    scanner = EventScanner(decode=decode)
    scanner.feed(chat('{"role":"assistant","content":""}'))
    for i in range(50):
        scanner.feed(content(f"tok{i} "))
    scanner.feed(chat("{}", finish='"length"', usage=USAGE) + b"data: [DONE]\n\n")
    assert (scanner.summary().output_events, decode.calls) == (51, 0)
    scanner.feed(b'data: {"error":{"message":"late"}}\n\n')
    assert decode.calls == 1


def test_an_event_too_large_to_hold_counts_as_output_and_the_stream_goes_on():
    scanner = EventScanner(max_event_bytes=64)
    big = content("x" * 200)
    assert scanner.feed(big[:100]) == 0
    assert scanner.feed(big[100:-1]) == 0
    assert scanner.feed(big[-1:] + b": ping\n\n") == O | H
    assert (scanner.oversized_events, scanner.summary().output_events) == (1, 1)
    assert scanner.feed(b"data: [DONE]\n\n") == D


def test_a_stream_of_heartbeats_only_has_no_output():
    scanner = EventScanner()
    pings = b": ping\n\n" + chat('{"role":"assistant","content":""}') + chat("{}") + b"data: \n\n"
    for _ in range(10):
        assert scanner.feed(pings) == H
    summary = scanner.summary()
    assert (summary.output_events, summary.heartbeats, summary.last_output_event) == (0, 40, 0)


def test_blank_lines_between_events_are_not_events():
    scanner = EventScanner()
    assert scanner.feed(b"\n\n\n\n" + content("a") + b"\n\n") == O
    assert scanner.summary().events == 1


FRAGMENTS = [content("a"), content(""), chat("{}"), b": ping\n\n", b"data: [DONE]\n\n", b"\n", b"\r\n", b"\r",
             b"data: ", b"data: {", b'"content":"', b'"finish_reason":', b"null", b'"', b"\\", b"}", b"event: ",
             b"error", b"ping", b"id: 1", b'{"error":', b'"meta_info":{"completion_tokens":', b"7", b"\xff\xfe",
             generate("x", [1], 1), chat(TOOL_FIRST), b"data: hello"]


@pytest.mark.parametrize("limit", [300, 1 << 20], ids=["events-over-the-limit", "no-event-over-the-limit"])
@pytest.mark.parametrize("seed", range(30))
def test_any_bytes_split_anywhere_give_the_same_summary(seed, limit):
    """Garbage and fragments of events: no error, and the same events whole, in
    pieces, or a byte at a time."""
    import random

    rng = random.Random(seed)
    body = b"".join(rng.choice(FRAGMENTS) for _ in range(rng.randrange(5, 60)))
    whole = EventScanner(max_event_bytes=limit)
    whole.feed(body)
    pieces = EventScanner(max_event_bytes=limit)
    cuts = sorted(rng.sample(range(1, len(body)), min(len(body) - 1, rng.randrange(1, 20))))
    for start, end in zip([0, *cuts], [*cuts, len(body)]):
        pieces.feed(body[start:end])
    assert pieces.summary() == whole.summary()
    bytewise = EventScanner(max_event_bytes=limit)
    for at in range(len(body)):
        bytewise.feed(body[at:at + 1])
    assert bytewise.summary() == whole.summary()
    # And it goes on: the next event is found and judged.
    events = pieces.events
    assert pieces.feed(b"\n\n" + content("z")) and pieces.events > events


# ----------------------------------------------------------------------------------
# feed_pieces: the pieces of one upstream read at once, the same as one at a time
# ----------------------------------------------------------------------------------
def one_at_a_time(pieces: list[bytes], primed: bool) -> tuple[int, EventScanner]:
    scanner = EventScanner()
    if primed:
        kinds(scanner, *PRIMERS)
    mask = 0
    for piece in pieces:
        mask |= scanner.feed(piece)
    return mask, scanner


def all_at_once(pieces: list[bytes], primed: bool) -> tuple[int, EventScanner]:
    scanner = EventScanner()
    if primed:
        kinds(scanner, *PRIMERS)
    return scanner.feed_pieces(pieces), scanner


@pytest.mark.parametrize("primed", [False, True], ids=["fresh", "after-three-tokens"])
@pytest.mark.parametrize("event,kind", [c[1:] for c in EVENTS], ids=[c[0] for c in EVENTS])
def test_the_pieces_of_one_read_are_judged_as_one_at_a_time(event, kind, primed):
    for pieces in ([event], [content("a"), event], [content("a"), content("b"), event, content("c")],
                   [event, event, content("d")]):
        mask, scanner = all_at_once(pieces, primed)
        expected_mask, expected = one_at_a_time(pieces, primed)
        assert mask == expected_mask and mask & kind
        assert scanner.summary() == expected.summary()


@pytest.mark.parametrize("chunk,kind,counts", [c[1:] for c in LOOKALIKES], ids=[c[0] for c in LOOKALIKES])
def test_pieces_that_only_look_like_the_usual_event_among_usual_ones(chunk, kind, counts):
    scanner = EventScanner()
    kinds(scanner, *PRIMERS)
    assert scanner.feed_pieces([content("a"), chunk, content("b")]) == O | kind
    assert (scanner.output_events - 5, scanner.heartbeats) == counts


def test_usual_events_in_one_piece_are_each_counted_among_pieces():
    scanner = EventScanner()
    kinds(scanner, *PRIMERS)
    assert scanner.feed_pieces([content("a"), content("b") + content("c"), content("d") + b": ping\n\n"]) == O | H
    assert (scanner.output_events, scanner.heartbeats) == (3 + 4, 1)


def test_the_usual_events_bytes_are_learnt_again_when_the_output_moves():
    # Reasoning first, then content: the bytes before the value differ, and so does
    # where the value sits. Each kind of event is still judged right, one at a time or
    # a read at a time.
    reasoning = [chat('{"role":null,"content":null,"reasoning_content":%s,"tool_calls":null}' % json.dumps(t))
                 for t in ("Let", " me", " think", "")]
    body = [*reasoning[:3], reasoning[3], *PRIMERS, content(""), content("x"), chat("{}", finish='"stop"'),
            b"data: [DONE]\n\n"]
    for size in (1, 2, 3, len(body)):
        scanner = EventScanner()
        for at in range(0, len(body), size):
            scanner.feed_pieces(body[at:at + size])
        summary = scanner.summary()
        assert (summary.output_events, summary.heartbeats, summary.done) == (8, 2, True), size
        assert summary.finish_reasons == ("stop",) and scanner.ends_with_done


@pytest.mark.parametrize("seed", range(30))
def test_any_bytes_in_pieces_of_reads_give_the_same_summary(seed):
    import random

    rng = random.Random(seed)
    body = b"".join(rng.choice(FRAGMENTS + [content("t%d" % i) for i in range(8)]) for _ in range(rng.randrange(5, 80)))
    whole = EventScanner()
    whole.feed(body)
    reads = EventScanner()
    cuts = sorted(rng.sample(range(1, len(body)), min(len(body) - 1, rng.randrange(1, 30))))
    pieces = [body[start:end] for start, end in zip([0, *cuts], [*cuts, len(body)])]
    while pieces:
        take = rng.randrange(1, 6)
        reads.feed_pieces(pieces[:take])
        pieces = pieces[take:]
    assert reads.summary() == whole.summary()
