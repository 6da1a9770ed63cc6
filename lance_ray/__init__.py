"""lance_ray: deterministic, resumable, elastic training-data streaming over Lance tables.

Not to be confused with the unrelated PyPI package ``lance-ray``, which installs a module of
the same name (see README, "Name clash"). This distribution is ``lance-ray-streaming``.
"""

from .dataset import StreamingDataset
from .loader import StreamingDataLoader
from .plan import PlanSpec, SplitPlan, valid_world_sizes
from .state import load_state, merge_state_dicts, save_state

__version__ = "0.1.0"

__all__ = [
    "PlanSpec",
    "SplitPlan",
    "StreamingDataLoader",
    "StreamingDataset",
    "load_state",
    "merge_state_dicts",
    "save_state",
    "valid_world_sizes",
]
