"""Plain JSON files written atomically and read without ever unpickling."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


def write_json_atomic(path: str | os.PathLike[str], obj: Any, *, fsync: bool = True) -> None:
    """Write ``obj`` as JSON so that readers see the old file or the new one, never half.

    ``fsync=False`` still survives the writer's process dying (the rename is atomic); only
    a machine crash can then lose the newest file.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, sort_keys=True)
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_json(path: str | os.PathLike[str]) -> Any:
    """Parse a JSON file (never pickle), with an error that names the file."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        # Never fall back to unpickling: loading a pickle can run arbitrary code.
        raise ValueError(f"{os.fspath(path)!r} is not valid JSON: {e}") from e
