"""The examples cannot drift: every ```python block of README.md and docs/*.md runs, the
blocks of one page in order in one namespace, in a fresh working directory (a page that
calls ``ray.init()`` connects to the session's Ray cluster; the others run with no
cluster, as on a laptop); and every
``lance_ray`` import the pages show imports.

A block fenced ```python no-run is skipped. It must stay rare (at most one python block in
four), and the paragraph before it must say why it is not run ("not run ...")."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
MAX_README_LINES = 400
PAGE_TIMEOUT_S = 240


def blocks(page: Path) -> list[tuple[str, int, str, str]]:
    """``(info, first line, code, the prose before it)`` of every fenced block of ``page``."""
    out, lines = [], page.read_text().splitlines()
    i, prose_start = 0, 0
    while i < len(lines):
        m = re.match(r"^(\s*)```(.*)$", lines[i])
        if not m:
            i += 1
            continue
        indent, info, start = len(m.group(1)), m.group(2).strip(), i + 1
        j = start
        while j < len(lines) and not re.match(r"^\s*```\s*$", lines[j]):
            j += 1
        code = textwrap.dedent("\n".join(ln[indent:] if ln[:indent].isspace() else ln
                                         for ln in lines[start:j]))
        out.append((info, start + 1, code, "\n".join(lines[prose_start:i])))
        i = prose_start = j + 1
    return out


def python_blocks(page: Path) -> list[tuple[str, int, str, str]]:
    return [b for b in blocks(page) if b[0].split()[:1] == ["python"]]


def runnable(page: Path) -> list[tuple[int, str]]:
    return [(line, code) for info, line, code, _ in python_blocks(page)
            if "no-run" not in info.split()]


RUNNER = r"""
import sys, json, traceback
page, blocks = sys.argv[1], json.loads(sys.stdin.read())
namespace = {"__name__": "__main__"}
for line, code in blocks:
    try:
        exec(compile("\n" * (line - 1) + code, page, "exec"), namespace)
    except BaseException:
        traceback.print_exc()
        print(f"FAILED: the block at {page}:{line}", file=sys.stderr)
        sys.exit(1)
print(f"ran {len(blocks)} block(s) of {page}")
"""


def test_the_readme_is_read_in_five_minutes() -> None:
    n = len((REPO / "README.md").read_text().splitlines())
    assert n <= MAX_README_LINES, f"README.md has {n} lines: move detail into docs/"


def test_pages_with_examples_are_found() -> None:
    names = {p.name for p in PAGES if runnable(p)}
    assert {"README.md", "checkpoints.md", "coordinator.md"} <= names, names


@pytest.mark.parametrize("page", [p for p in PAGES if runnable(p)],
                         ids=lambda p: str(p.relative_to(REPO)))
def test_every_python_block_of_the_page_runs(page: Path, ray_cluster, tmp_path) -> None:
    import json

    # A page that calls ray.init() connects to the session's cluster; the others run as on
    # a laptop with no cluster (lance_ray then reads in-process).
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    if any("ray.init(" in code for _, code in runnable(page)):
        env["RAY_ADDRESS"] = ray_cluster.address
    done = subprocess.run([sys.executable, "-c", RUNNER, str(page.relative_to(REPO))],
                          input=json.dumps(runnable(page)), cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=PAGE_TIMEOUT_S)
    assert done.returncode == 0, (done.stdout[-3000:] + done.stderr[-6000:])


def test_no_run_blocks_are_rare_and_say_why() -> None:
    all_python = [(p, b) for p in PAGES for b in python_blocks(p)]
    skipped = [(p, b) for p, b in all_python if "no-run" in b[0].split()]
    assert len(skipped) * 4 <= len(all_python), (
        f"{len(skipped)} of {len(all_python)} python blocks are no-run: make them runnable "
        "against a small generated table and a local Ray")
    silent = [f"{p.relative_to(REPO)}:{b[1]}" for p, b in skipped
              if "not run" not in b[3].split("\n\n")[-1].lower()
              and "not run" not in b[3].lower()[-400:]]
    assert silent == [], "say why a no-run block is not run, in the paragraph before it"


IMPORT = re.compile(r"^\s*(from lance_ray[\w.]* import [^#(]+|import lance_ray[\w.]*)")


def test_every_lance_ray_import_the_pages_show_imports() -> None:
    lines = sorted({m.group(1).strip().rstrip("\\").strip() for p in PAGES
                    for _, _, code, _ in blocks(p) for ln in code.splitlines()
                    if (m := IMPORT.match(ln))})
    assert any("Coordinator" in ln for ln in lines), lines
    script = "\n".join(f"try:\n    {ln}\nexcept Exception as e:\n    print({ln!r}, repr(e))"
                       for ln in lines)
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "", done.stdout + done.stderr


def test_the_performance_page_and_the_readme_table_are_rendered_from_the_bench_json(
        tmp_path) -> None:
    from jobs.bench.performance import readme_table, render

    assert (REPO / "docs" / "performance.md").read_text() == render(REPO / "docs" / "bench"), (
        "docs/bench changed: run python -m jobs.bench.performance")
    import json

    table = readme_table(json.loads((REPO / "docs" / "bench" / "throughput.json").read_text()))
    assert table in (REPO / "README.md").read_text(), "run python -m jobs.bench.performance"


def test_bench_results_name_their_machine_command_and_date() -> None:
    import json

    for path in sorted((REPO / "docs" / "bench").glob("*.json")):
        r = json.loads(path.read_text())
        assert r["name"] == path.stem and r["machine"] and r["command"].startswith("python -m ")
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", r["date"]), path
        assert all(len(row) == len(r["columns"]) for row in r["rows"]), path
