"""asv-style benchmarks for kvcache (``python -m kvcache bench`` runs the same workloads)."""
