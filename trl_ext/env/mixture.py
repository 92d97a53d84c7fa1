"""Task mixtures: several environments in one run (``--env frozenlake:2,sokoban,arithmetic``), as multi-task agent
runs train on several tasks at once (MLGym's tasks in one run; TRL's dict ``environment_factory``, whose dataset
column ``environment`` picks each example's environment, here the column ``env``).

- ``--env`` is a comma-separated list of registered environment names, each optionally ``:W`` with an integer weight
  W >= 1 (a missing weight is 1). A single environment takes no weight; a name given twice is an error.
- ``--env_params``: ``name.key=value`` addresses one environment of the mixture; a bare ``key=value`` applies to every
  environment of the mixture, so each of them must accept it (``strict=true``); otherwise it is refused as ambiguous.
- Prompts (`mixture_counts`, `mixture_order`): of ``n`` prompts, environment i gets ``n * w_i / sum(w)`` rows, exactly
  when ``sum(w)`` divides ``n``, else the largest-remainder (Hamilton) apportionment, ties to the earlier environment.
  Environment i's rows are its levels ``start .. start + n_i - 1``, the levels a single-environment run of ``n_i``
  prompts trains on. Rows are interleaved by smooth weighted round robin (nginx's), so every prefix of the dataset
  holds each environment within one row of its share; nothing depends on a random seed.
- A GRPO group is one prompt repeated ``num_generations`` times (TRL's ``RepeatSampler``, the off-policy generator's
  prompt stream too), so a group never mixes environments: advantages compare episodes of one level of one
  environment.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import yaml

from environments.base import env_class, parse_env_params
from trl_ext.registry import ConfigError

_ITEM = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)(?::(.*))?$")


@dataclass(frozen=True)
class Component:
    name: str
    weight: int


def parse_env_spec(text: str) -> list[Component]:
    """``"frozenlake:2,sokoban"`` -> components; ConfigError on an empty item, a bad or non-positive weight, a
    duplicate name, a weight on a single environment or an unknown name (the registry lists the known ones)."""
    items = [part.strip() for part in text.split(",")]
    out: list[Component] = []
    weighted = False
    for item in items:
        m = _ITEM.match(item)
        if not m:
            raise ConfigError(f"--env: expected name or name:weight items separated by commas, got {item!r} "
                              f"in {text!r}")
        name, weight = m.group(1), m.group(2)
        weighted |= weight is not None
        if weight is not None and (not re.fullmatch(r"[0-9]+", weight.strip()) or int(weight) < 1):
            raise ConfigError(f"--env: the weight of {name!r} must be an integer >= 1, got {weight!r}")
        _known(name, len(items))
        if any(c.name == name for c in out):
            raise ConfigError(f"--env: {name!r} given twice")
        out.append(Component(name, 1 if weight is None else int(weight)))
    if len(out) == 1 and weighted:
        raise ConfigError(f"--env {text!r}: a single environment takes no weight (weights set a mixture's shares)")
    return out


def _known(name: str, n_items: int) -> None:
    """ConfigError for an unknown name (listing the text and tool environments) or a tool environment in a mixture."""
    from trl_ext.env.tools import TOOL_ENVIRONMENTS

    if name in TOOL_ENVIRONMENTS:
        if n_items > 1:
            raise ConfigError(f"--env: the tool environment {name!r} plays alone, not in a mixture")
        return
    try:
        env_class(name)
    except ConfigError as e:
        raise ConfigError(f"{e}; tool environments: {', '.join(TOOL_ENVIRONMENTS)}") from None


def split_env_params(text: str, names: list[str]) -> dict[str, dict]:
    """``--env_params`` -> {environment name: params}. ``name.key=value`` goes to that environment (it must be in the
    mixture); a bare ``key=value`` goes to every environment, and with several environments each must accept it. Values
    are YAML scalars (`environments.base.parse_env_params`); whether a value is valid is `make_env`'s check."""
    out: dict[str, dict] = {name: {} for name in names}
    bare = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        target, dot, param = key.strip().partition(".")
        if not dot:
            bare.append(item)
            continue
        if not sep or not param.isidentifier():
            raise ConfigError(f"--env_params: expected name.key=value or key=value pairs, got {item!r}")
        if target not in out:
            raise ConfigError(f"--env_params {item!r}: {target!r} is not an environment of --env ({', '.join(names)})")
        if param in out[target]:
            raise ConfigError(f"--env_params: {target}.{param} given twice")
        out[target][param] = yaml.safe_load(value.strip()) if value.strip() else ""
    shared = parse_env_params(",".join(bare))
    for key, value in shared.items():
        if len(names) > 1:
            refusing = [n for n in names if not _accepts(n, key)]
            if refusing == names:
                raise ConfigError(f"--env_params {key}={value}: no environment of --env ({', '.join(names)}) "
                                  f"accepts {key!r}")
            if refusing:
                raise ConfigError(f"--env_params {key}={value}: ambiguous in a mixture ({', '.join(refusing)} "
                                  f"{'has' if len(refusing) == 1 else 'have'} no {key!r}); address one environment "
                                  f"as name.{key}=...")  # fmt: skip
        for name in names:
            if key in out[name]:
                raise ConfigError(f"--env_params: {key} given for {name} twice ({key}= and {name}.{key}=)")
            out[name][key] = value
    return out


def _accepts(name: str, key: str) -> bool:
    import inspect

    return key == "strict" or key in inspect.signature(env_class(name)).parameters


def mixture_counts(weights: list[int], n: int) -> list[int]:
    """Rows per environment of ``n`` prompts: ``n * w_i / W`` floored, the rest one each to the largest remainders
    (Hamilton's method; ties to the earlier environment). Exact when ``W = sum(weights)`` divides ``n``."""
    total = sum(weights)
    counts = [n * w // total for w in weights]
    rest = sorted(range(len(weights)), key=lambda i: (-(n * weights[i] % total), i))
    for i in rest[: n - sum(counts)]:
        counts[i] += 1
    return counts


def mixture_order(counts: list[int]) -> list[int]:
    """The environment index of each row: smooth weighted round robin over ``counts`` (each step every environment
    gains its count, the largest current total is picked and loses the sum), which picks environment i exactly
    ``counts[i]`` times in ``sum(counts)`` rows and keeps every prefix within one row of its share."""
    total, current, order = sum(counts), [0] * len(counts), []
    for _ in range(total):
        current = [c + w for c, w in zip(current, counts, strict=True)]
        pick = max(range(len(counts)), key=lambda i: (current[i], -i))
        current[pick] -= total
        order.append(pick)
    return order


def env_tag(text: str) -> str:
    """The run-name tag of ``--env``: the name of one environment; ``a+b`` for equal weights, else ``a2+b1`` with
    the weights divided by their greatest common divisor (equal shares, equal name)."""
    comps = parse_env_spec(text)
    if len(comps) == 1:
        return comps[0].name
    g = math.gcd(*(c.weight for c in comps))
    equal = len({c.weight for c in comps}) == 1
    return "+".join(c.name if equal else f"{c.name}{c.weight // g}" for c in comps)
