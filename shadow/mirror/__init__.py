"""The analysis: the process beside the traffic (`shadow serve`'s mirror side), never in its path.

It attaches to the data plane's relays (`attach`, `channel_reader`, `relayview`) or embeds their
taps, turns the copied bytes into events (`analyzer`, `keys`), folds them with the event API's
(`api`, `hub`, `bounds`) into the mirrored fleet state (`state`), reconciles that against the
workers' own `/metrics` (`reconcile`), records sessions (`recording`) and exports `/metrics`
(`metrics`). `service` assembles it. The data plane it reads is `shadow.dataplane`; passive capture,
the other source, is `shadow.capture`.
"""
