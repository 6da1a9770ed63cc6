"""The split plan: the table reference, lancedb's permutation and the per-index plan, and
the sources a view gets its plan from."""
