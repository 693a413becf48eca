"""Observability: JSON-lines logs and metrics, Prometheus exporter, reports."""
