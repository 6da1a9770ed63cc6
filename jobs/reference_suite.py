"""Run lancedb's own test suite for ``lancedb.streaming`` against lance_ray, unchanged.

    python -m jobs.reference_suite LANCEDB_CHECKOUT [--commit REV ...]

``LANCEDB_CHECKOUT`` is a git clone of https://github.com/lancedb/lancedb. For each commit
(default: HEAD) the suite file ``python/python/tests/test_elastic_dataloader.py`` and its
``utils.py`` are copied out of git into a scratch folder and run twice with pytest: once
against the installed ``lancedb.streaming`` (the reference), once with ``lancedb.streaming``
resolved to lance_ray (its ``StreamingDataset``, ``StreamingDataLoader`` and
``merge_state_dicts``; every other module attribute stays the reference's, so tests that
patch the reference's module internals still find them). It prints, per commit, how many of
the tests that pass on the reference pass on lance_ray, and the names of the others.
Not part of ``make test``: it needs the lancedb repository, which CI does not fetch.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

SUITE = "python/python/tests/test_elastic_dataloader.py"
UTILS = "python/python/tests/utils.py"
# Loaded first by pytest in the scratch folder: swaps the public classes when asked to.
CONFTEST = '''
import os, sys, types
if os.environ.get("LANCE_RAY_AS_REFERENCE") == "1":
    import lancedb, lance_ray
    import lancedb.streaming as reference
    alias = types.ModuleType("lancedb.streaming")
    alias.__dict__.update({k: v for k, v in vars(reference).items() if not k.startswith("__")})
    for name in ("StreamingDataset", "StreamingDataLoader", "merge_state_dicts"):
        setattr(alias, name, getattr(lance_ray, name))
    sys.modules["lancedb.streaming"] = alias
    lancedb.streaming = alias
'''


def outcomes(folder: Path, *, lance_ray: bool) -> dict[str, bool]:
    """Test id -> passed, for one pytest run of the suite in ``folder``."""
    env = {**os.environ, "LANCE_RAY_AS_REFERENCE": "1" if lance_ray else "0"}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider",
         "test_elastic_dataloader.py"],
        cwd=folder, env=env, capture_output=True, text=True, check=False)
    got = {m.group(2): m.group(1) == "PASSED" for m in
           re.finditer(r"^(PASSED|FAILED|ERROR) test_elastic_dataloader.py::(\S+)",
                       run.stdout, re.MULTILINE)}
    if not got:
        raise RuntimeError(f"pytest ran no test in {folder}:\n{run.stdout[-2000:]}"
                           f"{run.stderr[-2000:]}")
    return got


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkout", type=Path, help="a git clone of lancedb/lancedb")
    p.add_argument("--commit", action="append", default=None,
                   help="a commit of that clone (repeat for several; default HEAD)")
    args = p.parse_args()
    for commit in args.commit or ["HEAD"]:
        with tempfile.TemporaryDirectory(prefix="lance_ray_reference_suite_") as tmp:
            folder = Path(tmp)
            for path in (SUITE, UTILS):
                text = subprocess.run(["git", "-C", str(args.checkout), "show",
                                       f"{commit}:{path}"], capture_output=True, text=True,
                                      check=True).stdout
                (folder / Path(path).name).write_text(text)
            (folder / "conftest.py").write_text(CONFTEST)
            reference = outcomes(folder, lance_ray=False)
            ours = outcomes(folder, lance_ray=True)
        passing = [t for t, ok in reference.items() if ok]
        missed = [t for t in passing if not ours.get(t, False)]
        print(f"{commit}: {len(reference)} tests, {len(passing)} pass on lancedb.streaming; "
              f"{len(passing) - len(missed)} of those pass on lance_ray")
        for name in missed:
            print(f"  not on lance_ray: {name}")


if __name__ == "__main__":
    main()
