"""Shared fixtures: one builtin model per test session, in a persistent cache.

OMP_WAIT_POLICY=PASSIVE is set before any test module imports torch: with the default (spinning)
policy, 2-thread torch runs several times slower when other processes share the cores.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def builtin_cache():
    """Pin TRL_EXT_CACHE (the caller's value, else the default cache dir) for the session and its subprocesses.

    The cache persists across runs, so the builtin model is built at most once per CI run (and not at all
    when the quickstart already built it on this machine).
    """
    from trl_ext.builtin_model import CACHE_ENV, cache_dir

    previous = os.environ.get(CACHE_ENV)
    path = cache_dir()
    os.environ[CACHE_ENV] = str(path)
    yield path
    if previous is None:
        os.environ.pop(CACHE_ENV, None)
    else:
        os.environ[CACHE_ENV] = previous


@pytest.fixture(scope="session")
def builtin_path(builtin_cache):
    """The built builtin model directory (built once, ~3 minutes on 2 cores, if not cached)."""
    from trl_ext.builtin_model import ensure_builtin

    return ensure_builtin()
