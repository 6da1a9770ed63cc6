"""Which incarnation of a coordinator actor this process is: its Ray actor id (stable
across restarts), and whether Ray restarted it after a crash (then it serves the same views
as the one that wrote its ledger) or a new job made it."""

from __future__ import annotations

import os


def restarted_by_ray() -> bool:
    """Whether this actor is a restart (by Ray, after a crash) of the one that wrote the
    ledger, rather than a new job's."""
    import ray

    return ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None \
        and ray.get_runtime_context().was_current_actor_reconstructed


def actor_id() -> str:
    """The actor's id (this process's pid outside an actor)."""
    import ray

    actor = ray.get_runtime_context().get_actor_id() if ray.is_initialized() else None
    return actor or f"pid{os.getpid()}"
