"""The command-line interface on real files: checkpoints of real runs, a real table, a live
coordinator on the two-node cluster. Bad input must be one line on stderr and exit code 2."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

import lance_ray
from lance_ray.cli import PNG_MAGIC, main, summarize_state
from lance_ray.state.format import PlanIdentity, make_state
from lance_ray.state.jsonio import load_state, save_state
from lance_ray.state.merge import merge_state_dicts

NUM_SPLITS = 8
BATCH = 16


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """``main(argv)`` in-process: (exit code, stdout, stderr)."""
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def dataset(table, *, rank: int = 0, world_size: int = 1, **kw) -> lance_ray.StreamingDataset:
    return lance_ray.StreamingDataset(table, num_splits=NUM_SPLITS, rank=rank,
                                      world_size=world_size, reader="local", **kw)


def rows_of(batch):
    return batch.to_pylist()


def state_after_one_batch(table, *, rank: int = 0, world_size: int = 1,
                          lockstep: bool = True) -> dict:
    # Dropping failed rows makes a rank's progress say nothing about the other ranks'.
    kw = {} if lockstep else {"transform": rows_of, "on_transform_error": "skip"}
    ds = dataset(table, rank=rank, world_size=world_size, **kw)
    next(ds.iter_batches(BATCH))
    return ds.state_dict()


@pytest.fixture(scope="module")
def rank_files(table_1k, tmp_path_factory) -> list[Path]:
    """The state files of both ranks of a 2-rank run, saved after one batch each."""
    root = tmp_path_factory.mktemp("cli_states")
    paths = []
    for rank in range(2):
        path = root / f"rank{rank}.json"
        save_state(path, state_after_one_batch(table_1k, rank=rank, world_size=2,
                                               lockstep=False))
        paths.append(path)
    return paths


# ----------------------------------------------------------------------- inspect


def test_inspect_json_of_one_ranks_state_says_it_must_be_merged_first(capsys, rank_files,
                                                                        table_1k):
    code, out, err = run(capsys, "inspect", str(rank_files[0]), "--json")
    assert (code, err) == (0, "")
    s = json.loads(out)
    ident = dataset(table_1k).identity
    assert (s["kind"], s["rank"], s["world_size"], s["must_merge"]) == ("rank", 0, 2, True)
    assert s["owned_splits"] == [0, 1, 2, 3]
    assert s["resumable_world_sizes"] == []
    assert "merge" in s["resume"]
    assert (s["epoch"], s["shuffle_seed"], s["num_splits"], s["global_step"]) == (0, 0, 8, 1)
    assert s["table_version"] == table_1k.version
    assert s["plan_fingerprint"] == ident.plan_fingerprint
    assert s["split_len"] == 125 and s["epoch_rows"] == 1000
    # 16 samples round-robin over the 4 owned splits; the others hold the zero lower bound.
    assert s["samples_consumed_per_split"] == [4, 4, 4, 4, 0, 0, 0, 0]
    assert s["owned_consumed"] == s["total_consumed"] == BATCH


def test_inspect_of_a_lockstep_rank_state_says_it_resumes_anywhere(capsys, table_1k,
                                                                    tmp_path):
    path = tmp_path / "rank1.json"
    save_state(path, state_after_one_batch(table_1k, rank=1, world_size=2))
    code, out, err = run(capsys, "inspect", str(path), "--json")
    s = json.loads(out)
    assert (code, s["kind"], s["must_merge"], s["owned_splits"]) == (0, "lockstep", False,
                                                                     None)
    # Every rank of a lockstep run writes this same state (identity included).
    assert state_after_one_batch(table_1k, rank=0, world_size=2) == load_state(path)
    assert s["resumable_world_sizes"] == [1, 2, 4, 8]
    assert s["samples_consumed_per_split"] == [4] * 8  # 16 samples per rank, 4 splits each
    code, out, _ = run(capsys, "inspect", str(path))
    assert code == 0 and "lockstep" in out


def test_inspect_text_and_png_of_a_one_rank_state(capsys, table_1k, tmp_path):
    path, png = tmp_path / "state.json", tmp_path / "progress.png"
    save_state(path, state_after_one_batch(table_1k))
    code, out, err = run(capsys, "inspect", str(path), "--png", str(png))
    assert (code, err) == (0, "")
    assert "complete" in out and "global_step    1" in out
    assert "0-7           2          2        125  1.6%" in out  # one compact row
    assert "16 of 1000 (1.6%)" in out
    assert "any of: 1, 2, 4, 8" in out
    assert png.read_bytes().startswith(PNG_MAGIC)


def test_inspect_png_of_a_rank_state_and_json_together(capsys, rank_files, tmp_path):
    png = tmp_path / "rank1.png"
    code, out, _ = run(capsys, "inspect", str(rank_files[1]), "--json", "--png", str(png))
    assert code == 0
    assert json.loads(out)["png"] == str(png)
    assert png.read_bytes().startswith(PNG_MAGIC)


def test_inspect_reference_format_state_without_lance_ray_key(capsys, tmp_path):
    path = tmp_path / "reference.json"
    path.write_text(json.dumps({"shuffle_seed": 3, "num_splits": 4, "epoch": 1,
                                "samples_consumed_per_split": [5, 5, 4, 4]}))
    code, out, err = run(capsys, "inspect", str(path), "--json")
    assert (code, err) == (0, "")
    s = json.loads(out)
    assert (s["format"], s["kind"], s["global_step"], s["table_version"]) == (
        "lancedb.streaming", "unknown", None, None)
    assert s["positions_consumed_per_split"] == [5, 5, 4, 4]
    assert s["total_consumed"] == 18
    assert s["resumable_world_sizes"] == [1, 2, 4]
    code, out, _ = run(capsys, "inspect", str(path))
    assert code == 0 and "reference" in out and "unknown" in out


def test_inspect_table_stays_compact_for_many_splits(capsys, tmp_path):
    ident = PlanIdentity(num_splits=600, shuffle_seed=1, epoch=0, split_len=5, table_version=2,
                         plan_fingerprint="f" * 16, shuffle=True, filter=None,
                         shuffle_clump_size=None)
    counts = [k % 6 for k in range(600)]  # no two neighbours alike
    path = _write(tmp_path / "many.json", "")
    save_state(path, make_state(ident, counts, counts, world_size=1, rank=None, global_step=3))
    code, out, _ = run(capsys, "inspect", path)
    assert code == 0 and "(600 splits in 6 groups; --all prints every split)" in out
    assert len(out.splitlines()) < 40
    code, out, _ = run(capsys, "inspect", path, "--all")
    assert code == 0 and len(out.splitlines()) > 600


# ----------------------------------------------------------------------- plan


def test_plan_reports_what_the_dataset_reads(capsys, table_1k):
    uri = table_1k.to_lance().uri
    code, out, err = run(capsys, "plan", uri, "--num-splits", "6", "--json")
    assert (code, err) == (0, "")
    p = json.loads(out)
    assert (p["rows"], p["split_len"], p["dropped_rows"]) == (1000, 166, 4)
    assert p["valid_world_sizes"] == [1, 2, 3, 6]
    assert p["table_version"] == table_1k.version
    ds = lance_ray.StreamingDataset(table_1k, num_splits=6, reader="local")
    assert p["plan_fingerprint"] == ds.identity.plan_fingerprint
    assert p["clumps"] is None


def test_plan_with_filter_and_clumps(capsys, table_1k):
    uri = table_1k.to_lance().uri
    argv = ["plan", uri, "--num-splits", "4", "--filter", "id < 503", "--clump-size", "10",
            "--shuffle-seed", "7", "--epoch", "2"]
    code, out, _ = run(capsys, *argv, "--json")
    assert code == 0
    p = json.loads(out)
    assert (p["rows"], p["split_len"], p["dropped_rows"]) == (503, 125, 3)
    c = p["clumps"]
    assert (c["clumps"], c["rows_per_clump"], c["last_clump_rows"]) == (51, 10, 3)
    assert c["runs_in_plan"] >= c["clumps_in_plan"] >= 50
    ds = lance_ray.StreamingDataset(table_1k, num_splits=4, filter="id < 503",
                                    shuffle_clump_size=10, shuffle_seed=7, epoch=2,
                                    reader="local")
    assert p["plan_fingerprint"] == ds.identity.plan_fingerprint
    code, out, _ = run(capsys, *argv)
    assert code == 0
    assert "dropped tail  3 rows" in out and "51 of 10 rows, last one 3" in out


def test_plan_without_shuffle(capsys, table_1k):
    code, out, _ = run(capsys, "plan", table_1k.to_lance().uri, "--num-splits", "8",
                       "--no-shuffle")
    assert code == 0 and "sequential" in out and "1, 2, 4, 8" in out


def test_plan_in_index_mode_reports_the_fingerprint_the_dataset_checks(capsys, table_1k):
    code, out, err = run(capsys, "plan", table_1k.to_lance().uri, "--num-splits", "6",
                         "--plan", "index", "--clump-size", "8", "--json")
    assert (code, err) == (0, "")
    p = json.loads(out)
    assert (p["plan"], p["split_len"], p["dropped_rows"]) == ("index", 166, 4)
    ds = lance_ray.StreamingDataset(table_1k, num_splits=6, shuffle_clump_size=8,
                                    plan="index", reader="local")
    assert p["plan_fingerprint"] == ds.identity.plan_fingerprint


def test_inspect_names_the_plan_mode_a_state_needs(capsys, table_1k, tmp_path):
    ds = lance_ray.StreamingDataset(table_1k, num_splits=4, plan="index", reader="local")
    next(ds.iter_batches(8))
    save_state(tmp_path / "s.json", ds.state_dict())
    code, out, _ = run(capsys, "inspect", str(tmp_path / "s.json"))
    assert code == 0 and "plan='index'" in out, out


# ----------------------------------------------------------------------- merge


def test_merge_two_rank_states_into_one_that_resumes_anywhere(capsys, rank_files, tmp_path):
    out_path = tmp_path / "merged.json"
    code, out, err = run(capsys, "merge", *map(str, rank_files), "-o", str(out_path))
    assert (code, err) == (0, "")
    assert str(out_path) in out
    merged = load_state(out_path)
    assert merged == merge_state_dicts([load_state(p) for p in rank_files])
    assert merged["samples_consumed_per_split"] == [4] * NUM_SPLITS
    # Without -o the merged state goes to stdout.
    code, out, _ = run(capsys, "merge", *map(str, rank_files))
    assert code == 0 and json.loads(out) == merged
    code, out, _ = run(capsys, "inspect", str(out_path), "--json")
    s = json.loads(out)
    assert (s["kind"], s["must_merge"], s["total_consumed"]) == ("merged", False, 2 * BATCH)
    assert s["resumable_world_sizes"] == [1, 2, 4, 8]


def _rank_states(make) -> list[dict]:
    """Each of two ranks' states after one batch of ``make(rank)``'s iteration."""
    states = []
    for rank in range(2):
        ds = make(rank)
        next(ds.iter_batches(2))
        states.append(ds.state_dict())
    return states


def _merge_via_cli(capsys, states: list[dict], tmp_path: Path) -> tuple[str, dict]:
    paths = []
    for rank, state in enumerate(states):
        save_state(tmp_path / f"r{rank}.json", state)
        paths.append(str(tmp_path / f"r{rank}.json"))
    code, out, err = run(capsys, "merge", *paths, "-o", str(tmp_path / "m.json"), "--json")
    assert (code, err) == (0, "")
    merged = load_state(tmp_path / "m.json")
    assert merged == json.loads(json.dumps(merge_state_dicts(states)))  # JSON keys are str
    return out, merged


def test_merge_packed_rank_states_as_the_library_does(capsys, token_table, tmp_path):
    table, _ = token_table
    states = _rank_states(lambda rank: lance_ray.StreamingDataset(
        table, num_splits=4, rank=rank, world_size=2, columns=["tokens"], pack_sequences=8,
        eos_id=0, pad_id=1, blocks_per_epoch="auto", reader="local"))
    out, merged = _merge_via_cli(capsys, states, tmp_path)
    assert json.loads(out)["total_consumed"] == sum(merged["samples_consumed_per_split"])
    code, _, err = run(capsys, "inspect", str(tmp_path / "m.json"))
    assert code == 2 and "packed state" in err


def test_merge_mixture_rank_states_and_inspect_refuses_them_by_name(capsys, table_factory,
                                                                     tmp_path):
    tables = [table_factory(64), table_factory(96)]
    states = _rank_states(lambda rank: lance_ray.MixtureDataset(
        [lance_ray.Source(t, weight=w) for t, w in zip(tables, (1, 2))], num_splits=4,
        rank=rank, world_size=2, columns=["id"], reader="local"))
    out, merged = _merge_via_cli(capsys, states, tmp_path)
    report = json.loads(out)
    assert report["total_consumed"] == sum(sum(s["samples_consumed_per_split"])
                                           for s in merged["sources"]) == 4
    assert report["num_splits"] == 4  # the mixture's (every source's), not their sum
    code, _, err = run(capsys, "inspect", str(tmp_path / "m.json"))
    assert code == 2 and "MixtureDataset state" in err and err.count("\n") == 1


def test_merge_onto_a_directory_names_the_output(capsys, rank_files, tmp_path):
    code, _, err = run(capsys, "merge", *map(str, rank_files), "-o", str(tmp_path))
    assert code == 2 and repr(str(tmp_path)) in err and ".tmp" not in err


def test_plan_of_index_mode_with_clumps_does_not_say_they_have_no_effect(capsys, table_1k):
    code, out, _ = run(capsys, "plan", table_1k.to_lance().uri, "--num-splits", "4",
                       "--plan", "index", "--clump-size", "8")
    assert code == 0 and "no effect" not in out and "of 8 rows" in out


# ----------------------------------------------------------------------- bad input


def test_plan_of_a_remote_table_uri_names_it_and_the_way_to_read_it(capsys):
    code, _, err = run(capsys, "plan", "db://mydb/train", "--num-splits", "4")
    assert code == 2 and "remote LanceDB table" in err and "connection_factory" in err, err


def _write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def _other_step(rank_files: list[Path], tmp_path: Path) -> str:
    """Rank 1's state of the same plan, saved one step later than rank 0's."""
    ident = PlanIdentity(**{k: v for k, v in summarize_state(load_state(rank_files[1])).items()
                            if k in PlanIdentity.__dataclass_fields__})
    state = make_state(ident, [0] * 4 + [8] * 4, [0] * 4 + [8] * 4, world_size=2, rank=1,
                       global_step=2)
    save_state(tmp_path / "late.json", state)
    return str(tmp_path / "late.json")


BAD_INPUT = {
    "missing file": (lambda t, d, r: ["inspect", str(d / "nope.json")], "No such file"),
    "bad json": (lambda t, d, r: ["inspect", _write(d / "bad.json", "{not json")],
                 "not valid JSON"),
    "not a dict": (lambda t, d, r: ["inspect", _write(d / "list.json", "[1, 2]")],
                   "must be a dict"),
    "missing field": (lambda t, d, r: ["inspect", _write(d / "f.json", '{"epoch": 0}')],
                      "missing required field"),
    "truncated counts": (
        lambda t, d, r: ["inspect", _write(d / "short.json", json.dumps(
            {**load_state(r[0]), "samples_consumed_per_split": [1, 2]}))],
        "has 2 entries but num_splits is 8"),
    "one rank only": (lambda t, d, r: ["merge", str(r[0])], "do not cover splits [4, 5, 6, 7]"),
    "different steps": (lambda t, d, r: ["merge", str(r[0]), _other_step(r, d)],
                        "different global steps"),
    "invalid state in merge": (
        lambda t, d, r: ["merge", str(r[0]), _write(d / "bad.json", "{")], "not valid JSON"),
    "no table": (lambda t, d, r: ["plan", str(d / "none.lance"), "--num-splits", "2"],
                 "no Lance dataset"),
    "bad filter": (lambda t, d, r: ["plan", t.to_lance().uri, "--num-splits", "2",
                                    "--filter", "id >"], "not a valid SQL predicate"),
    "too many splits": (lambda t, d, r: ["plan", t.to_lance().uri, "--num-splits", "2000"],
                        "larger than the number of rows"),
    "unreachable cluster": (lambda t, d, r: ["status", "x", "--address", "127.0.0.1:1"],
                            "cannot reach a Ray cluster"),
    "usage": (lambda t, d, r: ["plan", t.to_lance().uri], "--num-splits"),
    "no command": (lambda t, d, r: [], "required"),
}


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_is_one_line_on_stderr_and_exit_code_2(case, capsys, table_1k, tmp_path,
                                                         rank_files):
    make_argv, expected = BAD_INPUT[case]
    code, out, err = run(capsys, *make_argv(table_1k, tmp_path, rank_files))
    assert code == 2
    assert out == ""
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert "error" in err and expected in err
    assert "Traceback" not in err


# ----------------------------------------------------------------------- status


def test_status_of_a_live_coordinator(capsys, ray_session, table_1k, tmp_path):
    from lance_ray.driver.handle import Coordinator

    coordinator = Coordinator.create(table_1k, "cli_status", storage_path=str(tmp_path),
                                     world_size=2, num_splits=NUM_SPLITS)
    try:
        views = [coordinator.view(r, 2, reader="local").iter_batches(BATCH // 2)
                 for r in range(2)]
        for v in views:
            next(v)
        deadline = time.monotonic() + 20
        while coordinator.status()["sealed_step"] < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        while len(coordinator.status()["ranks"]) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        code, out, err = run(capsys, "status", "cli_status", "--json")
        assert (code, err) == (0, "")
        s = json.loads(out)
        assert (s["name"], s["namespace"], s["epoch"], s["world_size"]) == (
            "cli_status", "lance_ray", 0, 2)
        assert (s["sealed_step"], s["sealed_rows"], s["epoch_rows"]) == (1, BATCH, 1000)
        assert s["ranks"] == {"0": {"step": 1, "rows": 8}, "1": {"step": 1, "rows": 8}}
        code, out, _ = run(capsys, "status", "cli_status")
        assert code == 0
        assert "sealed rows    16 / 1000 (1.6%)" in out
        assert "2 (8 splits)" in out
        code, _, err = run(capsys, "status", "no_such_coordinator")
        assert code == 2 and "no coordinator named 'no_such_coordinator'" in err
    finally:
        with contextlib.suppress(Exception):
            coordinator.kill()


def test_status_of_a_packed_run_counts_its_sealed_blocks(capsys):
    from lance_ray.cli.status import print_status

    print_status({"name": "lm", "namespace": "lance_ray", "epoch": 0, "world_size": 2,
                  "num_splits": 4, "sealed_step": 3, "sealed_rows": 9, "epoch_rows": 60,
                  "rows_per_s": 1.0, "pending_steps": [], "ranks": {},
                  "packed": {"block_len": 6, "sealed_blocks": 12, "epoch_blocks": 32}})
    assert "sealed blocks  12 / 32 of 6 tokens (37.5%)" in capsys.readouterr().out


# ----------------------------------------------------------------------- entry points


def test_python_m_lance_ray_help():
    done = subprocess.run([sys.executable, "-m", "lance_ray", "--help"], capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    for command in ("inspect", "plan", "status", "merge"):
        assert command in done.stdout
    assert done.stdout.startswith("usage: python -m lance_ray")


def test_traceback_goes_after_the_command_too(capsys, tmp_path):
    from lance_ray.cli.main import build_parser

    parser = build_parser()
    for argv in (["--traceback", "inspect", "x"], ["inspect", "x", "--traceback"]):
        assert parser.parse_args(argv).traceback
    assert not parser.parse_args(["inspect", "x"]).traceback


def test_output_cut_short_by_its_reader_ends_quietly(tmp_path):
    # `... | head -1`: the reader closes the pipe after one line, and far more follows.
    splits = 20_000
    ident = PlanIdentity(num_splits=splits, shuffle_seed=1, epoch=0, split_len=5,
                         table_version=2, plan_fingerprint="f" * 16, shuffle=True,
                         shuffle_clump_size=None, filter=None)
    path = tmp_path / "wide.json"
    save_state(path, make_state(ident, [1] * splits, [1] * splits, world_size=1, rank=None,
                                global_step=1))
    cli = subprocess.Popen([sys.executable, "-m", "lance_ray", "inspect", str(path), "--all"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    head = subprocess.run(["head", "-n", "1"], stdin=cli.stdout, capture_output=True)
    assert cli.stdout is not None and cli.stderr is not None
    cli.stdout.close()
    err = cli.stderr.read().decode()
    assert cli.wait(timeout=120) == 0 and head.stdout and "Broken pipe" not in err, err
