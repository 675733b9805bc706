"""Passive capture: the router↔worker traffic read off an interface, out of the path (`shadow capture`).

`packets` reads TCP segments (AF_PACKET), `reassembly` puts one direction of a connection back in
order, `passive` frames HTTP/1.1 over both and hands the analysis the same items a tap would.
"""
