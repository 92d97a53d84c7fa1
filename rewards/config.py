"""Bind names in config.yaml to reward functions, reward models and reward-hacking detectors.

Registry + ``functools.partial`` binding, as in the small-rl design notes (per-criterion params under
``params:``; ``--reward NAME`` selects a binding). Schema::

    rewards:
      <name>: {fn: <reward function>, params: {<param>: <value>}, rh_detector: <detector binding>}
      <name>: {fn: combined, params: {components: [{reward: <reward binding>, weight: w, cap: c}, ...]}}
      <name>: {model: <reward model checkpoint directory>, rh_detector: <detector binding>}
    detectors:
      <name>: {fn: <detector>, params: {<param>: <value>}}

``fn`` is a registered name (rewards/functions.py, rewards/accuracy.py, rewards/detectors.py) or an import path,
``module:attr`` or ``path/to/file.py:attr`` (rewards/user.py: relative to this file's directory; modules are found
on sys.path plus the working directory and this file's directory). A reward function takes the project's
signature ``(completions, *, <params>)`` (texts) or TRL's (``prompts``, ``completions``, ``completion_ids``,
dataset columns, ``trainer_state``, ``**kwargs``); rewards/signature.py tells them apart and rewards/bound.py says
what each gets. ``model:`` binds a sequence-classification reward model (rewards/reward_model.py; a relative path
is relative to this file's directory); it cannot be a ``combined`` component.

``params`` and ``rh_detector`` are optional (``rh_detector`` names the binding's default RH detector; a CLI
flag may override it); ``cap`` is optional (absent or null: uncapped). Everything is checked at load time
and every problem raises :class:`ConfigError` with a one-line message: missing file, malformed YAML
(duplicate keys included), unknown section/binding/component keys, unknown function (the message lists
the registered ones), a module that does not import, a missing or non-callable attribute, unknown or missing
params (checked against the function's signature), components naming unknown bindings, cycles among combined
rewards, a reward model that is not one, and bad param values: each binding that reads texts alone is evaluated
once on two probe texts, so e.g. ``target: 0`` fails here, not mid-training. A binding that reads dataset columns
or the trainer state (TRL style) or a reward model is not called at load time (there is no data to call it on):
its params are checked against its signature, its columns by :meth:`RewardConfig.check_columns` once the
dataset's columns are known, and it is first called on the first batch.
"""

from __future__ import annotations

import copy
import functools
import numbers
from collections.abc import Callable, Collection
from pathlib import Path

import yaml

from trl_ext.registry import ConfigError, Registry

from . import accuracy  # noqa: F401  (registers the accuracy rewards)
from .bound import BoundReward, TrlReward, completion_texts
from .detectors import DETECTORS
from .functions import REWARD_FNS, Component, combined
from .reward_model import check_reward_model
from .signature import reward_signature, texts_signature
from .user import is_import_path, resolve_callable

_TOP_KEYS = ("rewards", "detectors")
_REWARD_KEYS = ("fn", "params", "rh_detector")
_MODEL_KEYS = ("model", "rh_detector")
_DETECTOR_KEYS = ("fn", "params")
_COMPONENT_KEYS = ("reward", "weight", "cap")
_PROBE_TEXTS = ["", "The dog was happy. It ran home"]

DetectorFn = Callable[[list[str]], list[bool]]
__all__ = ["RewardConfig", "TrlReward", "as_trl_reward", "completion_texts", "load_reward_config", "trl_reward_args"]


