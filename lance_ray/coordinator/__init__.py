"""The coordinator actor: the split plan and the merged progress of every rank, in one
place."""
