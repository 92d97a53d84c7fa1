"""Sabotage injection: switch one mechanism off in every Python process of a test run.

Python imports ``sitecustomize`` at start-up from the first ``sys.path`` entry that has one, and ``PYTHONPATH``
entries come first: with this folder on ``PYTHONPATH`` and ``TRL_EXT_SABOTAGE=<row name>`` set (rows:
``tests/sabotage/switches.py``), every process that inherits the environment (the pytest process, train.py
subprocesses, torchrun workers, vLLM's spawned engine processes) installs a ``sys.meta_path`` finder. When the row's
``module`` is imported, the finder runs the real loader's ``exec_module`` and then replaces the row's ``target``
(a dotted attribute inside the module) by ``replacement(original)``, before any other module can import the name.

Loud by design: an unknown row name, or a target attribute that does not exist (a renamed function), raises
`SabotageError` at that import, and writes a ``MISSING`` line to the log, so a row can never be silently vacuous.
``TRL_EXT_SABOTAGE_LOG`` (a file) gets one ``applied`` line each time the switch is installed (once per process that
imports the module) and one ``hit`` line per process the first time the sabotaged callable runs; the runner
(``tests/sabotage/test_sabotage.py``) requires at least one of each.

Without ``TRL_EXT_SABOTAGE`` this file does nothing (it then only chains to another ``sitecustomize`` further down
``sys.path``, if there is one).
"""

from __future__ import annotations

import os
import sys

ENV_NAME = "TRL_EXT_SABOTAGE"
ENV_LOG = "TRL_EXT_SABOTAGE_LOG"
_HERE = os.path.dirname(os.path.abspath(__file__))
SWITCHES = os.path.join(os.path.dirname(_HERE), "switches.py")


class SabotageError(RuntimeError):
    """A sabotage row that cannot be applied (unknown name, missing target)."""


def _log(kind: str, row_name: str, detail: str) -> None:
    path = os.environ.get(ENV_LOG)
    if not path:
        return
    line = f"{kind} {row_name} {detail} pid={os.getpid()} argv0={os.path.basename(sys.argv[0]) if sys.argv else ''}\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())  # one write of a short line: whole, also with several processes appending
    finally:
        os.close(fd)


def load_switches():
    """``tests/sabotage/switches.py`` as a module (by path: ``tests/`` need not be importable)."""
    import importlib.util

    name = "_trl_ext_sabotage_switches"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, SWITCHES)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _counted(row_name: str, new):
    """``new`` with a ``hit`` log line on its first call in this process."""
    import functools

    state = {"hit": False}

    @functools.wraps(new)
    def sabotaged(*args, **kwargs):
        if not state["hit"]:
            state["hit"] = True
            _log("hit", row_name, "")
        return new(*args, **kwargs)

    sabotaged.__sabotaged__ = row_name
    return sabotaged


def apply(row, module) -> None:
    """Replace ``row.target`` inside ``module`` by ``row.replacement(original)``; SabotageError if it is missing."""
    owner, parts = module, row.target.split(".")
    for i, part in enumerate(parts):
        if not hasattr(owner, part):
            where = ".".join([row.module, *parts[:i]])
            _log("MISSING", row.name, f"{row.module}:{row.target}")
            raise SabotageError(f"sabotage row {row.name!r}: {where} has no attribute {part!r} (target "
                                f"{row.module}:{row.target}); update tests/sabotage/switches.py")
        if i < len(parts) - 1:
            owner = getattr(owner, part)
    attr = parts[-1]
    static = isinstance(owner, type) and vars(owner).get(attr)
    original = getattr(owner, attr)
    new = _counted(row.name, row.replacement(original))
    if isinstance(static, staticmethod):
        new = staticmethod(new)
    elif isinstance(static, classmethod):
        new = classmethod(new)
    setattr(owner, attr, new)
    _log("applied", row.name, f"{row.module}:{row.target}")


class _ApplyAfterExec:
    """A loader that runs the real loader, then `apply`; everything else is the real loader's."""

    def __init__(self, inner, row):
        self._inner, self._row = inner, row

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._inner.exec_module(module)
        apply(self._row, module)

    def __getattr__(self, name):
        return getattr(self._inner, name)


class _Finder:
    """``sys.meta_path`` finder for exactly ``row.module``: the other finders' spec, with its loader wrapped."""

    def __init__(self, row):
        self.row = row

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.row.module:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            raise SabotageError(f"sabotage row {self.row.name!r}: {fullname} has no loader with exec_module")
        spec.loader = _ApplyAfterExec(spec.loader, self.row)
        return spec

    def invalidate_caches(self):
        pass


def install(row_name: str) -> None:
    switches = load_switches()
    row = switches.by_name(row_name)  # KeyError naming the rows when unknown
    if row.module in sys.modules:  # imported before this hook (not at start-up; a manual install)
        apply(row, sys.modules[row.module])
        return
    sys.meta_path.insert(0, _Finder(row))


def _chain() -> None:
    """Run the next ``sitecustomize`` on ``sys.path`` (the one this file shadows), if any."""
    import importlib.machinery

    rest = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.origin and os.path.abspath(spec.origin) != os.path.abspath(__file__):
        import importlib.util

        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


_chain()
if os.environ.get(ENV_NAME):
    try:
        install(os.environ[ENV_NAME])
    except KeyError as e:  # site would only warn about an exception here: stop the process instead
        _log("MISSING", os.environ[ENV_NAME], "unknown-row")
        print(f"sitecustomize: {ENV_NAME}={os.environ[ENV_NAME]!r}: {e.args[0]}", file=sys.stderr, flush=True)
        os._exit(3)  # site turns SystemExit into a warning and exit 1; 3 says: no such row
