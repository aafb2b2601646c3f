"""Speed measurements; run each as `python -m benchmarks.NAME` from the repo root."""
