"""The ground floor's contracts: fleet events (and their JSON Schema), the mode/route contract
between the active proxy and its controller, the wire between the data plane and the analysis
(`tapwire`), the report's types (`report`), and label value sets several rooms share.

Imports nothing else from shadow."""
