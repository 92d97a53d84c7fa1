"""Bind names in config.yaml to reward functions and reward-hacking detectors.

Registry + ``functools.partial`` binding, as in the small-rl design notes (per-criterion params under
``params:``; ``--reward NAME`` selects a binding). Schema::

    rewards:
      <name>: {fn: <reward function>, params: {<param>: <value>}, rh_detector: <detector binding>}
      <name>: {fn: combined, params: {components: [{reward: <reward binding>, weight: w, cap: c}, ...]}}
    detectors:
      <name>: {fn: <detector>, params: {<param>: <value>}}

``params`` and ``rh_detector`` are optional (``rh_detector`` names the binding's default RH detector; a CLI
flag may override it); ``cap`` is optional (absent or null: uncapped). Everything is checked at load time
and every problem raises :class:`ConfigError` with a one-line message: missing file, malformed YAML
(duplicate keys included), unknown section/binding/component keys, unknown function (the message lists
the registered ones), unknown or missing params (checked against the function's signature), components
naming unknown bindings, cycles among combined rewards, and bad param values (each binding is evaluated
once on two probe texts, so e.g. ``target: 0`` fails here, not mid-training).
"""

from __future__ import annotations

import copy
import functools
import inspect
from collections.abc import Callable, Sequence
from pathlib import Path

import yaml

from trl_ext.registry import ConfigError, Registry

from .detectors import DETECTORS
from .functions import REWARD_FNS, Component, combined

_TOP_KEYS = ("rewards", "detectors")
_REWARD_KEYS = ("fn", "params", "rh_detector")
_DETECTOR_KEYS = ("fn", "params")
_COMPONENT_KEYS = ("reward", "weight", "cap")
_PROBE_TEXTS = ["", "The dog was happy. It ran home"]

RewardFn = Callable[[list[str]], list[float]]
DetectorFn = Callable[[list[str]], list[bool]]


class RewardConfig:
    """The bound rewards and detectors of one config file (built by :func:`load_reward_config`)."""

    def __init__(self, path: Path, rewards: dict[str, RewardFn], detectors: dict[str, DetectorFn],
                 default_detectors: dict[str, str | None], raw: dict):
        self.path = path
        self._rewards = rewards
        self._detectors = detectors
        self._default_detectors = default_detectors
        self._raw = raw

    def reward(self, name: str) -> RewardFn:
        """The bound reward ``list[str] -> list[float]`` named ``name``."""
        self._check("reward", name, self._rewards)
        return self._rewards[name]

    def detector(self, name: str) -> DetectorFn:
        """The bound RH detector ``list[str] -> list[bool]`` named ``name``."""
        self._check("detector", name, self._detectors)
        return self._detectors[name]

    def default_detector(self, reward_name: str) -> str | None:
        """The ``rh_detector`` the reward binding names, or None when it names none."""
        self._check("reward", reward_name, self._rewards)
        return self._default_detectors[reward_name]

    def reward_names(self) -> list[str]:
        return sorted(self._rewards)

    def detector_names(self) -> list[str]:
        return sorted(self._detectors)

    def binding(self, section: str, name: str) -> dict:
        """A copy of the binding as written in the YAML (``section`` is "rewards" or "detectors"), for run logs."""
        if section not in _TOP_KEYS:
            raise ValueError(f"section must be one of {', '.join(_TOP_KEYS)}, got {section!r}")
        self._check(section[:-1], name, self._raw.get(section, {}))
        return copy.deepcopy(self._raw[section][name])

    def _check(self, kind: str, name: str, bound: dict) -> None:
        if name not in bound:
            raise ConfigError(f"unknown {kind} {name!r} in {self.path}; bound: {', '.join(sorted(bound)) or '(none)'}")


