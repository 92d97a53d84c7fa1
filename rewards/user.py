"""A researcher's own reward or detector, named in config.yaml by an import path instead of a registered name.

``fn: module.sub:attr`` imports ``module.sub`` (``importlib.import_module``) and takes its attribute ``attr``
(dotted: ``attr.inner`` for a class attribute); ``fn: path/to/file.py:attr`` executes that file (relative to the
config file's directory, or absolute) as a module of its own. Modules are found on ``sys.path`` with the current
working directory and the config file's directory appended (after the installed packages, so that a file never
shadows a library or the project: a module named like an installed one is the installed one; use the file form).
Every failure is a :class:`ConfigError` naming the module and the reason.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from pathlib import Path

from trl_ext.registry import ConfigError

USER_MODULE_PREFIX = "_trl_ext_user_"
"""``sys.modules`` name prefix of the modules loaded from a file path (one per resolved path)."""


def is_import_path(name: str) -> bool:
    """Whether a binding's ``fn`` is an import path (``module:attr``) rather than a registered name."""
    return ":" in name


def resolve_callable(spec: str, base_dir: Path) -> Callable:
    """The callable ``spec`` (``module:attr`` or ``file.py:attr``, see the module docstring) names."""
    module_part, _, attr = spec.rpartition(":")
    if not module_part or not attr:
        raise ConfigError(f"fn {spec!r} must be 'module:attr' or 'path/to/file.py:attr'")
    module = _load_file(module_part, base_dir) if module_part.endswith(".py") else _import(module_part, base_dir)
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            where = getattr(module, "__file__", None) or module.__name__
            raise ConfigError(f"fn {spec!r}: module {module_part!r} ({where}) has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(f"fn {spec!r}: {attr!r} is a {type(obj).__name__}, not a callable")
    return obj


def search_dirs(base_dir: Path) -> list[str]:
    """The directories appended to ``sys.path`` for a config in ``base_dir``: the working directory, then it."""
    return list(dict.fromkeys([os.getcwd(), str(base_dir.resolve())]))


def _import(name: str, base_dir: Path):
    for d in search_dirs(base_dir):
        if d not in sys.path:
            sys.path.append(d)
    try:
        return importlib.import_module(name)
    except Exception as e:  # noqa: BLE001  (any failure of the user's module is a config error)
        raise ConfigError(f"module {name!r} does not import: {type(e).__name__}: {_one_line(e)} (searched "
                          f"sys.path with {', '.join(search_dirs(base_dir))})") from None  # fmt: skip


def _load_file(path_text: str, base_dir: Path):
    path = Path(path_text).expanduser()
    path = (path if path.is_absolute() else base_dir / path).resolve()
    if not path.is_file():
        raise ConfigError(f"module file {path_text!r} does not exist (looked for {path})")
    name = USER_MODULE_PREFIX + path.stem + "_" + hashlib.sha1(str(path).encode()).hexdigest()[:8]
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look a module up by name while it executes
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001
        del sys.modules[name]
        raise ConfigError(f"module file {str(path)!r} does not import: {type(e).__name__}: {_one_line(e)}") from None
    return module


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split())
