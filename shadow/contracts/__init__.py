"""The ground floor's contracts: fleet events (and their JSON Schema), the mode/route contract
between the active proxy and its controller, and label value sets several rooms share.

Imports nothing else from shadow."""