def load_reward_config(path: str | Path) -> RewardConfig:
    """Read, validate and bind a reward config file (schema in the module docstring)."""
    path = Path(path)
    data = _read_yaml(path)
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping with keys {', '.join(_TOP_KEYS)}")
    for key in data:
        if key not in _TOP_KEYS:
            raise ConfigError(f"{path}: unknown top-level key {key!r}; allowed: {', '.join(_TOP_KEYS)}")
    if "rewards" not in data:
        raise ConfigError(f"{path}: missing top-level key 'rewards'")
    reward_specs = _section(path, data, "rewards")
    detector_specs = _section(path, data, "detectors") if "detectors" in data else {}

    detectors = {}
    for name, spec in detector_specs.items():
        fn, params = _validate(path, "detector", name, spec, DETECTORS, _DETECTOR_KEYS)
        detectors[name] = functools.partial(fn, **params)

    validated, defaults = {}, {}
    for name, spec in reward_specs.items():
        validated[name] = _validate(path, "reward", name, spec, REWARD_FNS, _REWARD_KEYS)
        det = spec.get("rh_detector")
        if det is not None and (not isinstance(det, str) or det not in detectors):
            raise ConfigError(f"{path}: reward binding {name!r}: rh_detector {det!r} is not a bound detector; "
                              f"bound: {', '.join(sorted(detectors)) or '(none)'}")
        defaults[name] = det

    rewards: dict[str, RewardFn] = {}  # insertion order = dependency order (components first)

    def resolve(name: str, stack: list[str]) -> RewardFn:
        if name in rewards:
            return rewards[name]
        if name in stack:
            cycle = stack[stack.index(name):] + [name]
            raise ConfigError(f"{path}: cycle in combined rewards: {' -> '.join(cycle)}")
        fn, params = validated[name]
        params = dict(params)
        if fn is combined:
            params["components"] = _components(path, name, params["components"], reward_specs,
                                               lambda ref: resolve(ref, stack + [name]))
        rewards[name] = functools.partial(fn, **params)
        return rewards[name]

    for name in reward_specs:
        resolve(name, [])
    for kind, bound, out_type in (("reward", rewards, float), ("detector", detectors, bool)):
        for name, fn in bound.items():
            _probe(path, kind, name, fn, out_type)
    return RewardConfig(path, rewards, detectors, defaults, {"rewards": reward_specs, "detectors": detector_specs})


# ---------------------------------------------------------------------------------------------- TRL adapter
class TrlReward:
    """A bound reward in the form GRPOTrainer's ``reward_funcs`` expects.

    Called as ``f(prompts=..., completions=..., completion_ids=..., **kwargs)`` (extra columns such as
    ``trainer_state`` are ignored); ``__name__`` is the binding name, which TRL logs as ``rewards/<name>/mean``.
    """

    def __init__(self, name: str, fn: RewardFn):
        if not callable(fn):
            raise TypeError(f"reward {name!r} must be callable, got {type(fn).__name__}")
        self.__name__ = name
        self.fn = fn

    def __call__(self, *, completions: Sequence, **kwargs) -> list[float]:
        texts = completion_texts(completions)
        values = self.fn(texts)
        if len(values) != len(texts):
            raise ValueError(f"reward {self.__name__!r} returned {len(values)} values for {len(texts)} completions")
        return [float(v) for v in values]

    def __repr__(self) -> str:
        return f"TrlReward({self.__name__!r})"


def as_trl_reward(name: str, fn: RewardFn) -> TrlReward:
    """Wrap a bound reward ``list[str] -> list[float]`` for ``GRPOTrainer(reward_funcs=[...])``."""
    return TrlReward(name, fn)


def completion_texts(completions: Sequence) -> list[str]:
    """Plain texts of TRL completions: strings as they are; a conversational completion (a list of
    ``{"role", "content"}`` messages) gives its last message's content."""
    if isinstance(completions, str) or not isinstance(completions, Sequence):
        raise TypeError(f"completions must be a list, got {type(completions).__name__}")
    texts = []
    for i, c in enumerate(completions):
        if isinstance(c, list):
            if not c or not isinstance(c[-1], dict) or not isinstance(c[-1].get("content"), str):
                raise TypeError(f"completions[{i}] is a message list whose last message has no string 'content'")
            c = c[-1]["content"]
        elif not isinstance(c, str):
            raise TypeError(f"completions[{i}] must be a string or a list of messages, got {type(c).__name__}")
        texts.append(c)
    return texts


# ---------------------------------------------------------------------------------------------- helpers
class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a repeated mapping key (plain PyYAML silently keeps the last one)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _read_yaml(path: Path):
    if not path.is_file():
        raise ConfigError(f"reward config file not found: {path}")
    try:
        return yaml.load(path.read_text(), Loader=_UniqueKeyLoader)
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: malformed YAML: {' '.join(str(e).split())}") from None


def _section(path: Path, data: dict, key: str) -> dict:
    section = data[key]
    if not isinstance(section, dict) or (key == "rewards" and not section):
        raise ConfigError(f"{path}: {key!r} must be a {'non-empty ' if key == 'rewards' else ''}mapping of "
                          f"binding names to bindings, got {section!r}")
    for name in section:
        if not isinstance(name, str):
            raise ConfigError(f"{path}: {key} binding name {name!r} must be a string")
    return section


