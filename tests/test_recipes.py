"""Recipes (trl_ext/runs/recipe.py): run files of train.py flags under the command line, every recipes/ file parsed,
sweeps over a recipe, and a run's run_config.yaml as a recipe (its refusals); the runs themselves are in
tests/test_recipes_e2e.py."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

import trl_ext.cli_train as cli
from trl_ext.registry import ConfigError
from trl_ext.runs.recipe import expand, given_flags, load_recipe, split_recipes

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted((ROOT / "recipes").glob("*.toml"))
# each recipe with what it needs on the command line to be a run: the mask recipe goes over a task and a lag
NEEDS = {"no_masks.toml": ["@", "recipes/offpolicy_math.toml", "@", "recipes/no_masks.toml", "--max_async_level", "1",
                           "--strict_async_level"]}  # fmt: skip


def write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_recipe_forms_are_split_out_in_order():
    paths, rest = split_recipes(["@", "a.toml", "--lr", "1", "@b.yaml", "--recipe", "c.toml", "--recipe=d.yml", "-x"])
    assert [str(p) for p in paths] == ["a.toml", "b.yaml", "c.toml", "d.yml"] and rest == ["--lr", "1", "-x"]
    with pytest.raises(ConfigError, match="@ needs a recipe file"):
        split_recipes(["--lr", "1", "@"])


def test_recipe_flags_come_first_and_the_command_line_wins(tmp_path):
    path = write(tmp_path, "r.toml", 'reward = "happy_binary"\nlr = 1e-3\nmax-async-level = 1\nstrict_async_level = '
                                     'true\nreward_weights = [1.0]\nlr_scheduler_kwargs = {min_lr = 1e-6}\n')
    argv, recipes = expand(["@", path, "--lr", "2e-3"], cli.parser())
    assert argv == ["--reward", "happy_binary", "--lr", "0.001", "--max_async_level", "1", "--strict_async_level",
                    "true", "--reward_weights", "1.0", "--lr_scheduler_kwargs", '{"min_lr": 1e-06}', "--lr", "2e-3"]
    assert [r.path for r in recipes] == [Path(path)] and recipes[0].origin is None
    plan = cli.build_plan(["@", path, "--lr", "2e-3", "--lr_scheduler_type", "cosine_with_min_lr", "--output_dir",
                           str(tmp_path)])  # fmt: skip
    assert plan.cfg.learning_rate == 2e-3 and plan.cfg.max_async_level == 1 and plan.cfg.strict_async_level
    assert plan.cfg.reward_weights == [1.0] and plan.cfg.lr_scheduler_kwargs == {"min_lr": 1e-6}
    assert plan.argv[:2] == ["@", path]  # train.log's command line is the one typed
    yaml_recipe = write(tmp_path, "r.yaml", "reward: happy_binary\nlr: 1e-3\nbatch_size: 8\nnum_generations: 4\n")
    assert cli.build_plan(["--recipe", yaml_recipe, "--output_dir", str(tmp_path)]).cfg.per_device_train_batch_size == 8


def test_given_flags_are_recorded_as_parsed():
    argv = ["--reward", "happy_binary", "--lr", "1e-3", "--strict_async_level", "--max_async_level", "2",
            "--resume_from_checkpoint", "latest", "--overwrite_run"]  # fmt: skip
    assert given_flags(argv, cli.parser()) == {"reward": "happy_binary", "learning_rate": 1e-3,
                                               "strict_async_level": True, "max_async_level": 2}


@pytest.mark.parametrize(("text", "message"), [
    ("nope = 1\n", "'nope' is not a train.py flag; see train.py --help"),
    ("[trainer]\nlr = 1\n", "'trainer' is not a train.py flag (write a section's flags at the top level)"),
    ("lr = [1e-3, 2e-3]\n", "'lr' takes one value, got a list"),
    ("no_use_full_reward_baseline = true\n", "set use_full_reward_baseline to false instead"),
    ("lr = {a = 1}\nreward = 1979-05-27\n", "a date value is not a flag's"),
    ("lr = \n", "does not parse"),
])  # fmt: skip
def test_bad_recipes_are_refused(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        expand(["@", write(tmp_path, "r.toml", text)], cli.parser())


def test_bad_recipe_files_exit_2(train_cli_error, tmp_path, capsys):
    assert "recipe nowhere.toml does not exist" in train_cli_error("@", "nowhere.toml")
    assert "a .toml, .yaml or .yml file" in train_cli_error("@", write(tmp_path, "r.json", "{}"))
    assert "is null: leave the flag out" in train_cli_error("@", write(tmp_path, "r.yaml", "lr: null\n"))
    assert "a mapping of flag names to values, got list" in train_cli_error("@", write(tmp_path, "l.yaml", "- 1\n"))
    with pytest.raises(SystemExit) as exit_:  # a value argparse refuses, as when typed
        cli.main(["@", write(tmp_path, "t.toml", 'lr = "fast"\n'), "--reward", "happy_binary"])
    assert exit_.value.code == 2 and "--lr: invalid float value: 'fast'" in capsys.readouterr().err


@pytest.fixture(scope="module")
def local_chat_model(tmp_path_factory):
    """A local stand-in for a recipe's hub chat model (offline here): a tiny Qwen3 with TRL's Qwen3 template."""
    from trl_ext.models.tiny import build_tiny, trl_template

    return str(build_tiny("qwen3", tmp_path_factory.mktemp("qwen3"), tokenizer="bytes",
                          chat_template=trl_template("qwen3"), positions=2048))  # fmt: skip


HUB_RECIPES = ("tool_search.toml",)
"""Recipes naming a hub model: parsed here with a local stand-in (--model), run from the hub cache in
tests/test_recipes_e2e.py."""


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_every_recipe_parses(recipe, tmp_path, request):
    """Each recipes/ file is a valid run with --max_steps 3 (the end-to-end tier trains a subset of them)."""
    argv = NEEDS.get(recipe.name, ["@", str(recipe.relative_to(ROOT))])
    if recipe.name in HUB_RECIPES:
        argv = [*argv, "--model", request.getfixturevalue("local_chat_model")]
    plan = cli.build_plan([*argv, "--max_steps", "3", "--output_dir", str(tmp_path)])
    assert plan.cfg.max_steps == 3 and plan.flags["max_steps"] == 3
    for key in load_recipe(recipe).flags:
        assert key.replace("-", "_") in plan.flags or key in ("lr", "batch_size", "n_rollout")  # recorded (aliases
        # are recorded by their field: learning_rate, per_device_train_batch_size, num_generations)


def test_a_sweep_over_a_recipe_plans_the_runs_of_the_flags(tmp_path):
    """sweeps/*.yaml's `recipe` (and sweep.py --recipe): every run starts from the recipe, the sweep's values over it;
    the run directories are those of the same flags given one by one."""
    from trl_ext.sweep_plan import build_spec, plan_runs

    recipe = write(tmp_path, "r.toml", f'reward = "happy_binary"\nlr = 1e-3\noutput_dir = "{tmp_path}"\n')
    args = SimpleNamespace(config=None, grid=["seed=1,2"], fixed=["lr=2e-3"], reward=None, train_flags=[],
                           baselines=[], recipe=[recipe])  # fmt: skip
    runs = plan_runs(build_spec(args))
    assert [r.argv[:2] for r in runs] == [["--recipe", recipe]] * 2
    plain = [cli.build_plan(["--reward", "happy_binary", "--lr", "2e-3", "--seed", s, "--output_dir", str(tmp_path)])
             for s in ("1", "2")]  # fmt: skip
    assert [r.run_dir for r in runs] == [p.run_dir for p in plain]
    routed = write(tmp_path, "routed.toml", 'gradient_routing = true\nrouting_mode = "shared"\n')
    with pytest.raises(ConfigError, match="sets gradient_routing, routing_mode, which the baseline arms drop"):
        build_spec(SimpleNamespace(**{**vars(args), "recipe": [routed], "baselines": ["plain"]}))


# ------------------------------------------------------------------------------------ a run's config as its recipe
def _saved_run(tmp_path: Path, *flags: str) -> Path:
    """A run directory as train.py leaves it at its start (run_config.yaml with its flags, start_weights.json),
    without training."""
    from trl_ext.runlog import write_run_config
    from trl_ext.runs.provenance import START_WEIGHTS

    plan = cli.build_plan(["--reward", "happy_binary", "--lr", "1e-3", *flags, "--output_dir", str(tmp_path / "a")])
    plan.run_dir.mkdir(parents=True)
    write_run_config(plan.run_dir / "run_config.yaml", plan.run, plan.cfg, extra={"flags": plan.flags})
    (plan.run_dir / START_WEIGHTS).write_text(json.dumps({"model": "builtin", "path": "/x", "files": {"m": "abc"}}))
    return plan.run_dir


def test_a_run_config_is_a_recipe_of_its_run(tmp_path):
    run_dir = _saved_run(tmp_path, "--max_async_level", "1")
    config = str(run_dir / "run_config.yaml")
    plan = cli.build_plan(["@", config, "--output_dir", str(tmp_path / "b")])
    assert plan.origin == run_dir and plan.run_dir == tmp_path / "b" / run_dir.name
    assert plan.cfg.learning_rate == 1e-3 and plan.cfg.max_async_level == 1
    changed = cli.build_plan(["@", config, "--max_steps", "3", "--output_dir", str(tmp_path / "b")])
    assert changed.cfg.max_steps == 3  # the command line over the recorded flags: a run's first steps


def test_a_run_config_recipe_refusals(train_cli_error, tmp_path):
    run_dir = _saved_run(tmp_path)
    config = run_dir / "run_config.yaml"
    assert f"would run again in its own run directory {run_dir}" in train_cli_error("@", str(config))
    assert "give it as the only recipe" in train_cli_error("@", str(config), "@", str(config))
    saved = yaml.safe_load(config.read_text())
    saved["ExtGRPOConfig"]["beta"] = 0.5  # the default the run had then is not today's
    config.write_text(yaml.safe_dump(saved))
    err = train_cli_error("@", str(config), "--output_dir", str(tmp_path / "b"))
    assert "no longer resolve to the run they record" in err and "beta: the run 0.5, its flags now 0.02" in err
    del saved["flags"]
    config.write_text(yaml.safe_dump(saved))
    assert "a run_config.yaml without the 'flags' section" in train_cli_error("@", str(config))
    saved["flags"], saved["launch"] = {"reward": "happy_binary"}, {"num_processes": 2}
    config.write_text(yaml.safe_dump(saved))
    assert "num_processes: the run 2, its flags now '<absent>'" in train_cli_error("@", str(config), "--output_dir",
                                                                                    str(tmp_path / "b"))


def test_a_run_config_recipe_checks_the_start_weights(tmp_path):
    from trl_ext.runs.provenance import START_WEIGHTS, check_same_start

    run_dir = _saved_run(tmp_path)
    same = {"model": "builtin", "path": "/elsewhere", "files": {"m": "abc"}}
    check_same_start(run_dir, same)  # the same weights from another path
    with pytest.raises(ConfigError, match="weights abc .* now loads def .*would not reproduce it"):
        check_same_start(run_dir, {**same, "files": {"m": "def"}})
    (run_dir / START_WEIGHTS).unlink()
    with pytest.raises(ConfigError, match="has no start_weights.json"):
        check_same_start(run_dir, same)
