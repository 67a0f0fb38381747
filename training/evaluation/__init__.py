"""Evaluation: retrieval metrics for validation (retrieval), the full report of a checkpoint on a split
(checkpoint), threshold honesty on held-out captions (relevance), the metric kernels (metrics) and
the report plots (plots)."""
