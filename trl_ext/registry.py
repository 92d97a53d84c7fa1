"""A name -> callable registry shared by rewards, detectors, estimators and environments.

Style after verl's ``core_algos`` (``@register_adv_est``): components register themselves with a
decorator and are looked up by the name a config or flag gives; an unknown name raises a
``ConfigError`` that lists every registered name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T", bound=Callable)


class ConfigError(ValueError):
    """A wrong configuration: raised before any model is loaded; the CLIs turn it into exit code 2."""


class Registry(Generic[T]):
    """Named components of one kind (``kind`` is used in error messages, e.g. "reward function")."""

    def __init__(self, kind: str):
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str | None = None) -> Callable[[T], T]:
        def decorator(obj: T) -> T:
            key = name or obj.__name__
            if key in self._items:
                raise ValueError(f"{self.kind} {key!r} is registered twice")
            self._items[key] = obj
            return obj

        return decorator

    def get(self, name: str) -> T:
        if name not in self._items:
            raise ConfigError(f"unknown {self.kind} {name!r}; registered: {', '.join(sorted(self._items))}")
        return self._items[name]

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: str) -> bool:
        return name in self._items
