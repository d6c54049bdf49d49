"""``traceproxy top``: a live terminal view of the requests in flight and whose turn it is.

Polls the admin listener and redraws one frame per interval. One frame is one
answer: ``GET /debug/inflight`` holds the table and, as ``health``, the header
line's numbers gathered from every worker at the same time as the entries (an
admin listener that does not send ``health`` is asked ``GET /healthz`` too). Stalled requests are
red and marked ``STALL``; requests past half their stall threshold are yellow and
marked ``slow``. The marker column is there with or without colour, so
``--no-color`` output (and anything piped through grep) says the same thing. With
engine spans received or gauges labelled by role, the ENGINE column says where the
engines have each request: the PD component and SGLang stage (``~`` before it when only
the gauges say so, for the engines as a whole). With event streams in flight, the
TOKEN/HB column says, for each, the time since its last token and its heartbeats
(``2.1s 14hb``), or, while no token came, the time since its response head
(``head+2.1s 14hb``): what an event stream's stall is judged on. In a narrow terminal
the columns that say why a request waits (ENGINE, then TOKEN/HB) outlast the others: the
optional ones go first, then METHOD PATH, ENGINE's stage and REQUEST ID are cut short
(``WHY_RANK``). When one of those two is left out all the same, a line under the table
says so, and how wide a terminal shows it.

Rendering is a set of pure functions (JSON in, lines of text out) and the screen
is a plain ANSI redraw: home the cursor, write the frame, clear what is left.
That keeps every frame testable as strings without a terminal, and ``--once``
is the same frame printed once with no cursor control. Piped or redirected (stdout
not a terminal), the live view prints each frame after the one before, a blank line
between them and no escape codes at all, as ``top -b`` does. curses would add a
terminal dependency to the tests and buy nothing here, since the view takes no
keyboard input except Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import sys
import textwrap
import time
import urllib.parse
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from .config import listen_argument
from .repro.client import COMPLETE, PROTOCOL_ERROR, TIMEOUT, simple_get

FETCH_TIMEOUT_S = 3.0  # for a whole answer, not per read: a server trickling bytes is cut off too
MAX_INTERVAL_S = 3600.0
UNREACHABLE_EXIT = 2

# --- ANSI ---

RED_BOLD = "\x1b[1;31m"
YELLOW = "\x1b[33m"
BOLD = "\x1b[1m"
RESET = "\x1b[0m"
HOME = "\x1b[H"
CLEAR_LINE = "\x1b[K"
CLEAR_BELOW = "\x1b[J"
ENTER_ALT_SCREEN = "\x1b[?1049h\x1b[?25l"  # alternate screen, cursor hidden
LEAVE_ALT_SCREEN = "\x1b[?25h\x1b[?1049l"

STALLED, SLOW, WAITING = "stalled", "slow", "waiting"
MARKERS = {STALLED: "STALL", SLOW: "slow", WAITING: ""}
ROW_COLORS = {STALLED: RED_BOLD, SLOW: YELLOW}

# Short names for the lifecycle phases, so the column stays narrow.
PHASE_LABELS = {
    "awaiting_request_headers": "req-headers",
    "awaiting_upstream_connection": "pool-wait",
    "awaiting_request_body": "req-body",
    "sending_request_upstream": "sending",
    "awaiting_upstream_headers": "first-byte",
    "streaming_response": "streaming",
    "draining_to_client": "draining",
    "done": "done",
}


# --- the admin address ---


def default_admin() -> str:
    """The admin address ``traceproxy serve`` listens on by default."""
    from .config import default_settings

    return str(default_settings().admin)


def _ways_to_set_admin() -> str:
    """``--admin, admin in its config file, TRACEPROXY_ADMIN``, from the schema."""
    from .config.sections import BY_DOTTED

    admin = BY_DOTTED["admin"]
    return f"{admin.flag}, {admin.dotted} in its config file, {admin.env}"


def admin_address(text: str) -> str:
    """HOST:PORT (or http://HOST:PORT) -> the admin listener's base URL; raises ArgumentTypeError."""
    raw = text.strip().removesuffix("/")
    if raw.lower().startswith("http://"):
        raw = raw[7:]
    host, _, port = raw.rpartition(":")
    if ":" in host and not host.startswith("["):
        raw = f"[{host}]:{port}"  # an IPv6 address given without its brackets
    try:
        admin = listen_argument(raw)
    except argparse.ArgumentTypeError:
        admin = None
    if admin is None or admin.port == 0:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT such as 127.0.0.1:9464, got {text!r}")
    return f"http://{admin}"


def positive_seconds(text: str) -> float:
    """A refresh interval: seconds above 0, at most an hour; raises ArgumentTypeError."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not (value > 0 and math.isfinite(value) and value <= MAX_INTERVAL_S):
        raise argparse.ArgumentTypeError(
            f"expected a number of seconds above 0 and at most {MAX_INTERVAL_S:g}, got {text!r}")
    return value


# --- fetching ---


class AdminUnreachable(Exception):
    """The admin listener did not answer with the JSON expected; ``str()`` names the URL.
    ``reached``: something answered there, only not as traceproxy's admin listener does
    (another server, or the proxy's own port), which is told apart from no answer."""

    def __init__(self, url: str, reason: str, reached: bool = False) -> None:
        self.url = url
        self.reason = reason
        if reached:
            self.headline = f"{url} answered, but not as the traceproxy admin listener does"
            self.detail = f"{reason} (is this the admin port?)"
        else:
            self.headline, self.detail = f"cannot reach the traceproxy admin listener at {url}", reason
        super().__init__(f"{self.headline}: {self.detail}")


@dataclass(frozen=True)
class Snapshot:
    inflight: dict
    health: dict | None  # None when /healthz did not answer
    health_error: str = ""


def _json_object(body: bytes) -> dict | None:
    try:
        value = json.loads(body)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def fetch_json(url: str, timeout: float = FETCH_TIMEOUT_S) -> dict:
    """GET url -> its JSON object, within ``timeout`` for the whole answer. A JSON error
    body (such as /healthz's 503 while draining) counts. The admin listener is local:
    the request goes straight to it, never through a proxy from the environment."""
    parts = urllib.parse.urlsplit(url)
    try:
        answer = simple_get(parts.hostname or "", parts.port or 80, parts.path or "/", timeout)
    except (OSError, ValueError) as exc:  # refused, unreachable, a bad port
        raise AdminUnreachable(url, str(exc) or type(exc).__name__) from None
    if answer.ending == TIMEOUT:
        raise AdminUnreachable(url, f"no complete answer within {timeout:g} s")
    if answer.ending == PROTOCOL_ERROR:  # something answered, in another protocol (a gRPC port, say)
        raise AdminUnreachable(url, answer.error, reached=True)
    if answer.ending != COMPLETE:
        raise AdminUnreachable(url, answer.error or answer.ending)
    if "traceresponse" in answer.headers:
        # The proxy adds traceresponse to every answer it relays (the admin listener never
        # does): this is its listen port, and the answer an upstream's.
        raise AdminUnreachable(url, f"HTTP {answer.status} relayed by traceproxy's proxy listener (its traceresponse "
                               f"header): the admin listener is another address, {default_admin()} unless serve "
                               f"was configured with another ({_ways_to_set_admin()})", reached=True)
    found = _json_object(bytes(answer.body))
    if found is None:
        if answer.status is not None and answer.status >= 400:
            raise AdminUnreachable(url, f"HTTP {answer.status}", reached=True)
        raise AdminUnreachable(url, "the answer is not a JSON object", reached=True)
    return found


def fetch_snapshot(base_url: str, timeout: float = FETCH_TIMEOUT_S) -> Snapshot:
    inflight = fetch_json(f"{base_url}/debug/inflight", timeout)
    if not isinstance(inflight.get("requests"), list):
        raise AdminUnreachable(f"{base_url}/debug/inflight", "the answer has no list of requests", reached=True)
    if isinstance(inflight.get("health"), dict):  # the same moment as the entries, from every worker
        return Snapshot(inflight, inflight["health"])
    try:
        return Snapshot(inflight, fetch_json(f"{base_url}/healthz", timeout))
    except AdminUnreachable as exc:
        return Snapshot(inflight, None, exc.reason)


# --- cells: one entry -> short strings ---


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 10:
        return f"{seconds:.1f}s"
    if seconds < 100:
        return f"{seconds:.0f}s"
    if seconds < 3600:
        return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"
    return f"{int(seconds // 3600)}h{int(seconds % 3600 // 60):02d}m"


def byte_count(n: int | None) -> str:
    if n is None:
        return "-"
    if n < 1024:
        return str(n)
    value = float(n)
    for unit in "KMG":
        value /= 1024
        if value < 1024 or unit == "G":
            break
    return f"{value:.1f}{unit}" if value < 10 else f"{value:.0f}{unit}"


def row_state(entry: dict) -> str:
    """STALLED past the threshold, SLOW past half of it, else WAITING."""
    found = entry.get("verdict")
    if not found:
        return WAITING
    if found.get("stalled"):
        return STALLED
    after, waited = found.get("stall_after_s"), found.get("waiting_for_s")
    if after and waited is not None and waited >= after / 2:
        return SLOW
    return WAITING


def _wait_cell(entry: dict) -> str:
    found = entry.get("verdict")
    if not found:
        return "-"
    after = found.get("stall_after_s")
    return f"{duration(found.get('waiting_for_s'))}/{duration(after) if after else 'off'}"


def _verdict_field(key: str) -> Callable[[dict], str]:
    return lambda entry: str((entry.get("verdict") or {}).get(key) or "-")


def _request_cell(entry: dict) -> str:
    return f"{entry.get('method') or '-'} {entry.get('path') or '-'}"


def _connection_cell(entry: dict) -> str:
    return f"{entry.get('client_connection', '-')}/{entry.get('client_request_sequence', '-')}"


def _upstream_cell(entry: dict) -> str:
    conn = entry.get("upstream_connection")
    if conn is None:
        return "-"
    return f"#{conn} {'reused' if entry.get('upstream_reused') else 'new'}"


def engine_cell(entry: dict) -> str:
    """``kv_transfer prefill_transfer_kv_cache``; ``~`` first when the gauges say it, not spans."""
    stage = entry.get("engine_stage")
    if not stage:
        return "-"
    text = " ".join(part for part in (stage.get("component"), stage.get("stage")) if part)
    if stage.get("state") == "ended":
        text += " (ended)"
    return ("~" if stage.get("source") == "gauges" else "") + text


def token_cell(entry: dict) -> str:
    """An event stream's ``2.1s 14hb``: seconds since its last token, then its heartbeats;
    ``head+2.1s 14hb`` while no token came (counted from the response head)."""
    tokens = entry.get("tokens")
    if not tokens:
        return "-"
    since = tokens.get("since_last_token_s")
    waited = duration(since) if since is not None else "head+" + duration(tokens.get("since_head_without_token_s"))
    return f"{waited} {tokens.get('heartbeats', 0)}hb"


def _out_cell(entry: dict) -> str:
    return byte_count((entry.get("bytes") or {}).get("response_out"))


# --- the table ---


FLEX_MIN_WIDTH, FLEX_MAX_WIDTH = 12, 60  # the METHOD PATH column
# "kv_transfer prefill_transfer_kv_cache" with room; cut, "kv_transfer prefill_transfer_kv..",
# and at the narrowest "~kv_transfer p..": every component name, the gauges' "~" with it,
# still fits whole with the first letter of its stage.
ENGINE_MAX_WIDTH, ENGINE_SQUEEZE_WIDTH = 40, 16
# Optional columns ranked up to here (TOKEN/HB, ENGINE) say why a request waits: before
# one of them goes, the squeezable columns (ENGINE, REQUEST ID) are cut as far as their
# squeeze_width. Those ranked above it (METHOD PATH, CONN/SEQ and the rest) go before that:
# a path cut to "POST.." says less than the engine's stage.
WHY_RANK = 2


@dataclass(frozen=True)
class Column:
    title: str
    cell: Callable[[dict], str]
    max_width: int = 16
    right: bool = False
    drop_rank: int = 0  # 0: always shown; when narrow, the highest rank goes first
    flexible: bool = False  # takes the width left over, and is cut first
    only_with: str = ""  # shown only when some entry has this key (a feature that is on)
    squeeze_width: int = 0  # > 0: cut as far as this rather than drop a column ranked up to WHY_RANK
    keep_end: bool = False  # cut in the middle: the end is what tells such values apart


COLUMNS: tuple[Column, ...] = (
    Column("STATE", lambda e: MARKERS[row_state(e)], 5),
    Column("AGE", lambda e: duration(e.get("age_s")), 7, right=True),
    Column("PHASE", lambda e: PHASE_LABELS.get(e.get("phase"), str(e.get("phase"))), 28),
    Column("WAIT/AFTER", _wait_cell, 15, right=True),
    Column("VERDICT", _verdict_field("outcome"), 7),
    Column("BLAME", _verdict_field("blame"), 7),
    # ENGINE outranks TOKEN/HB: a PD stall's component is the first thing to look at. Its
    # cell is cut rather than dropped, down to the component and the start of the stage.
    Column("ENGINE", engine_cell, ENGINE_MAX_WIDTH, drop_rank=1, only_with="engine_stage",
           squeeze_width=ENGINE_SQUEEZE_WIDTH),
    Column("TOKEN/HB", token_cell, 16, right=True, drop_rank=2, only_with="tokens"),
    # The path is cut to FLEX_MIN_WIDTH, then goes whole (the last of the optional columns
    # that say nothing of why a request waits); the request id, the handle diagnose takes,
    # always stays, squeezed to a prefix to grep for.
    Column("METHOD PATH", _request_cell, FLEX_MAX_WIDTH, flexible=True, drop_rank=3),
    # Whole where there is room (a 32-hex id, repro's "repro-5db791-fresh-c1-t1"): one run's
    # ids share their start, so a cut one loses that first ("re..fresh-c1-t1"), else its middle.
    Column("REQUEST ID", lambda e: e.get("request_id") or "-", 32, squeeze_width=8, keep_end=True),
    Column("CONN/SEQ", _connection_cell, 10, right=True, drop_rank=4),
    Column("UPSTREAM", _upstream_cell, 12, drop_rank=5),
    Column("OUT", _out_cell, 6, right=True, drop_rank=6),
    Column("CHUNKS", lambda e: str(e.get("chunks", "-")), 7, right=True, drop_rank=7),
)
GAP = " "


def clip(text: str, width: int) -> str:
    """text cut to width, marking the cut with '..'. A cut that would keep only whole words
    ("POST /v1/..." to 6) keeps them unmarked ("POST"): "POST.." is wider and says no more."""
    if len(text) <= width:
        return text
    if width <= 2:
        return text[:width]
    kept = text[: width - 2]
    if kept.endswith(" ") or text[width - 2] == " ":
        return kept.rstrip()
    return kept + ".."


def clip_middle(text: str, width: int) -> str:
    """text cut to width in its middle, marked with '..': its start and, a little longer,
    its end ("4bf92..e4736", "repro..c1-t1")."""
    if len(text) <= width:
        return text
    if width <= 4:
        return text[-width:]
    head = (width - 2) // 2
    return text[:head] + ".." + text[len(text) - (width - 2 - head):]


def clip_shared_start(text: str, width: int, shared: int) -> str:
    """text cut to width where it says least: in the start it shares with every other row
    (one repro run's "repro-5db791-"), so what tells the rows apart stays whole
    ("r..reused-c1-t1" beside "re..fresh-c2-t1"); when even that does not fit, its end,
    where ids count ("..000117", "..-c1-t2"). Without a shared start, as ``clip_middle``."""
    if len(text) <= width:
        return text
    own = text[shared:]
    if not shared or width <= 6:
        return clip_middle(text, width)
    kept = width - 2 - len(own)
    if kept >= 0:
        return text[:kept] + ".." + own
    return ".." + own[-(width - 2):]


def _shared_start(cells: list[str]) -> int:
    """How many leading characters every one of several distinct cells shares, up to a
    separator ("repro-5db791-fresh-c1-" of "...-t1" and "...-t2"), so that the rest is
    whole words."""
    distinct = set(cells)
    if len(distinct) < 2:
        return 0
    start = os.path.commonprefix(sorted(distinct))
    return max(start.rfind(separator) for separator in _ID_SEPARATORS) + 1


_ID_SEPARATORS = "-_.:/"


def _natural_width(column: Column, cells: list[str]) -> int:
    return min(column.max_width, max([len(column.title), *map(len, cells)]))


def _cuts(columns: tuple[Column, ...], shown: list[int], natural: list[int], squeezed: bool) -> list[tuple[int, int]]:
    """[(column index, the narrowest it may be cut to)], in the order they are cut: the
    flexible column to FLEX_MIN_WIDTH; squeezed, then each squeezable one to its squeeze_width."""
    cuts = [(i, min(natural[i], FLEX_MIN_WIDTH)) for i in shown if columns[i].flexible]
    if squeezed:
        # The stage after the engine's component first; the request id (the handle diagnose
        # takes) last.
        squeezable = sorted((i for i in shown if columns[i].squeeze_width),
                            key=lambda i: 0 if columns[i].drop_rank else 1)
        cuts += [(i, min(natural[i], columns[i].squeeze_width)) for i in squeezable]
    return cuts


def _widths(columns: tuple[Column, ...], shown: list[int], natural: list[int], squeezed: bool,
            width: int) -> dict[int, int]:
    """Each shown column's width: natural, less what the cuts take, in their order, until
    the row fits in width (or every cut is taken: the line is clipped then)."""
    widths = {i: natural[i] for i in shown}
    excess = sum(widths.values()) + len(GAP) * (len(shown) - 1) - width
    for i, floor in _cuts(columns, shown, natural, squeezed):
        cut = max(min(excess, widths[i] - floor), 0)
        widths[i] -= cut
        excess -= cut
    return widths


def _squeezing(columns: tuple[Column, ...], shown: list[int]) -> bool:
    """Whether the squeezable columns may be cut to their squeeze_width: only once every
    optional column ranked above WHY_RANK has gone (to keep one ranked up to it, or, with
    none left, rather than clip the row's end, where the request id is)."""
    ranks = [columns[i].drop_rank for i in shown if columns[i].drop_rank]
    return not ranks or max(ranks) <= WHY_RANK


def fit_columns(columns: tuple[Column, ...], rows: list[list[str]], width: int) -> list[tuple[int, int]]:
    """[(column index, width)] that fit in width: the flexible column shrinks first, then the
    optional columns drop, highest rank first; before one ranked up to WHY_RANK drops, the
    squeezable columns are cut further. A dropped column ranked up to WHY_RANK comes back
    (the most important first) when the room the drops after it made holds it."""
    natural = [_natural_width(c, [r[i] for r in rows]) for i, c in enumerate(columns)]
    shown = list(range(len(columns)))

    def layout() -> dict[int, int]:
        return _widths(columns, shown, natural, _squeezing(columns, shown), width)

    def fits() -> bool:
        return sum(layout().values()) + len(GAP) * (len(shown) - 1) <= width

    droppable = sorted((i for i, c in enumerate(columns) if c.drop_rank), key=lambda i: -columns[i].drop_rank)
    dropped: list[int] = []
    while droppable and not fits():
        dropped.append(droppable.pop(0))
        shown.remove(dropped[-1])
    for index in reversed(dropped):  # e.g. TOKEN/HB, when ENGINE (too wide to fit) went after it
        if columns[index].drop_rank > WHY_RANK:
            continue  # the rest stay in rank order: none shown while one ranked before it is not
        shown.append(index)
        shown.sort()
        if not fits():
            shown.remove(index)
    widths = layout()
    return [(i, widths[i]) for i in shown]


def _join(cells: list[str], layout: list[tuple[int, int]], columns: tuple[Column, ...],
          shared: dict[int, int] | None = None) -> str:
    """One line of cells; ``shared``: the start the rows share, by keep_end column index."""
    parts = []
    for (index, width), text in zip(layout, cells):
        if columns[index].keep_end:
            text = clip_shared_start(text, width, shared.get(index, 0) if shared else 0)
        else:
            text = clip(text, width)
        parts.append(text.rjust(width) if columns[index].right else text.ljust(width))
    return GAP.join(parts).rstrip()


def _paint(line: str, color: str | None, use_color: bool) -> str:
    return f"{color}{line}{RESET}" if use_color and color else line


def render_table(entries: list[dict], width: int, use_color: bool = True,
                 max_rows: int | None = None) -> list[str]:
    """The in-flight entries as a header line and one line per request, each at most width visible chars."""
    if not entries:
        return ["(no requests in flight)"]
    columns = tuple(c for c in COLUMNS if not c.only_with or any(c.only_with in e for e in entries))
    rows = [[c.cell(e) for c in columns] for e in entries]
    layout = fit_columns(columns, rows, width)
    title = _join([columns[i].title for i, _ in layout], layout, columns)
    shared = {i: _shared_start([row[i] for row in rows]) for i, _ in layout if columns[i].keep_end}
    lines = [_paint(clip(title, width), BOLD, use_color)]
    note = hidden_note(columns, rows, layout, width)
    if max_rows is not None and note:
        max_rows -= 1
    fits = max_rows is None or len(entries) <= max_rows
    shown = len(entries) if fits else max(max_rows - 1, 0)  # keep a line to say how many are hidden
    for entry, row in zip(entries[:shown], rows):
        line = clip(_join([row[i] for i, _ in layout], layout, columns, shared), width)
        lines.append(_paint(line, ROW_COLORS.get(row_state(entry)), use_color))
    if not fits:
        lines.append(clip(f"... {len(entries) - shown} more not shown (a taller terminal shows them)", width))
    if note:
        lines.append(clip(note, width))
    return lines


def hidden_note(columns: tuple[Column, ...], rows: list[list[str]], layout: list[tuple[int, int]],
                width: int) -> str:
    """``(ENGINE, TOKEN/HB hidden: widen to 118 columns)`` when a column that says why a
    request waits was left out for width; "" otherwise (the other optional ones go quietly)."""
    shown = {i for i, _ in layout}
    hidden = [i for i, c in enumerate(columns) if i not in shown and 0 < c.drop_rank <= WHY_RANK]
    if not hidden:
        return ""
    # Every column at its natural width fits at the latest: the first width up to that which shows them.
    most = sum(_natural_width(c, [r[i] for r in rows]) for i, c in enumerate(columns)) + len(GAP) * len(columns)
    needed = next((w for w in range(width + 1, most + 1)
                   if set(hidden) <= {i for i, _ in fit_columns(columns, rows, w)}), most)
    return f"({', '.join(columns[i].title for i in hidden)} hidden: widen to {needed} columns)"


# --- the header ---


def summary_line(entries: list[dict]) -> str:
    states = Counter(row_state(e) for e in entries)
    blames = Counter((e.get("verdict") or {}).get("blame", "?") for e in entries if row_state(e) == STALLED)
    text = f"{len(entries)} in flight, {states[STALLED]} stalled, {states[SLOW]} slow"
    if blames:
        text += " (stalled: " + ", ".join(f"{who} {n}" for who, n in blames.most_common()) + ")"
    return text


def health_fields(snapshot: Snapshot) -> list[str]:
    health = snapshot.health
    if health is None:
        return [f"pid {snapshot.inflight.get('pid', '?')}", f"(healthz: {snapshot.health_error or 'no answer'})"]
    return [
        f"traceproxy {health.get('version', '?')}",
        f"pid {health.get('pid', '?')}",
        str(health.get("status", "?")),
        f"up {duration(health.get('uptime_s'))}",
        f"upstream {health.get('upstream', '?')}",
        f"clients {health.get('client_connections', '?')}",
        f"in flight {health.get('requests_in_flight', '?')}",
        f"upstream conns {health.get('upstream_connections_open', '?')} open"
        f"/{health.get('upstream_connections_idle', '?')} idle",
        *_workers_field(health),
    ]


def _workers_field(health: dict) -> list[str]:
    """``workers 3``, or ``workers 2 of 3 answering`` when some did not answer in time."""
    workers = health.get("workers")
    if not isinstance(workers, list):
        return []
    answering = health.get("workers_answering", len(workers))
    if answering == len(workers):
        return [f"workers {len(workers)}"]
    return [f"workers {answering} of {len(workers)} answering (the rest left out)"]


def _gauge_label(name: str) -> str:
    """``sglang:num_prefill_inflight_queue_reqs`` -> ``prefill_inflight_queue``;
    a router's ``smg_http_connections_active`` -> ``http_connections_active``."""
    short = name.split(":", 1)[-1].removeprefix("smg_")
    return short.removeprefix("num_").removesuffix("_reqs")


def engine_fields(inflight: dict) -> list[str]:
    """One field per scraped engine endpoint, and the orphan verdict when reported."""
    return [field for group in engine_field_groups(inflight) for field in group]


def engine_field_groups(inflight: dict) -> list[list[str]]:
    """The engine header's fields in groups that each start a line of their own: the
    endpoints' gauges; the orphan verdict and the work behind it; the span receivers' counts
    (joined onto a gauge line, they read as one more of that endpoint's gauges)."""
    return [group for group in (_gauge_fields(inflight), _orphan_fields(inflight), _receiver_fields(inflight))
            if group]


def _gauge_fields(inflight: dict) -> list[str]:
    fields = []
    for url, endpoint in (inflight.get("engines") or {}).items():
        if endpoint.get("error"):
            fields.append(f"engine {url}: scrape failing ({endpoint['error']})")
            continue
        # Every gauge /debug/inflight lists for the endpoint, a router's smg_* ones too: the
        # same answer in both places.
        gauges = ", ".join(f"{_gauge_label(name)} {value:g}" for name, value in sorted(endpoint.get("gauges", {}).items()))
        age = endpoint.get("last_scrape_age_s")
        fields.append(f"engine {url}: {gauges or 'no gauges'}" + (f" ({age:.1f} s ago)" if age is not None else ""))
    return fields


def _orphan_fields(inflight: dict) -> list[str]:
    fields = []
    orphan = (inflight.get("correlation") or {}).get("orphan") or {}
    if orphan.get("reported"):
        fields.append(f"{orphan['outcome']} {orphan['name']}: {orphan['unexplained']:g} engine requests no client "
                      f"waits on (blame {orphan['blame']})")
    fields += [_engine_work_field(work) for work in (orphan.get("engine_work") or ())[:ENGINE_WORK_SHOWN]]
    return fields


def _receiver_fields(inflight: dict) -> list[str]:
    received = inflight.get("engine_spans")
    if not received:
        return []
    refused = sum((received.get("rejected") or {}).values())
    return [f"engine spans: {received.get('spans_received', 0)} received, {received.get('traces', 0)} "
            f"traces kept, {received.get('spans_dropped_no_room', 0)} dropped, {refused} bodies refused"]


ENGINE_WORK_SHOWN = 3


def _engine_work_field(work: dict) -> str:
    """Engine work no request in flight has: where, on which worker, since when."""
    worker = work.get("worker") or {}
    where = " ".join(str(part) for part in (worker.get("service"), f"pid {worker['pid']}" if worker.get("pid")
                                            is not None else "") if part)
    since = f" for {duration(work['since_s'])}" if work.get("since_s") is not None else ""
    return (f"held at the engines, in flight nowhere here: {work.get('component')} {work.get('stage') or ''}"
            f"{' on ' + where if where else ''}{since} (trace {work.get('trace_id')})")


def pack(fields: list[str], width: int, sep: str = "  ") -> list[str]:
    """fields joined by sep into as few lines of at most width as they fit in; a field is never split."""
    lines: list[str] = []
    for field in fields:
        if lines and len(lines[-1]) + len(sep) + len(field) <= width:
            lines[-1] += sep + field
        else:
            lines.append(clip(field, width))
    return lines


def render_frame(snapshot: Snapshot, base_url: str, width: int, clock: str, use_color: bool = True,
                 height: int | None = None) -> list[str]:
    """A whole screen: health, summary, the table. height (None: unbounded) bounds the table rows."""
    entries = snapshot.inflight.get("requests") or []
    stalled = any(row_state(e) == STALLED for e in entries)
    summary = [_paint(line, RED_BOLD if stalled else None, use_color)
               for line in pack([summary_line(entries), f"admin {base_url}", clock], width, "   ")]
    engine = [line for group in engine_field_groups(snapshot.inflight) for line in pack(group, width)]
    header = pack(health_fields(snapshot), width) + engine + summary + [""]
    max_rows = None if height is None else height - len(header) - 1
    return header + render_table(entries, width, use_color, max_rows)


def render_unreachable(error: AdminUnreachable, width: int, clock: str, interval: float) -> list[str]:
    """The retry screen, wrapped rather than cut so the URL is always there in full."""
    text = [error.headline, f"({error.detail})",
            f"retrying every {interval:g}s ({clock}); Ctrl-C to quit"]
    return [piece for line in text for piece in textwrap.wrap(line, max(width, 20))]


# --- running ---


def _clock() -> str:
    return time.strftime("%H:%M:%S")


def _wants_color(args: argparse.Namespace) -> bool:
    # Colour for a terminal only, as ls and grep do: piped into a file or another
    # command, escape codes are noise.
    return not args.no_color and "NO_COLOR" not in os.environ and sys.stdout.isatty()


def _frame(snapshot: Snapshot, base_url: str, width: int, use_color: bool, height: int | None = None) -> list[str]:
    """render_frame, with an answer of the wrong shape (fields of other types: not
    traceproxy's admin listener, or another version of it) reported as unreachable."""
    try:
        return render_frame(snapshot, base_url, width, _clock(), use_color, height)
    except (AttributeError, TypeError, ValueError, KeyError):
        raise AdminUnreachable(f"{base_url}/debug/inflight", "its fields are not of the kinds expected",
                               reached=True) from None


def run_once(base_url: str, use_color: bool) -> int:
    try:
        lines = _frame(fetch_snapshot(base_url, FETCH_TIMEOUT_S), base_url, shutil.get_terminal_size().columns,
                       use_color)
    except AdminUnreachable as exc:
        print(f"traceproxy top: {exc}", file=sys.stderr)
        return UNREACHABLE_EXIT
    print("\n".join(lines))
    return 0


def _draw(lines: list[str]) -> None:
    sys.stdout.write(HOME + "".join(line + CLEAR_LINE + "\n" for line in lines[:-1]) + lines[-1] + CLEAR_LINE
                     + CLEAR_BELOW)
    sys.stdout.flush()


def _next_frame(base_url: str, interval: float, use_color: bool, on_screen: bool = True) -> list[str]:
    """The next frame; cut to the screen's height only on a screen (piped, whole, as --once)."""
    size = shutil.get_terminal_size()
    try:
        snapshot = fetch_snapshot(base_url, min(FETCH_TIMEOUT_S, max(interval, 1.0)))
        return _frame(snapshot, base_url, size.columns, use_color, size.lines if on_screen else None)
    except AdminUnreachable as exc:
        return render_unreachable(exc, size.columns, _clock(), interval)


def _take_ctrl_c() -> object:
    """Make Ctrl-C raise KeyboardInterrupt here, whatever SIGINT was on entry; returns the previous handler.

    A process started with SIGINT ignored keeps it ignored, and Python then installs no
    KeyboardInterrupt for it: a shell does that to every ``command &`` it starts without
    job control (scripts, CI steps, ``sh -c``), and the view would then say "Ctrl-C to
    quit" and never quit. The view owns its terminal while it runs, so it takes Ctrl-C back."""
    return signal.signal(signal.SIGINT, signal.default_int_handler)


def run_live(base_url: str, interval: float, use_color: bool) -> int:
    on_screen = sys.stdout.isatty()  # else one frame after another, for a file or a pager
    previous = _take_ctrl_c()  # before the first frame: once a frame is shown, Ctrl-C works
    if on_screen:
        sys.stdout.write(ENTER_ALT_SCREEN)
    try:
        while True:
            lines = _next_frame(base_url, interval, use_color, on_screen)
            if on_screen:
                _draw(lines)
            else:
                print("\n".join(lines) + "\n", flush=True)
            time.sleep(interval)
    except KeyboardInterrupt:
        return 0
    finally:
        if on_screen:
            sys.stdout.write(LEAVE_ALT_SCREEN)
            sys.stdout.flush()
        if previous is not None:  # None: set outside Python, and cannot be put back from here
            signal.signal(signal.SIGINT, previous)


def _options(args: argparse.Namespace) -> tuple[str, float]:
    """(admin base URL, interval) from the command line; raises ArgumentTypeError."""
    return admin_address(args.admin or default_admin()), positive_seconds(str(args.interval))


def run(args: argparse.Namespace) -> int:
    """Entry point for ``traceproxy top``; args: admin (HOST:PORT or None), interval, once, no_color."""
    try:
        base_url, interval = _options(args)
    except argparse.ArgumentTypeError as exc:
        print(f"traceproxy top: error: {exc}", file=sys.stderr)
        return 2
    try:
        if args.once:
            return run_once(base_url, _wants_color(args))
        return run_live(base_url, interval, _wants_color(args))
    except KeyboardInterrupt:
        return 0
