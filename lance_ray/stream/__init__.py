"""Pure stream arithmetic: each rank's closed-form order, its cursor (progress, commit,
rebase), and the reference's survivor order."""