class RewardConfig:
    """The bound rewards and detectors of one config file (built by :func:`load_reward_config`)."""

    def __init__(self, path: Path, rewards: dict[str, BoundReward], detectors: dict[str, DetectorFn],
                 default_detectors: dict[str, str | None], raw: dict):
        self.path = path
        self._rewards = rewards
        self._detectors = detectors
        self._default_detectors = default_detectors
        self._raw = raw

    def reward(self, name: str) -> BoundReward:
        """The bound reward named ``name``: ``r(texts)`` or ``r(completions, **trl_kwargs)`` (rewards/bound.py)."""
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

    def check_columns(self, names: list[str], columns: Collection[str], source: str) -> None:
        """ConfigError unless the data ``source`` (its reward columns ``columns``: the dataset's columns but
        prompt/completion/completion_ids) gives every reward binding in ``names`` the columns it needs, and none
        of its columns would override a param bound here."""
        for name in dict.fromkeys(names):
            r = self.reward(name)
            missing = sorted(r.required_columns() - set(columns))
            if missing:
                have = ", ".join(sorted(columns)) or "(none but prompt)"
                raise ConfigError(f"reward binding {name!r} needs the dataset column(s) {', '.join(missing)}, which "
                                  f"{source} does not have (columns: {have})")
            clash = sorted(r.column_conflicts(columns))
            if clash:
                raise ConfigError(f"reward binding {name!r}: the dataset column(s) {', '.join(clash)} of {source} "
                                  "would override params bound in config.yaml; rename the param or the column")

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

    detectors, user_fns = {}, set()
    for name, spec in detector_specs.items():
        fn, params, _ = _validate(path, "detector", name, spec, DETECTORS, _DETECTOR_KEYS)
        detectors[name] = functools.partial(fn, **params)
        if is_import_path(spec["fn"]):
            user_fns.add(("detector", name))

    validated, defaults = {}, {}
    for name, spec in reward_specs.items():
        if isinstance(spec, dict) and "model" in spec:
            validated[name] = _validate_model(path, name, spec)
        else:
            validated[name] = _validate(path, "reward", name, spec, REWARD_FNS, _REWARD_KEYS)
            if is_import_path(spec["fn"]):
                user_fns.add(("reward", name))
        det = spec.get("rh_detector")
        if det is not None and (not isinstance(det, str) or det not in detectors):
            raise ConfigError(f"{path}: reward binding {name!r}: rh_detector {det!r} is not a bound detector; "
                              f"bound: {', '.join(sorted(detectors)) or '(none)'}")
        defaults[name] = det

    rewards: dict[str, BoundReward] = {}  # insertion order = dependency order (components first)

    def resolve(name: str, stack: list[str]) -> BoundReward:
        if name in rewards:
            return rewards[name]
        if name in stack:
            cycle = stack[stack.index(name):] + [name]
            raise ConfigError(f"{path}: cycle in combined rewards: {' -> '.join(cycle)}")
        fn, params, sig = validated[name]
        if sig == "model":
            rewards[name] = BoundReward(name, "model", model=fn)
        elif fn is combined:
            comps = _components(path, name, params["components"], reward_specs,
                                lambda ref: resolve(ref, stack + [name]))
            rewards[name] = BoundReward(name, "combined", fn=combined, components=comps)
        else:
            rewards[name] = BoundReward(name, sig.style, functools.partial(fn, **params), sig, params)
        return rewards[name]

    for name in reward_specs:
        resolve(name, [])
    for name, r in rewards.items():
        if not r.needs_context():
            _probe(path, "reward", name, r, float, ("reward", name) in user_fns)
    for name, fn in detectors.items():
        _probe(path, "detector", name, fn, bool, ("detector", name) in user_fns)
    return RewardConfig(path, rewards, detectors, defaults, {"rewards": reward_specs, "detectors": detector_specs})


# ---------------------------------------------------------------------------------------------- TRL adapter
def as_trl_reward(name: str, fn: Callable) -> TrlReward:
    """Wrap a bound reward for ``GRPOTrainer(reward_funcs=[...])`` (a plain ``list[str] -> list[float]`` too)."""
    return TrlReward(name, fn)


