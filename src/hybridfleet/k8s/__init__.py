"""Kubernetes / Kubeflow manifests rendered from a job file (no cluster access needed)."""
