"""Entry points of the training stage: `icr data`, `icr train`, `icr evaluate`, `icr analyze` (each
imports its heavy modules when it runs), and the behaviour they share (support)."""
