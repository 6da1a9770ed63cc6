"""Checkpoint state: its format and checks, merges, JSON I/O, and the pure ledger of every
rank's progress that the coordinator keeps."""
