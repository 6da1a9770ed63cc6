"""lance_ray: deterministic, resumable, elastic training-data streaming over Lance tables.

Not to be confused with the unrelated PyPI package ``lance-ray``, which installs a module of
the same name (see docs/troubleshooting.md, "Name clash"). This distribution is
``lance-ray-streaming``.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# Imported on first use, so that `python -m lance_ray inspect ...` does not pay for torch.
_EXPORTS = {
    "StreamingDataset": "view.dataset",
    "StreamingDataLoader": "view.loader",
    "Coordinator": "driver.handle",
    "MixtureDataset": "view.mixture",
    "Source": "view.mixture",
    "ReportPolicy": "state.reporting",
    "PlanSpec": "plan.splits",
    "SplitPlan": "plan.splits",
    "valid_world_sizes": "topology",
    "load_state": "state.jsonio",
    "merge_state_dicts": "state.merge",
    "save_state": "state.jsonio",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'lance_ray' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value
