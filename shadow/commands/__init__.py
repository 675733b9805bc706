"""Sub-commands of the `shadow` CLI; each module has `register(subparsers)`."""
