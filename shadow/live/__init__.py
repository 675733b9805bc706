"""Live shadow: counterfactual lanes beside a running router (`LiveLanes`); `shadow serve`
assembles them with the mirror in `shadow.app.serve`.

`/v1/report`: {"lanes": {LABEL: {avg_spread_tokens, avg_imbalance_tokens, barrier_idle_fraction,
throughput_tokens_per_s, tpot_s, steps, requests_finished, lookahead_stalls, lag_s,
agreement_rate, worker_loads, worker_active, ...}}, "step_model": {a_s_per_token, b_s, r2, samples,
quality, figures_use, cost: {method, window_steps, oos_error_max, groups: {GROUP: {form, terms,
r2, oos_error, windows, host_wait_share, ...}}, not_identifiable}, ...}, "fidelity":
{load_rel_error, ...}, "workers": [...], "slots": B,
"events": {enqueued, processed, dropped, ...}, "requests": {...}, "warnings": [...]}. Lane
`actual` is the router's real placements; the others carry `shadow replay`'s labels.
"""

from shadow.live.lanes import LiveLanes

__all__ = ["LiveLanes"]
