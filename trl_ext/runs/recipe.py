"""Recipes: run files of train.py flags, the command line overriding them.

    uv run train.py @ recipes/offpolicy_lag.toml --max_async_level 16      (prime-rl's ``@ file``)
    uv run train.py --recipe recipes/offpolicy_lag.toml --max_async_level 16
    uv run train.py @ output/RUN/run_config.yaml --output_dir output/again  (a run's own config: the same run again)

A recipe is a TOML or YAML mapping of flag names (train.py's, as ``--help`` lists them, with ``_`` or ``-``; an alias
such as ``lr`` too) to values: a bool, a number, a string, a list for a flag that takes several values, a mapping for a
flag that takes JSON (``lr_scheduler_kwargs``). Its flags are put before the command line's, so argparse gives the
command line the last word, and every value goes through the same parsing and checks as typed flags: a key that is no
flag, a list for a one-value flag or a null is a ConfigError (exit 2). ``--config`` stays the reward registry.

Every run records the flags it was given (``flags`` in run_config.yaml: the recipe's and the command line's, less
`NOT_RECORDED`, which say how a run starts, not what it is), so a run's run_config.yaml is itself a recipe. Run from
one (`Recipe.origin`), train.py also checks that the recipe's flags alone still resolve to the saved run's
run-defining values and launch (a changed default would otherwise change the run silently), refuses the saved run's
own directory, and checks the start weights against the saved run's ``start_weights.json`` (`runs.provenance`).
"""

from __future__ import annotations

import argparse
import json
import tomllib
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

import yaml

from trl_ext.compat import is_store_false, option_actions, parser_actions
from trl_ext.registry import ConfigError

RECIPE_FLAG = "--recipe"
FLAGS_SECTION = "flags"  # run_config.yaml's record of the flags a run was given
RUN_CONFIG_SECTIONS = ("RunArgs", "ExtGRPOConfig")  # a run_config.yaml has these (runlog.resolved_config)
NOT_RECORDED = ("resume_from_checkpoint", "overwrite_run", "rebuild_builtin")


@dataclass
class Recipe:
    path: Path
    flags: dict
    origin: Path | None = None  # the run directory, when the recipe is that run's run_config.yaml
    saved: dict = field(default_factory=dict)  # that run's run_config.yaml


def split_recipes(argv: list[str]) -> tuple[list[Path], list[str]]:
    """(recipe paths in order, the other arguments): ``@ FILE``, ``@FILE``, ``--recipe FILE``, ``--recipe=FILE``."""
    paths, rest, i = [], [], 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("@", RECIPE_FLAG):
            if i + 1 >= len(argv):
                raise ConfigError(f"{arg} needs a recipe file after it")
            paths.append(Path(argv[i + 1]))
            i += 2
            continue
        if arg.startswith("@"):
            paths.append(Path(arg[1:]))
        elif arg.startswith(RECIPE_FLAG + "="):
            paths.append(Path(arg.split("=", 1)[1]))
        else:
            rest.append(arg)
        i += 1
    return paths, rest


def load_recipe(path: Path) -> Recipe:
    """A recipe file: a TOML or YAML mapping of flags, or a run's run_config.yaml (its ``flags``)."""
    if not path.is_file():
        raise ConfigError(f"recipe {path} does not exist")
    try:
        data = tomllib.loads(path.read_text()) if path.suffix == ".toml" else yaml.safe_load(path.read_text())
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as e:
        raise ConfigError(f"recipe {path} does not parse: {e}") from None
    if path.suffix not in (".toml", ".yaml", ".yml"):
        raise ConfigError(f"recipe {path}: a .toml, .yaml or .yml file")
    if not isinstance(data, dict):
        raise ConfigError(f"recipe {path}: a mapping of flag names to values, got {type(data).__name__}")
    if all(section in data for section in RUN_CONFIG_SECTIONS):
        if not isinstance(data.get(FLAGS_SECTION), dict):
            raise ConfigError(f"{path} is a run_config.yaml without the '{FLAGS_SECTION}' section (written before runs "
                              "recorded their flags): pass the run's flags as a recipe")
        return Recipe(path, data[FLAGS_SECTION], origin=path.parent, saved=data)
    return Recipe(path, data)


def options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Every long option of ``parser`` without its dashes (``lr``, ``learning_rate``, ``learning-rate``) -> action."""
    return {o[2:]: a for a in parser_actions(parser) for o in a.option_strings if o.startswith("--")}


def recipe_argv(recipe: Recipe, parser: argparse.ArgumentParser) -> list[str]:
    """The recipe's flags as command-line arguments for ``parser``."""
    known, out = options(parser), []
    for key, value in recipe.flags.items():
        name = str(key).replace("-", "_")
        action = known.get(name) or known.get(str(key))
        where = f"recipe {recipe.path}: {key!r}"
        if action is None or action.dest == "help":
            hint = " (write a section's flags at the top level)" if isinstance(value, dict) else ""
            raise ConfigError(f"{where} is not a train.py flag{hint}; see train.py --help")
        if is_store_false(action):  # --no_X: give X: false instead
            raise ConfigError(f"{where}: set {action.dest} to false instead")
        out += [f"--{name}", *_values(where, action, value)]
    return out


def _values(where: str, action: argparse.Action, value) -> list[str]:
    if value is None:
        raise ConfigError(f"{where} is null: leave the flag out for its default")
    several = action.nargs in ("+", "*")
    if isinstance(value, (list, tuple)):
        if not several:
            raise ConfigError(f"{where} takes one value, got a list")
        return [_text(where, v) for v in value]
    if isinstance(value, dict):
        return [json.dumps(value)]
    return [_text(where, value)]


def _text(where: str, v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return repr(v)
    if isinstance(v, (int, str)):
        return str(v)
    raise ConfigError(f"{where}: a {type(v).__name__} value is not a flag's")


def expand(argv: list[str], parser: argparse.ArgumentParser) -> tuple[list[str], list[Recipe]]:
    """``argv`` with its recipes' flags put first, in the recipes' order, then the command line's; the recipes."""
    paths, rest = split_recipes(argv)
    recipes = [load_recipe(p) for p in paths]
    if len(recipes) > 1 and any(r.origin is not None for r in recipes):
        raise ConfigError("a run's run_config.yaml is a whole run: give it as the only recipe")
    return [a for r in recipes for a in recipe_argv(r, parser)] + rest, recipes


def given_flags(argv: list[str], parser: argparse.ArgumentParser) -> dict:
    """The flags ``argv`` gives ({dest: value as parsed}), less `NOT_RECORDED`: run_config.yaml's ``flags``. The
    options are matched whole (train.py's parser takes no abbreviations)."""
    namespace, _ = parser.parse_known_args(argv)
    actions = option_actions(parser)
    given = {actions[a.split("=", 1)[0]].dest for a in argv if a.startswith("--") and a.split("=", 1)[0] in actions}
    return {k: _plain(getattr(namespace, k)) for k in sorted(given, key=list(vars(namespace)).index)
            if k not in NOT_RECORDED}


def _plain(v):
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, Enum):
        return v.value
    return v if v is None or isinstance(v, (bool, int, float, str)) else str(v)
