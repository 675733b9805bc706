"""Live shadow: counterfactual lanes beside a running router (`shadow serve`).

In-process use (tests, the demo)::

    from shadow.live import ServeConfig, ServeService
    from shadow.mirror.service import TapConfig

    svc = ServeService(ServeConfig(tap=TapConfig(upstreams={"d0": url0, "d1": url1}, slots=64)))
    ready = await svc.start()        # {"taps": {...}, "api": url}; same as the CLI's ready line
    ...                              # GET {api}/v1/report[?drain=1], {api}/metrics
    await svc.stop()

`/v1/report`: {"lanes": {LABEL: {avg_spread_tokens, avg_imbalance_tokens, barrier_idle_fraction,
throughput_tokens_per_s, tpot_s, steps, requests_finished, lookahead_stalls, lag_s,
agreement_rate, worker_loads, worker_active, ...}}, "step_model": {a_s_per_token, b_s, r2, samples,
quality, figures_use, ...}, "fidelity": {load_rel_error, ...}, "workers": [...], "slots": B,
"events": {enqueued, processed, dropped, ...}, "requests": {...}, "warnings": [...]}. Lane
`actual` is the router's real placements; the others carry `shadow replay`'s labels.
"""

from shadow.live.lanes import LiveLanes
from shadow.live.service import ServeConfig, ServeService

__all__ = ["LiveLanes", "ServeConfig", "ServeService"]
