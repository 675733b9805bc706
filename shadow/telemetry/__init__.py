"""Telemetry: the metric catalogue, tracing, dashboards and alert-rule helpers.

Prometheus metrics stay native (each exporter declares its families and owns its collector on a
registry passed in); this package checks and documents them (`catalogue`), traces mirrored
requests (`tracing`), and builds the Grafana dashboards and Kubernetes manifests that read them.
"""