def _validate(path: Path, kind: str, name: str, spec, registry: Registry, keys: tuple[str, ...]):
    """Check one binding's keys, function and params; return (function, params)."""
    where = f"{path}: {kind} binding {name!r}"
    if not isinstance(spec, dict):
        raise ConfigError(f"{where} must be a mapping with keys {', '.join(keys)}, got {spec!r}")
    for key in spec:
        if key not in keys:
            raise ConfigError(f"{where}: unknown key {key!r}; allowed: {', '.join(keys)}")
    if "fn" not in spec:
        raise ConfigError(f"{where}: missing key 'fn'")
    if not isinstance(spec["fn"], str):
        raise ConfigError(f"{where}: fn must be a name, got {spec['fn']!r}")
    try:
        fn = registry.get(spec["fn"])
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    params = spec["params"] if "params" in spec else {}
    if not isinstance(params, dict):
        raise ConfigError(f"{where}: params must be a mapping, got {params!r}")
    allowed, required = _param_names(fn)
    what = f"{registry.kind} {spec['fn']!r}"
    for p in params:
        if p not in allowed:
            raise ConfigError(f"{where}: unknown param {p!r} for {what}; allowed: {', '.join(allowed) or '(none)'}")
    for p in required:
        if p not in params:
            raise ConfigError(f"{where}: missing required param {p!r} for {what}")
    return fn, params


def _param_names(fn: Callable) -> tuple[list[str], list[str]]:
    """(all, required) keyword-only params of a registered ``fn(completions, *, ...)``."""
    ps = list(inspect.signature(fn).parameters.values())
    if not ps or ps[0].name != "completions" or any(p.kind is not p.KEYWORD_ONLY for p in ps[1:]):
        raise TypeError(f"{fn.__name__} must have the signature (completions, *, <keyword-only params>)")
    return [p.name for p in ps[1:]], [p.name for p in ps[1:] if p.default is p.empty]


def _components(path: Path, owner: str, specs, reward_specs: dict, resolve) -> tuple[Component, ...]:
    where = f"{path}: reward binding {owner!r}"
    if not isinstance(specs, list) or not specs:
        raise ConfigError(f"{where}: components must be a non-empty list, got {specs!r}")
    out = []
    for i, c in enumerate(specs):
        if not isinstance(c, dict):
            raise ConfigError(f"{where}: component {i} must be a mapping with keys {', '.join(_COMPONENT_KEYS)}")
        for key in c:
            if key not in _COMPONENT_KEYS:
                raise ConfigError(f"{where}: component {i} has unknown key {key!r}; "
                                  f"allowed: {', '.join(_COMPONENT_KEYS)}")
        for key in ("reward", "weight"):
            if key not in c:
                raise ConfigError(f"{where}: component {i} is missing key {key!r}")
        ref = c["reward"]
        if not isinstance(ref, str) or ref not in reward_specs:
            raise ConfigError(f"{where}: component {i} refers to unknown reward binding {ref!r}; "
                              f"bound: {', '.join(sorted(reward_specs))}")
        fn = resolve(ref)
        try:
            out.append(Component(name=ref, fn=fn, **{k: c[k] for k in ("weight", "cap") if k in c}))
        except ValueError as e:
            raise ConfigError(f"{where}: {e}") from None
    return tuple(out)


def _probe_kwargs(fn: Callable) -> dict:
    """Empty episodes for a detector that judges environment trajectories (no step info: nothing flagged)."""
    from types import SimpleNamespace

    from .detectors import needs_trajectories

    return {"trajectories": [SimpleNamespace(turns=[])] * len(_PROBE_TEXTS)} if needs_trajectories(fn) else {}


def _probe(path: Path, kind: str, name: str, fn: Callable, out_type: type) -> None:
    """Evaluate a binding once so that bad param values fail at load time."""
    try:
        out = fn(list(_PROBE_TEXTS), **_probe_kwargs(fn))
    except ValueError as e:
        raise ConfigError(f"{path}: {kind} binding {name!r}: {e}") from None
    if not isinstance(out, list) or len(out) != len(_PROBE_TEXTS) or not all(type(v) is out_type for v in out):
        raise TypeError(f"{kind} binding {name!r} must return a list of {out_type.__name__}, one per text; got {out!r}")
