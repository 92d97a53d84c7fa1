"""The prompts a run trains and evaluates on: `trl_ext.data.load` loads, validates and renames ``--dataset`` /
``--eval_dataset`` (files, saved datasets, the hub), and `trl_ext.data.register` registers the reward-bound prompt
sources (the story prompts, the default, and ``--dataset``) and TRL's eval loop. Nothing is re-exported here: import
from the module."""
