"""train.py's ``--help``: every flag grouped by the dataclass that declares it, each with its default.

`transformers.HfArgumentParser` puts a dataclass's fields in an argument group named by its ``_argument_group_name``,
but `ExtGRPOConfig` is one dataclass made of the feature subpackages' flag dataclasses (its bases). `group_flags`
moves every flag into the group of the most basic class that declares it: a feature's ``_argument_group_name``
(e.g. ``RoutingArgs``: gradient routing), or TRL's and transformers' own fields (``GRPOConfig``,
``TrainingArguments``, including those whose default the project overrides) in one group of their own.

argparse %-formats help strings (``ArgumentDefaultsHelpFormatter`` appends ``(default: %(default)s)``), so a bare
``%`` in a field's help (``train[:90%]``) is escaped here once for every flag.
"""

from __future__ import annotations

import argparse
import dataclasses
import re

from trl_ext import compat

TRL_GROUP = "TRL GRPOConfig and transformers TrainingArguments fields (train.py's defaults: TRAIN_DEFAULTS)"
_PERCENT = re.compile(r"%%|%\(|%")  # already escaped, a format field, or a bare % (escaped)


def declaring_class(cls: type, name: str) -> type:
    """The most basic class in ``cls``'s MRO whose own annotations declare the field ``name``."""
    owners = [c for c in cls.__mro__ if name in c.__dict__.get("__annotations__", {})]
    return owners[-1]


def group_title(owner: type) -> str:
    return owner.__dict__["_argument_group_name"]


def group_flags(parser: argparse.ArgumentParser, config_cls: type) -> argparse.ArgumentParser:
    """Regroup the flags of ``config_cls`` (already added to ``parser``) by declaring class and escape bare ``%``
    in every help string; returns ``parser``."""
    fields = {f.name for f in dataclasses.fields(config_cls)}
    for _, actions in compat.action_groups(parser):
        for action in actions:
            if action.help:
                action.help = _PERCENT.sub(lambda m: "%%" if m.group() == "%" else m.group(), action.help)
    moved: dict[type, list[argparse.Action]] = {}
    for _, actions in compat.action_groups(parser):  # HfArgumentParser put config_cls's fields in one group
        for action in [a for a in actions if a.dest in fields]:
            owner = declaring_class(config_cls, action.dest)
            moved.setdefault(owner if "_argument_group_name" in owner.__dict__ else None, []).append(action)
            actions.remove(action)
    compat.drop_empty_groups(parser)
    # the features in the order of config_cls's bases, then config_cls's own fields, then TRL's and transformers'
    mro = config_cls.__mro__
    for owner in sorted(moved, key=lambda c: len(mro) if c is None else (mro.index(c) or len(mro) - 1)):
        group = parser.add_argument_group(group_title(owner) if owner else TRL_GROUP)
        dict(compat.action_groups(parser))[group].extend(moved[owner])
    return parser
