"""The package layout is the data path: every import points down it, and nothing imports in a
circle (not even inside a function), in lance_ray and in jobs/ (its entrypoints,
benchmarks and fault trials)."""

from __future__ import annotations

import ast
from pathlib import Path

import jobs
import lance_ray

PACKAGE = Path(lance_ray.__file__).parent
JOBS = Path(jobs.__file__).parent
# Lower layers never import higher ones; modules of one layer may import each other.
LAYERS = [
    {"storage", "topology", "checks"},
    {"state"},
    {"plan"},
    {"stream"},
    {"read"},
    {"coordinator"},
    {"view"},
    {"driver"},
    {"train", "proof", "cli", "testing", "__main__", "__init__"},
]
MAX_LINES = 400


def _module(path: Path, root: Path = PACKAGE) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts) or "__init__"


def _imports(path: Path, root: Path = PACKAGE) -> set[str]:
    """Every module of the package at ``root`` that ``path`` imports, at any depth of the
    code (names relative to ``root``)."""
    top = root.name
    me = _module(path, root).split(".")
    package = me if path.name == "__init__.py" else me[:-1]
    if me == ["__init__"]:
        package = []
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                target = [*base, *(node.module.split(".") if node.module else [])]
            elif node.module and node.module.split(".")[0] == top:
                target = node.module.split(".")[1:]
            else:
                continue
            names = [a.name for a in node.names]
            for name in names:
                candidate = root.joinpath(*target, name)
                full = [*target, name] if (candidate.with_suffix(".py").exists()
                                           or candidate.is_dir()) else target
                if full:
                    out.add(".".join(full))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith(top + "."):
                    out.add(alias.name.removeprefix(top + "."))
    return out


def _graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    return {_module(p, root): _imports(p, root) for p in root.rglob("*.py")}


def _layer(module: str) -> int:
    top = module.split(".")[0]
    return next(i for i, layer in enumerate(LAYERS) if top in layer)


def test_every_import_points_down_the_data_path() -> None:
    upward = [(m, t) for m, targets in _graph().items() for t in targets
              if _layer(t) > _layer(m)]
    assert upward == []


# The coordinator's wire protocol (the actors and the views' client) sits below the views;
# the driver-side handle that builds views of it (``Coordinator.view()``) sits above them.


def test_the_coordinator_imports_nothing_from_the_views() -> None:
    edges = {(m, t) for m, targets in _graph().items() for t in targets
             if m.split(".")[0] == "coordinator" and t.split(".")[0] == "view"}
    assert edges == set()


def test_the_coordinators_client_and_server_live_in_one_folder() -> None:
    from lance_ray.coordinator.actor import CoordinatorActor
    from lance_ray.coordinator.client import CoordinatorPlans
    from lance_ray.coordinator.mixture import MixtureCoordinatorActor

    for cls in (CoordinatorPlans, MixtureCoordinatorActor):
        assert cls.__module__.startswith("lance_ray.coordinator.")
    assert "lance_ray.coordinator." in repr(CoordinatorActor)  # a Ray actor class
    assert _layer("coordinator") < _layer("view") < _layer("driver")


def test_the_dataset_is_one_facade_over_one_iteration_object_per_mode() -> None:
    # Its state lives in the core and in one mode object (rows or packed blocks), not in
    # mixins that each declare it again.
    from lance_ray.view.dataset import StreamingDataset

    ours = [b.__name__ for b in StreamingDataset.__bases__
            if b.__module__.split(".")[0] == "lance_ray"]
    assert ours == ["ViewCore"]


def test_the_mixture_holds_its_progress_in_one_object_not_in_a_mixin() -> None:
    # Its progress, reading and committing live in one MixProgress (view/mix_reading.py).
    from lance_ray.view.mixture import MixtureDataset

    ours = [b for b in MixtureDataset.__bases__ if b.__module__.split(".")[0] == "lance_ray"]
    assert ours == []


def test_no_method_is_a_stub_that_another_class_provides() -> None:
    # A mixin's "provided by" stubs declare what its host defines: state held twice.
    stubs = {_module(p): n for p in PACKAGE.rglob("*.py")
             if (n := p.read_text().lower().count("provided by"))}
    assert stubs == {}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        for nxt in sorted(graph.get(node, ())):
            if nxt == path[0]:
                cycles.append([*path, nxt])
            elif nxt not in path and nxt > path[0]:  # each cycle once, from its least module
                visit(nxt, [*path, nxt])

    for start in sorted(graph):
        visit(start, [start])
    return cycles


def test_no_module_imports_itself_back_through_others() -> None:
    assert _cycles(_graph()) == []


def test_no_job_benchmark_or_fault_trial_imports_itself_back_through_others() -> None:
    graph = _graph(JOBS)
    assert "bench.cases" in graph and "faults.chaos" in graph  # the walk saw jobs/
    assert _cycles(graph) == []


def test_the_cycle_check_sees_a_circle_made_of_function_level_imports() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]


def test_lance_ray_itself_never_imports_its_testing_helpers() -> None:
    # lance_ray.testing may need test-only packages (moto); users' imports must not.
    users = {m for m, targets in _graph().items() for t in targets
             if t.split(".")[0] == "testing" and m.split(".")[0] != "testing"}
    assert users == set()


def test_no_module_is_over_the_size_that_asks_to_be_split() -> None:
    sizes = {_module(p): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    assert {m: n for m, n in sizes.items() if n > MAX_LINES} == {}
