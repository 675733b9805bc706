"""The data plane: the process in the traffic's path (`shadow tap`, or the taps `shadow serve` starts).

The taps (`tap`: an HTTP/1.1 reverse proxy per worker, `http1`: its llhttp framing and limits,
`usage_inject`), the relay that runs them on their own event loop and hands copies to the analysis
(`relay`, `channel`'s sink, `dropqueue` when embedded), the supervisor that holds the listening
sockets across relay restarts (`supervisor`, `rundir`), and the relay's own `/metrics`
(`relay_metrics`). Nothing here imports the analysis (`shadow.mirror`): the wire between the two is
`shadow.contracts` (`frames`, `handshake`, `tapwire`).
"""
