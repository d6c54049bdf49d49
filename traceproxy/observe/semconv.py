"""Every span attribute name we emit, in one place: the stable HTTP names, and the GenAI
names of semantic conventions 1.41.0, the last release that holds them before they moved
to the GenAI conventions' own repository (``gen_ai.provider.name`` replaced
``gen_ai.system``, which is emitted beside it unless OTEL_SEMCONV_STABILITY_OPT_IN holds
``gen_ai_latest_experimental``; see ``genai_spans``). Our own names live under
``traceproxy.``."""

SCHEMA_URL = "https://opentelemetry.io/schemas/1.41.0"

# HTTP (stable)
HTTP_REQUEST_METHOD = "http.request.method"
HTTP_RESPONSE_STATUS_CODE = "http.response.status_code"
HTTP_ROUTE = "http.route"
HTTP_REQUEST_RESEND_COUNT = "http.request.resend_count"
HTTP_REQUEST_BODY_SIZE = "http.request.body.size"
HTTP_RESPONSE_BODY_SIZE = "http.response.body.size"
URL_PATH = "url.path"
URL_QUERY = "url.query"
URL_SCHEME = "url.scheme"
URL_FULL = "url.full"
SERVER_ADDRESS = "server.address"
SERVER_PORT = "server.port"
CLIENT_ADDRESS = "client.address"
CLIENT_PORT = "client.port"
NETWORK_PEER_ADDRESS = "network.peer.address"
NETWORK_PEER_PORT = "network.peer.port"
NETWORK_PROTOCOL_VERSION = "network.protocol.version"
USER_AGENT_ORIGINAL = "user_agent.original"
ERROR_TYPE = "error.type"

# GenAI
GEN_AI_PROVIDER_NAME = "gen_ai.provider.name"
GEN_AI_SYSTEM = "gen_ai.system"  # deprecated for gen_ai.provider.name: emitted beside it by default
GEN_AI_CONVERSATION_ID = "gen_ai.conversation.id"
GEN_AI_OPERATION_NAME = "gen_ai.operation.name"
GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_REQUEST_STREAM = "gen_ai.request.stream"
GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
GEN_AI_RESPONSE_ID = "gen_ai.response.id"
GEN_AI_RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK = "gen_ai.response.time_to_first_chunk"
GEN_AI_USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"

# traceproxy: the outcome and the keep-alive ledger
OUTCOME = "traceproxy.outcome"
OUTCOME_NAME = "traceproxy.outcome.name"
BLAME = "traceproxy.blame"
ERROR_MESSAGE = "traceproxy.error"
REQUEST_ID = "traceproxy.request_id"
REJECTED_TRACEPARENT = "traceproxy.rejected_traceparent"
CLIENT_CONNECTION_ID = "traceproxy.client.connection.id"
CLIENT_REQUEST_SEQUENCE = "traceproxy.client.connection.request_sequence"
CLIENT_IDLE_GAP = "traceproxy.client.connection.idle_gap_s"
UPSTREAM_CONNECTION_ID = "traceproxy.upstream.connection.id"
UPSTREAM_CONNECTION_REUSED = "traceproxy.upstream.connection.reused"
UPSTREAM_CONNECTION_IDLE_AGE = "traceproxy.upstream.connection.idle_age_s"
UPSTREAM_CONNECTION_REQUEST_NUMBER = "traceproxy.upstream.connection.request_number"
ATTEMPTS = "traceproxy.upstream.attempts"
CHUNKS = "traceproxy.response.chunks"
CHUNK_MAX_GAP = "traceproxy.response.chunk_max_gap_s"
DONE_SEEN = "traceproxy.response.done_seen"
# traceproxy: an event stream's tokens as the proxy saw them pass
TIME_TO_FIRST_TOKEN = "traceproxy.response.time_to_first_token_s"  # to the first event with output
TOKEN_MAX_GAP = "traceproxy.response.token_max_gap_s"  # the longest wait between two output events
OUTPUT_EVENTS = "traceproxy.response.output_events"
HEARTBEATS = "traceproxy.response.heartbeats"  # events without output: comments, empty deltas, pings
# On a stall span: the wait as it stood, from the last output event, or from the response head while none came
SINCE_LAST_TOKEN = "traceproxy.response.since_last_token_s"
SINCE_HEAD_WITHOUT_TOKEN = "traceproxy.response.since_head_without_token_s"
USAGE_SOURCE = "traceproxy.usage.source"  # usage: the engine's counts; counted: output events counted
STALLS = "traceproxy.stalls"
STALL_OUTCOME = "traceproxy.stall.outcome"
STALL_PHASE = "traceproxy.stall.phase"
STALL_WAITED = "traceproxy.stall.waited_s"
STALL_DURATION = "traceproxy.stall.duration_s"
STALL_REQUEST_AGE = "traceproxy.stall.request_age_s"  # how long its request had been in, at detection
STALL_ENGINES = "traceproxy.stall.engines"  # the engines' gauges when the stall was detected

# traceproxy: where the engines have a request (engine spans or gauges; lifecycle.pd_stages)
ENGINE_COMPONENT = "traceproxy.engine.component"  # router, prefill, bootstrap, kv_transfer, decode
ENGINE_ROLE = "traceproxy.engine.role"
ENGINE_STAGE = "traceproxy.engine.stage"  # SGLang's stage name
ENGINE_STAGE_STATE = "traceproxy.engine.stage.state"  # in: the stage it is in; ended: the last that ended
ENGINE_STAGE_SINCE = "traceproxy.engine.stage.since_s"
ENGINE_SOURCE = "traceproxy.engine.source"  # spans or gauges
ENGINE_DETAIL = "traceproxy.engine.detail"
ENGINE_WORKER_SERVICE = "traceproxy.engine.worker.service"
ENGINE_WORKER_HOST = "traceproxy.engine.worker.host"
ENGINE_WORKER_PID = "traceproxy.engine.worker.pid"
