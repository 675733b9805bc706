"""Small shared utilities of the ground floor: listening sockets (`net`), loopback and bearer
checks (`security`), child processes (`procs`), finding executables (`tools`)."""
