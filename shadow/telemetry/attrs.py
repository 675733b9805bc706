"""Span attribute keys shadow uses (our own constants: the Python semconv `gen_ai` ones are marked
moved). Never prompt or completion text."""

SERVICE_NAME = "shadow-sidecar"

# shadow.* (our namespace)
REQUEST_ID = "shadow.request.id"  # the mirror's id of a request (a tapped one's: the hash below)
REQUEST_ID_HASH = "shadow.request.id_hash"  # blake2b-64 of the request id sent (contracts.ids.request_hash)
ACTUAL_WORKER = "shadow.actual.worker"
DECISION_WORKER = "shadow.decision.worker"
AGREE = "shadow.agree"
LANE = "shadow.lane"
FINISH_REASON = "shadow.finish.reason"
PROMPT_KEY = "shadow.prompt.key"  # a hash, never the prompt
CANDIDATES = "shadow.candidates.count"
POOL_SIZE = "shadow.pool.size"
DECISIONS = "shadow.decisions.count"
HELD = "shadow.admission.held"
MODE_FROM = "shadow.mode.from"
MODE_TO = "shadow.mode.to"
MODE_REASON = "shadow.mode.reason"
CANARY_STEP = "shadow.canary.step"
CANARY_FRACTION = "shadow.canary.fraction"
CANARY_VERDICT = "shadow.canary.verdict"
CANARY_REASON = "shadow.canary.reason"
SOURCE = "shadow.source"
# the active proxy's dispatch rounds and admissions
POLICY = "shadow.policy"
MODE = "shadow.mode"  # effective mode(s) of the requests a round placed: active, fallback
FREE_SLOTS = "shadow.free_slots.count"
ROUND_DECISION_SECONDS = "shadow.round.decision_seconds"
ROUND_STAGE1_SECONDS = "shadow.round.stage1_seconds"
ROUND_STAGE2_SECONDS = "shadow.round.stage2_seconds"
ROUND_BYPASS = "shadow.round.bypass"
POOL_WAIT_SECONDS = "shadow.pool.wait_seconds"
ADMISSION_SCORE = "shadow.admission.score"  # BR-0 F-score of the placement over the round's loads
WORKER_LOAD = "shadow.worker.load_tokens"  # the chosen worker's KV-token load before the placement
# the active proxy's upstream calls (CLIENT spans) and the taps' relayed requests (SERVER spans)
UPSTREAM_WORKER = "shadow.upstream.worker"  # the prefiller, decode worker or router called
UPSTREAM_LEG = "shadow.upstream.leg"  # prefill, decode, router
TAP_NAME = "shadow.tap.name"
TAP_ROLE = "shadow.tap.role"  # prefill, decode, front (a tap in front of the router)
TAP_END = "shadow.tap.end"  # the end as the analysis judged it: complete, client_cancel, upstream_cut

# gen_ai.* (OpenTelemetry GenAI semantic conventions, development status)
GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
GEN_AI_RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
