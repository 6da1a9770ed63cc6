"""How DataLoader worker processes start: a preloaded fork server, also under unguarded scripts.

Lance is not fork-safe, so workers come from a fork server. A fork server (like spawn)
normally re-runs the user's ``__main__`` script in every worker so that objects defined
there can be unpickled; a script whose loop is not under ``if __name__ == "__main__":``
then starts its whole training again inside each worker, and torch reports only "worker
exited unexpectedly". PyTorch users on Linux never needed that guard (fork copies the
parent), so for such scripts the workers skip the script and what they need travels by
value (cloudpickle) instead.
"""

from __future__ import annotations

import ast
import multiprocessing
import pickle
import sys
import types
from collections.abc import Callable
from multiprocessing.context import ForkServerContext, ForkServerProcess
from pathlib import Path
from typing import Any

# Imported by the fork server before it forks any worker; the first one quiets Lance's
# warning at each fork (the server imported Lance but never used it: that fork is safe).
PRELOAD = ["lance_ray.view.fork_server", "torch", "pyarrow", "lance", "lance_ray.view.dataset"]


def unguarded_main_line() -> int | None:
    """The line of the running ``__main__`` script that called us, if it is not under an
    ``if __name__ == "__main__":`` guard; None when guarded or when there is no script."""
    frame: types.FrameType | None = sys._getframe(1)
    outer = None
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__") == "__main__":
            outer = frame
        frame = frame.f_back
    if outer is None:
        return None
    try:
        tree = ast.parse(Path(outer.f_code.co_filename).read_text())
    except (OSError, SyntaxError, ValueError):  # "<stdin>", "<string>", a notebook cell
        return None
    line = outer.f_lineno
    for node in tree.body:
        if (isinstance(node, ast.If) and _is_main_guard(node.test)
                and node.lineno <= line <= (node.end_lineno or node.lineno)):
            return None
    return line


def _is_main_guard(test: ast.expr) -> bool:
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1
            and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = {_name_or_constant(test.left), _name_or_constant(test.comparators[0])}
    return sides == {"name:__name__", "const:__main__"}


def _name_or_constant(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return f"name:{node.id}"
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return f"const:{node.value}"
    return ""


class _ScriptFreeProcess(ForkServerProcess):
    """A fork-server process that does not re-run the parent's ``__main__`` script."""

    @staticmethod
    def _Popen(process_obj: Any) -> Any:
        # The start-up data names the main script only when ``sys.modules["__main__"]`` has a
        # file or a module spec; hide both while this one process is launched.
        main = sys.modules["__main__"]
        sys.modules["__main__"] = types.ModuleType("__main__")
        try:
            return ForkServerProcess._Popen(process_obj)
        finally:
            sys.modules["__main__"] = main


class _ScriptFreeContext(ForkServerContext):
    Process = _ScriptFreeProcess  # type: ignore[assignment]


def worker_context(*, script_free: bool) -> Any:
    """The multiprocessing context for DataLoader workers (fork server, heavy modules
    preloaded); ``script_free`` workers skip the ``__main__`` script."""
    ctx = _ScriptFreeContext() if script_free else multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


class TravelsByValue:
    """Mixin: the object pickles by value (cloudpickle), so the lambdas and the functions
    and classes of ``__main__`` it holds reach the loader's workers, whichever way they
    start. (``by_value`` is cleared only while it pickles itself.)"""

    by_value = True

    def __reduce_ex__(self, protocol: Any) -> Any:
        if not self.by_value:
            return super().__reduce_ex__(protocol)
        from ray import cloudpickle

        self.by_value = False  # pickled in the thread that starts the workers
        try:
            data = cloudpickle.dumps(self)
        finally:
            self.by_value = True
        return pickle.loads, (data,)


def prepare_workers(kwargs: dict[str, Any]) -> None:
    """Set up a loader's DataLoader workers (``kwargs``: the DataLoader's): their context,
    and ``worker_init_fn`` sent by value, as the loader's source (:class:`TravelsByValue`)
    is, so that lambdas and what ``__main__`` defines reach them.

    Lance is not fork-safe (forked workers were seen to panic in its decoder, and to hang
    once Ray's threads run in the parent), so workers come from a fork server that has
    already imported the heavy modules: safe and fast to start.
    """
    line = unguarded_main_line()
    context = kwargs.get("multiprocessing_context")
    if context is None:
        kwargs["multiprocessing_context"] = worker_context(script_free=line is not None)
    elif line is not None and _runs_the_script(context):
        raise RuntimeError(
            f"StreamingDataLoader workers started from line {line} of the main script, "
            "outside an `if __name__ == \"__main__\":` guard, with multiprocessing_context="
            f"{kwargs['multiprocessing_context']!r}: every worker would run the script "
            "again. Put the script's work under that guard, or leave "
            "multiprocessing_context unset (lance_ray's default workers skip the script)"
        )
    if kwargs.get("worker_init_fn") is not None:
        kwargs["worker_init_fn"] = CallByValue(kwargs["worker_init_fn"])


def _runs_the_script(context: Any) -> bool:
    """Whether workers of ``context`` (a start method's name or a multiprocessing context)
    import the main script again: all but fork's, which copies the parent."""
    method = context if isinstance(context, str) else context.get_start_method()
    return method != "fork"


class ForwardsToDataset:
    """Mixin for what a loader hands torch as its ``dataset``: the attributes it lacks come
    from the user's dataset (``loader.dataset.state_dict()``, ``set_epoch`` hooks), as the
    reference loader's adapter gives them. The dataset stays in the trainer's process:
    workers get a copy without it."""

    _forward_to: Any = None

    def forward_to(self, dataset: Any) -> None:
        self._forward_to = dataset

    def __getattr__(self, name: str) -> Any:  # only for names found nowhere else
        target = self.__dict__.get("_forward_to")
        if target is None or name.startswith("__"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(target, name)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("_forward_to", None)
        return state


class CallByValue(TravelsByValue):
    """A callable (e.g. a user's ``worker_init_fn``) that travels by value."""

    by_value = True

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)
