"""The jobs refuse bad arguments and unusable clusters up front, with a message that says
what to change, instead of hanging or failing deep inside Ray Train. No Ray here: every
check must fire before a job connects to (or starts) a cluster."""

from __future__ import annotations

import argparse
import re
import shlex

import pytest

from jobs import elastic_resume, make_table, train_lm, train_mixture
from jobs import train as train_job
from jobs.args import check_run_sizes


class Connected(Exception):
    """A job went on to connect to Ray: the check under test did not refuse first."""


@pytest.fixture
def no_ray(monkeypatch):
    def refuse(*_a, **_k):
        raise Connected

    monkeypatch.setattr(train_job, "connect", refuse)
    monkeypatch.setattr(train_lm, "start_local_ray", refuse)
    monkeypatch.setattr(elastic_resume, "create_table", refuse)
    monkeypatch.setattr(elastic_resume.ray, "init", refuse)
    monkeypatch.setattr(train_mixture, "make_tables", refuse)


def usage_error(capsys, main, argv) -> str:
    """argparse's refusal: exit status 2 and the message on stderr."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


# --- worker resources -------------------------------------------------------------------

@pytest.mark.parametrize("resources, want", [({"CPU": 4.0}, {"CPU": 0.5}),
                                             ({"CPU": 2.0, "slot": 4.0}, {"slot": 1}),
                                             ({"slot": 8.0}, {"slot": 1})])
def test_workers_ask_for_slots_or_cpus_on_a_cluster_without_slots(monkeypatch, resources,
                                                                  want):
    monkeypatch.setattr(train_job.ray, "cluster_resources", lambda: resources)
    assert train_job.worker_resources(4) == want


def test_train_workers_that_would_leave_no_cpu_for_the_reads_are_refused(monkeypatch):
    # A local cluster of no worker nodes: its head's CPU, and no train slots.
    monkeypatch.setattr(train_job.ray, "cluster_resources", lambda: {"CPU": 1.0})
    with pytest.raises(SystemExit, match="leave no CPU for the reads.*resize 1"):
        train_job.worker_resources(2)


def test_a_cluster_with_too_few_slots_is_refused_not_run_on_cpus_that_starve_reads(
        monkeypatch):
    monkeypatch.setattr(train_job.ray, "cluster_resources", lambda: {"CPU": 3.0, "slot": 2.0})
    with pytest.raises(SystemExit) as e:
        train_job.worker_resources(4)
    msg = str(e.value.code)
    assert "4" in msg and "2 train slot" in msg and "cluster/local.sh resize 2" in msg, msg
    assert "--workers" in msg, msg


# --- jobs/train.py ----------------------------------------------------------------------

@pytest.mark.parametrize("flag", ["--checkpoint-every", "--workers", "--min-workers",
                                  "--num-splits", "--global-batch"])
@pytest.mark.parametrize("value", ["0", "-5", "x"])
def test_train_refuses_sizes_that_are_not_positive_integers(capsys, no_ray, flag, value):
    err = usage_error(capsys, train_job.main, [flag, value])
    assert flag in err and value in err, err


@pytest.mark.parametrize("sizes, match", [
    ((0, 8, 64), "--workers must be a positive integer, got 0"),
    (((-1, 2), 8, 64), "--min-workers must be a positive integer, got -1"),
    ((2, 0, 64), "--num-splits must be a positive integer, got 0"),
    ((2, 8, -64), "--global-batch must be a positive integer, got -64"),
])
def test_sizes_given_in_code_that_are_not_positive_are_refused_by_name(sizes, match):
    with pytest.raises(SystemExit, match=match):
        check_run_sizes(*sizes)


def test_train_refuses_min_workers_above_workers(no_ray):
    with pytest.raises(SystemExit) as e:
        train_job.main(["--min-workers", "4", "--workers", "2"])
    assert "--min-workers (4)" in str(e.value.code) and "--workers (2)" in str(e.value.code)


def test_train_refuses_world_sizes_that_do_not_divide_num_splits(no_ray):
    with pytest.raises(SystemExit, match="do not divide num_splits"):
        train_job.main(["--min-workers", "2", "--workers", "4"])  # 3 does not divide 8


def test_the_docstring_commands_parse_and_pass_the_size_checks(monkeypatch):
    """Every ``python -m jobs.train`` line of the module docstring gets as far as connecting."""
    monkeypatch.setattr(train_job, "connect", lambda *_: (_ for _ in ()).throw(Connected()))
    doc = train_job.__doc__.replace("\\\n", " ")  # one line a command
    lines = [ln.split("python -m jobs.train", 1)[1].split("#")[0].split()
             for ln in doc.splitlines() if "python -m jobs.train " in ln]
    assert len(lines) >= 4, lines
    for argv in lines:
        argv = [a.replace('"$PWD/', "").rstrip('"') for a in argv]
        with pytest.raises(Connected):
            train_job.main(argv)
    # A submitted job runs in a copy of the working dir: its paths must be absolute.
    submitted = [ln for ln in doc.splitlines() if "ray job submit" in ln]
    assert submitted and all(re.search(r"(?<!\$PWD/)\bruns/", ln) is None for ln in submitted)


def test_a_missing_table_names_the_database_and_how_to_create_it(tmp_path):
    db = str(tmp_path / "db")
    with pytest.raises(SystemExit) as e:
        train_job.open_table(db, "demo")
    msg = str(e.value.code)
    assert db in msg and "'demo'" in msg and "python -m jobs.make_table" in msg, msg


# --- jobs/make_table.py -----------------------------------------------------------------

@pytest.mark.parametrize("argv", [["--fragments", "0"], ["--rows", "-5"], ["--dim", "0"]])
def test_make_table_refuses_sizes_that_are_not_positive(capsys, tmp_path, argv):
    err = usage_error(capsys, make_table.main, ["--db", str(tmp_path / "db"), *argv])
    assert argv[0] in err, err
    assert not (tmp_path / "db").exists()


# --- jobs/elastic_resume.py -------------------------------------------------------------

@pytest.mark.parametrize("argv, match", [
    (["--num-splits", "6"], "do not divide num_splits"),       # world size 4 does not divide 6
    (["--global-batch", "60"], "not a multiple of num_splits"),
])
def test_elastic_resume_checks_its_sizes_before_making_a_table(no_ray, argv, match):
    with pytest.raises(SystemExit, match=match):
        elastic_resume.main(argv)


@pytest.mark.parametrize("argv", [["--global-batch", "0"], ["--num-splits", "-8"],
                                  ["--stop-step", "0"], ["--rows", "0"]])
def test_elastic_resume_refuses_sizes_that_are_not_positive(capsys, no_ray, argv):
    err = usage_error(capsys, elastic_resume.main, argv)
    assert argv[0] in err, err


# --- jobs/train_lm.py -------------------------------------------------------------------

@pytest.mark.parametrize("flag, value", [("--workers", "3"), ("--crash-at-step", "2"),
                                         ("--stop-at-step", "5")])
def test_train_lm_demo_refuses_flags_it_would_ignore(tmp_path, no_ray, flag, value):
    with pytest.raises(SystemExit) as e:
        train_lm.main(["--demo", "--db", str(tmp_path / "db"), flag, value])
    assert flag in str(e.value.code), e.value.code


def test_train_lm_demo_checks_its_world_sizes_against_num_splits(tmp_path, no_ray):
    with pytest.raises(SystemExit, match="do not divide num_splits"):
        train_lm.main(["--demo", "--db", str(tmp_path / "db"), "--num-splits", "6",
                       "--global-batch", "12"])


def test_train_lm_demo_forwards_the_run_settings_to_its_jobs(tmp_path, monkeypatch):
    import jobs.verify

    calls: list[list[str]] = []
    monkeypatch.setattr(train_lm, "start_local_ray", lambda: None)
    monkeypatch.setattr(train_job, "connect", lambda *_: None)
    monkeypatch.setattr(train_lm.make_table, "create_table",
                        lambda *_a, **_k: argparse.Namespace(count_rows=lambda: 0))
    monkeypatch.setattr(train_lm, "main", lambda argv: calls.append(argv) or {})
    monkeypatch.setattr(jobs.verify, "verify_run", lambda *_: (None, None))
    monkeypatch.setattr(jobs.verify, "print_proof", lambda *_a, **_k: True)
    args = train_lm.parser().parse_args([
        "--demo", "--db", str(tmp_path / "db"), "--storage-path", str(tmp_path / "s"),
        "--num-splits", "8", "--global-batch", "16", "--block-len", "32", "--vocab", "64",
        "--checkpoint-every", "2", "--seed", "3", "--blocks-per-epoch", "64",
        "--max-failures", "1"])
    train_lm.demo(args)
    assert len(calls) == 2
    for argv in calls:
        for flag, value in [("--num-splits", "8"), ("--global-batch", "16"),
                            ("--block-len", "32"), ("--vocab", "64"),
                            ("--checkpoint-every", "2"), ("--seed", "3"),
                            ("--blocks-per-epoch", "64"), ("--max-failures", "1")]:
            assert argv[argv.index(flag) + 1] == value, (flag, argv)


def test_train_lm_refuses_a_negative_blocks_per_epoch(capsys, no_ray):
    err = usage_error(capsys, train_lm.main, ["--blocks-per-epoch", "-8"])
    assert "--blocks-per-epoch" in err, err


@pytest.mark.parametrize("demo", [[], ["--demo"]])
def test_train_lm_refuses_blocks_per_epoch_that_splits_do_not_share(tmp_path, no_ray, demo):
    with pytest.raises(SystemExit, match=r"--blocks-per-epoch \(10\).*--num-splits \(4\)"):
        train_lm.main([*demo, "--db", str(tmp_path / "db"), "--blocks-per-epoch", "10"])


def test_a_resumed_lm_run_refuses_another_blocks_per_epoch(tmp_path):
    from lance_ray.storage import write_json_atomic

    args = train_lm.parser().parse_args(["--blocks-per-epoch", "16"])
    saved = {"reader": args.reader, "vocab": 256, "pack": {
        "num_splits": 4, "global_batch": 8, "block_len": 128, "blocks_per_epoch": 8}}
    write_json_atomic(tmp_path / "run.json", saved)
    with pytest.raises(SystemExit, match="'blocks_per_epoch': 8"):
        train_lm.run_spec(args, "unused", str(tmp_path))
    args.blocks_per_epoch = 0  # every token: the first job's count stands
    assert train_lm.run_spec(args, "unused", str(tmp_path)) == saved


# --- jobs/train_mixture.py --------------------------------------------------------------

@pytest.mark.parametrize("argv, match", [
    (["--workers", "3"], "--workers.*do not divide"), (["--then", "3"], "--then.*do not divide"),
    (["--global-batch", "2"], "not a multiple of num_splits")])
def test_train_mixture_checks_its_sizes_before_making_tables(tmp_path, no_ray, argv, match):
    with pytest.raises(SystemExit, match=match):
        train_mixture.main(["--workdir", str(tmp_path), *argv])


def test_train_mixture_refuses_sizes_that_are_not_positive(capsys, tmp_path, no_ray):
    err = usage_error(capsys, train_mixture.main, ["--workdir", str(tmp_path), "--rows", "0"])
    assert "--rows" in err, err


def test_verify_names_the_options_when_there_is_no_such_run(tmp_path):
    from jobs import verify

    with pytest.raises(SystemExit, match="no run 'nope'.*--storage-path and --name"):
        verify.main(["--storage-path", str(tmp_path), "--name", "nope"])


# --- the docs' shell recipes ------------------------------------------------------------

def doc_commands(module: str) -> list[tuple[str, list[str]]]:
    """``(page, argv)`` of every complete ``python -m <module>`` line (no ``...``) in the
    bash blocks of README.md and docs/*.md, continuation lines joined."""
    from tests.test_docs import PAGES, REPO, blocks

    out = []
    for page in PAGES:
        for info, _, code, _ in blocks(page):
            if info != "bash":
                continue
            for ln in code.replace("\\\n", " ").splitlines():
                cmd = ln.split("#")[0]
                if f"python -m {module} " in cmd and "..." not in cmd:
                    out.append((str(page.relative_to(REPO)),
                                shlex.split(cmd.split(f"python -m {module} ", 1)[1])))
    return out


def test_the_docs_train_commands_are_valid_and_one_name_keeps_one_plan():
    """A run's name (under one storage path) is one run: a second recipe that reused it with
    another plan would be refused ("started with other settings") by the first's run.json."""
    commands = doc_commands("jobs.train")
    assert any(page == "docs/elastic.md" for page, _ in commands), commands
    plans: dict[tuple[str, str, str], set] = {}
    names: dict[tuple[str, str], set] = {}
    for page, argv in commands:
        a = train_job.parser().parse_args(argv)
        check_run_sizes(a.workers if a.min_workers is None else (a.min_workers, a.workers),
                        a.num_splits, a.global_batch)
        plans.setdefault((page, a.storage_path, a.name), set()).add(
            (a.db, a.table, a.num_splits, a.global_batch, a.seed))
        names.setdefault((page, a.storage_path), set()).add(a.name)
    assert all(len(p) == 1 for p in plans.values()), plans
    # Each recipe's verify / plot_run names a run that a recipe of the page trained.
    for module in ("jobs.verify", "jobs.plot_run"):
        for page, argv in doc_commands(module):
            a = argparse.ArgumentParser()
            a.add_argument("--storage-path", default="runs/demo/storage")
            a.add_argument("--name", default="demo-run")
            got, _ = a.parse_known_args(argv)
            assert got.name in names.get((page, got.storage_path), set()), (page, argv, names)


@pytest.mark.parametrize("flag", ["--step-delay", "--resize-interval"])
def test_train_refuses_negative_seconds(capsys, flag):
    assert "must be 0 or a positive number" in usage_error(capsys, train_job.main, [flag, "-1"])


def test_train_mixture_refuses_a_workdir_of_something_else(tmp_path, no_ray):
    (tmp_path / "db").mkdir()  # e.g. runs/demo: another job's table and checkpoints
    with pytest.raises(SystemExit, match="holds files of something else"):
        train_mixture.main(["--workdir", str(tmp_path)])
    assert (tmp_path / "db").is_dir()
