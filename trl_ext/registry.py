"""A name -> callable registry shared by rewards, detectors, estimators and environments.

Style after verl's ``core_algos`` (``@register_adv_est``): components register themselves with a
decorator and are looked up by the name a config or flag gives; an unknown name raises a
``ConfigError`` that lists every registered name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class ConfigError(ValueError):
    """A wrong configuration: raised before any model is loaded; the CLIs turn it into exit code 2."""


class Registry(Generic[T]):
    """Named components of one kind (``kind`` is used in error messages, e.g. "reward function")."""

    def __init__(self, kind: str):
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str | None = None) -> Callable[[T], T]:
        def decorator(obj: T) -> T:
            return self.add(name or obj.__name__, obj)

        return decorator

    def add(self, name: str, obj: T) -> T:
        """Register ``obj`` under ``name`` (the decorator's body, for objects that are not functions)."""
        if name in self._items:
            raise ValueError(f"{self.kind} {name!r} is registered twice")
        self._items[name] = obj
        return obj

    def remove(self, name: str) -> T:
        """Unregister ``name`` (a test's temporary entry); returns it."""
        return self._items.pop(name)

    def values(self) -> list[T]:
        """The registered objects in registration order."""
        return list(self._items.values())

    def get(self, name: str) -> T:
        if name not in self._items:
            raise ConfigError(f"unknown {self.kind} {name!r}; registered: {', '.join(sorted(self._items))}")
        return self._items[name]

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: str) -> bool:
        return name in self._items