def trl_reward_args(name: str, reward: BoundReward) -> dict:
    """GRPOTrainer keyword arguments for the training reward ``name``: ``reward_funcs`` (a reward model as its
    checkpoint path, which TRL loads; else a :class:`TrlReward`), ``reward_processing_classes`` (the reward model's
    own tokenizer) and ``reward_names`` (ExtGRPOTrainer: the binding name, as TRL logs ``rewards/<name>/mean``)."""
    if isinstance(reward, BoundReward) and reward.kind == "model":
        return {"reward_funcs": [str(reward.model.path)], "reward_processing_classes": [reward.model.tokenizer()],
                "reward_names": [name]}  # fmt: skip
    return {"reward_funcs": [as_trl_reward(name, reward)], "reward_names": [name]}


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
    """Check one binding's keys, function and params; return (function, params, signature) (signature: a reward's
    ``RewardSignature``; None for ``combined`` and detectors)."""
    where = f"{path}: {kind} binding {name!r}"
    if not isinstance(spec, dict):
        raise ConfigError(f"{where} must be a mapping with keys {', '.join(keys)}, got {spec!r}")
    for key in spec:
        if key not in keys:
            raise ConfigError(f"{where}: unknown key {key!r}; allowed: {', '.join(keys)}")
    if "fn" not in spec:
        raise ConfigError(f"{where}: missing key 'fn'" + (" (or 'model': a reward model)" if kind == "reward" else ""))
    if not isinstance(spec["fn"], str):
        raise ConfigError(f"{where}: fn must be a name, got {spec['fn']!r}")
    user = is_import_path(spec["fn"])
    try:
        fn = resolve_callable(spec["fn"], path.parent) if user else registry.get(spec["fn"])
    except ConfigError as e:
        hint = "" if user else " (or an import path: 'module:attr' or 'path/to/file.py:attr')"
        raise ConfigError(f"{where}: {e}{hint}") from None
    params = spec["params"] if "params" in spec else {}
    if not isinstance(params, dict):
        raise ConfigError(f"{where}: params must be a mapping, got {params!r}")
    what = f"{registry.kind} {spec['fn']!r}"
    sig = None
    try:
        if kind == "detector" or fn is combined:
            allowed, required = texts_signature(fn)
        else:
            sig = reward_signature(fn)
            allowed, required = list(sig.params), list(sig.required) if sig.style == "texts" else []
    except TypeError as e:
        if not user:
            raise
        form = "(completions, *, <params>)" + (" or TRL's reward signature" if kind == "reward" else "")
        raise ConfigError(f"{where}: {what} cannot be a {kind}: {e}; expected {form}") from None
    for p in params:
        if p not in allowed:
            raise ConfigError(f"{where}: unknown param {p!r} for {what}; allowed: {', '.join(allowed) or '(none)'}")
    for p in required:
        if p not in params:
            raise ConfigError(f"{where}: missing required param {p!r} for {what}")
    return fn, params, sig


def _validate_model(path: Path, name: str, spec: dict):
    """A reward model binding ``{model: <checkpoint>, rh_detector: ...}``; returns (spec, {}, "model")."""
    where = f"{path}: reward binding {name!r}"
    for key in spec:
        if key not in _MODEL_KEYS:
            raise ConfigError(f"{where}: unknown key {key!r} for a reward model binding; allowed: "
                              f"{', '.join(_MODEL_KEYS)}")  # fmt: skip
    try:
        return check_reward_model(spec["model"], path.parent), {}, "model"
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None


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
        if fn.kind == "model":
            raise ConfigError(f"{where}: component {i} is the reward model binding {ref!r}: a reward model cannot be a "
                              "combined component (TRL scores a training reward model itself, alone); bind it as "
                              "the --reward")  # fmt: skip
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


def _probe(path: Path, kind: str, name: str, fn: Callable, out_type: type, user: bool) -> None:
    """Evaluate a binding once so that bad param values fail at load time. A registered function's ValueError is
    a bad param value; any exception of a user's function is a config error, and its values may be any real
    number (or None: TRL's "not applicable") for a reward."""
    try:
        out = fn(list(_PROBE_TEXTS), **_probe_kwargs(fn))
    except ValueError as e:
        raise ConfigError(f"{path}: {kind} binding {name!r}: {e}") from None
    except Exception as e:  # noqa: BLE001
        if not user:
            raise
        raise ConfigError(f"{path}: {kind} binding {name!r}: calling it on {len(_PROBE_TEXTS)} probe texts raised "
                          f"{type(e).__name__}: {' '.join(str(e).split())}") from None  # fmt: skip
    if user and kind == "reward":
        ok = lambda v: v is None or (isinstance(v, numbers.Real) and not isinstance(v, bool))  # noqa: E731
    else:
        ok = lambda v: type(v) is out_type  # noqa: E731
    if not isinstance(out, list) or len(out) != len(_PROBE_TEXTS) or not all(ok(v) for v in out):
        msg = f"{kind} binding {name!r} must return a list of {out_type.__name__}, one per text; got {out!r}"
        if user:
            raise ConfigError(f"{path}: {msg}")
        raise TypeError(msg)
