"""Imported first in the fork server that starts DataLoader workers (``workers.PRELOAD``).

Lance warns at every fork of a process that imported it ("lance is not fork-safe ... use
spawn or forkserver"). The fork server is that forkserver: it imports Lance to start
workers fast, but never opens a dataset, so its forks are safe, and the warning would tell
the user to do what lance_ray already does.
"""

import warnings

warnings.filterwarnings("ignore", message="lance is not fork-safe", category=UserWarning)
