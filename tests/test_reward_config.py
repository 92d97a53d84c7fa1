"""config.yaml binding: params through functools.partial, combined rewards, and every bad input."""

import re
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from rewards import load_reward_config
from trl_ext.registry import ConfigError

SHIPPED = Path(__file__).resolve().parents[1] / "config.yaml"

# words: the happy dog ran | happy -> sentences [4, 1], 5 words, "happy" x2
TEXT = "The happy dog ran. Happy!"


def write(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "rewards.yaml"
    path.write_text(textwrap.dedent(body))
    return path


def load(tmp_path: Path, body: str):
    return load_reward_config(write(tmp_path, body))


BASIC = """
    rewards:
      hb: {fn: happy_binary}
      sl4: {fn: sentence_length, params: {target: 4}}
      sl2_smooth: {fn: sentence_length_smooth, params: {target: 2}}
      mix:
        fn: combined
        params:
          components:
            - {reward: sl4, weight: 2.0}
            - {reward: hc, weight: 0.5, cap: 1.5}
        rh_detector: any_happy
      hc: {fn: happy_count}
    detectors:
      any_happy: {fn: happy_count, params: {threshold: 1}}
      twice: {fn: happy_count, params: {threshold: 3}}
      dense: {fn: happy_density, params: {max_density: 0.3}}
      mood: {fn: contains_words, params: {words: [Sad, dog]}}
"""


def test_binding_with_params(tmp_path):
    cfg = load(tmp_path, BASIC)
    assert cfg.reward_names() == ["hb", "hc", "mix", "sl2_smooth", "sl4"]
    assert cfg.detector_names() == ["any_happy", "dense", "mood", "twice"]
    texts = [TEXT, "", "A cat sat"]
    # TEXT: sentences [4, 1], "happy" x2, 5 words; "A cat sat": one sentence of 3 words
    assert cfg.reward("hb")(texts) == [1.0, 0.0, 0.0]
    assert cfg.reward("hc")(texts) == [2.0, 0.0, 0.0]
    assert cfg.reward("sl4")(texts) == [0.5, 0.0, 0.0]
    # target 2: TEXT (max(0, 1 - 2/2) + 1 - 1/2) / 2 = 0.25; "A cat sat": 1 - 1/2
    assert cfg.reward("sl2_smooth")(texts) == [0.25, 0.0, 0.5]
    # mix = 2.0 * sl4 + 0.5 * min(hc, 1.5): TEXT 2*0.5 + 0.5*1.5
    assert cfg.reward("mix")(texts) == [1.75, 0.0, 0.0]
    assert cfg.detector("any_happy")(texts) == [True, False, False]
    assert cfg.detector("twice")(texts) == [False, False, False]
    assert cfg.detector("dense")(texts) == [True, False, False]  # 2/5 = 0.4 > 0.3
    assert cfg.detector("mood")(texts) == [True, False, False]
    assert cfg.default_detector("mix") == "any_happy"
    assert cfg.default_detector("hb") is None
    assert cfg.binding("rewards", "sl4") == {"fn": "sentence_length", "params": {"target": 4}}


def test_unknown_names_at_lookup(tmp_path):
    cfg = load(tmp_path, BASIC)
    with pytest.raises(ConfigError, match=r"unknown reward 'nope' .*bound: hb, hc, mix, sl2_smooth, sl4$"):
        cfg.reward("nope")
    with pytest.raises(ConfigError, match=r"unknown detector 'nope' .*bound: any_happy, dense, mood, twice$"):
        cfg.detector("nope")
    with pytest.raises(ConfigError, match="unknown reward 'nope'"):
        cfg.default_detector("nope")


def test_shipped_config_evaluates_every_binding():
    cfg = load_reward_config(SHIPPED)
    # sentences: "happy happy day" 3 | "the small dog ran home" 5 | "it was a good day for him" 7 -> words 15,
    # "happy" x2
    text = "Happy, happy day! The small dog ran home. It was a good day for him"
    expected_rewards = {
        "happy_binary": 1.0,
        "happy_count": 2.0,
        "happy_exp": 0.75,
        "sentence_length_5": 1 / 3,
        "sentence_length_10": 0.0,
        "sentence_length_5_smooth": (0.6 + 1.0 + 0.6) / 3,
        "sentence_length_10_smooth": (0.3 + 0.5 + 0.7) / 3,
        "sentence_length_5_with_happy": 1 / 3 + 0.25 * 2,
        "sentence_length_10_smooth_with_happy": (0.3 + 0.5 + 0.7) / 3 + 0.25 * 2,
    }
    assert cfg.reward_names() == sorted([*expected_rewards, "exact_match", "math_accuracy"])
    for name, value in expected_rewards.items():
        assert cfg.reward(name)([text, ""]) == pytest.approx([value, 0.0]), name
    # the accuracy rewards read the `answer` column (TRL signature): 0.5 = 1/2, and a wrong answer
    for name in ("exact_match", "math_accuracy"):
        assert cfg.reward(name)(["<answer>0.5</answer>", "3"], answer=["0.5", "1/2"]) == [1.0, 0.0], name
    assert cfg.reward("math_accuracy")(["The result is 1/2", "0.25"], answer=["0.5", "1/2"]) == [1.0, 0.0]
    # density 2/15 ~ 0.133 > 0.05; "happy" twice
    expected_detectors = {"happy": True, "happy_repeated": True, "happy_dense": True, "positive_words": True}
    assert cfg.detector_names() == sorted([*expected_detectors, "env_loophole", "ml_task_leak"])
    for name, value in expected_detectors.items():
        assert cfg.detector(name)([text, "A sad dog."]) == [value, False], name
    paid, clean = ({"loophole": True}, {"loophole": False})  # env_loophole judges episodes' step info, not the text
    episodes = [SimpleNamespace(turns=[SimpleNamespace(info=clean), SimpleNamespace(info=paid)]),
                SimpleNamespace(turns=[SimpleNamespace(info=clean)])]
    assert cfg.detector("env_loophole")([text, text], trajectories=episodes) == [True, False]
    assert cfg.default_detector("sentence_length_5_with_happy") == "happy"
    assert cfg.default_detector("happy_binary") is None


@pytest.mark.parametrize(
    "body, message",
    [
        ("rewards:\n  r: {fn: happy_bin}\n",
         r"reward binding 'r': unknown reward function 'happy_bin'; registered: combined, exact_match, happy_binary, "
         r"happy_count, happy_exp, math_accuracy, sentence_length, sentence_length_smooth \(or an import path: "
         r"'module:attr' or 'path/to/file.py:attr'\)$"),
        ("rewards:\n  r: {fn: happy_binary}\ndetectors:\n  d: {fn: happy_counter}\n",
         r"detector binding 'd': unknown detector 'happy_counter'; registered: contains_words, env_info_flag, "
         r"happy_count, happy_density, ml_task_leak \(or an import path: 'module:attr' or 'path/to/file.py:attr'\)$"),
        ("rewards:\n  r: {fn: sentence_length, params: {targt: 5}}\n",
         r"unknown param 'targt' for reward function 'sentence_length'; allowed: target$"),
        ("rewards:\n  r: {fn: happy_binary, params: {target: 5}}\n",
         r"unknown param 'target' for reward function 'happy_binary'; allowed: \(none\)$"),
        ("rewards:\n  r: {fn: happy_binary}\ndetectors:\n  d: {fn: happy_density, params: {max: 0.1}}\n",
         r"detector binding 'd': unknown param 'max' for detector 'happy_density'; allowed: max_density$"),
        ("rewards:\n  r: {fn: sentence_length}\n",
         r"reward binding 'r': missing required param 'target' for reward function 'sentence_length'$"),
        ("rewards:\n  r: {fn: happy_binary}\ndetectors:\n  d: {fn: contains_words}\n",
         r"detector binding 'd': missing required param 'words' for detector 'contains_words'$"),
        ("rewards:\n  r: {fn: happy_binary, param: {target: 5}}\n",
         r"reward binding 'r': unknown key 'param'; allowed: fn, params, rh_detector$"),
        ("rewards:\n  r: {fn: happy_binary}\n"
         "detectors:\n  d: {fn: happy_count, rh_detector: x, params: {threshold: 1}}\n",
         r"detector binding 'd': unknown key 'rh_detector'; allowed: fn, params$"),
        ("rewards:\n  r: {params: {target: 5}}\n", r"reward binding 'r': missing key 'fn' \(or 'model': a reward model\)$"),
        ("rewards:\n  r: {fn: happy_binary, rh_detector: nope}\n",
         r"reward binding 'r': rh_detector 'nope' is not a bound detector; bound: \(none\)$"),
        ("rewards:\n  r: {fn: happy_binary, rh_detector: [a]}\n"
         "detectors:\n  a: {fn: happy_count, params: {threshold: 1}}\n",
         r"reward binding 'r': rh_detector \['a'\] is not a bound detector; bound: a$"),
        ("rewards:\n  r: {fn: sentence_length, params: {target: 0}}\n",
         r"reward binding 'r': target must be a positive integer, got 0$"),
        ("rewards:\n  r: {fn: happy_binary}\ndetectors:\n  d: {fn: happy_density, params: {max_density: 2}}\n",
         r"detector binding 'd': max_density must lie in \[0, 1\)"),
        ("rewards:\n  r: {fn: happy_binary}\nreward:\n  s: {fn: happy_binary}\n",
         r"unknown top-level key 'reward'; allowed: rewards, detectors$"),
        ("detectors:\n  d: {fn: happy_count, params: {threshold: 1}}\n", r"missing top-level key 'rewards'$"),
        ("rewards: {}\n", r"'rewards' must be a non-empty mapping"),
        ("rewards:\n  r: happy_binary\n", r"reward binding 'r' must be a mapping with keys fn, params, rh_detector"),
    ],
)
def test_bad_binding(tmp_path, body, message):
    path = write(tmp_path, body)
    with pytest.raises(ConfigError, match=message) as err:
        load_reward_config(path)
    assert str(err.value).startswith(f"{path}: ")
    assert "\n" not in str(err.value)


def combined_body(*components: str) -> str:
    comps = "".join(f"\n        - {c}" for c in components)
    return f"rewards:\n  hc: {{fn: happy_count}}\n  mix:\n    fn: combined\n    params:\n      components:{comps}\n"


@pytest.mark.parametrize(
    "components, message",
    [
        (["{reward: sentence_length_5, weight: 1.0}"],
         r"reward binding 'mix': component 0 refers to unknown reward binding 'sentence_length_5'; bound: hc, mix$"),
        (["{reward: hc, weight: 1.0}", "{reward: hc}"], r"reward binding 'mix': component 1 is missing key 'weight'$"),
        (["{reward: hc, weight: 1.0, cap: 2, scale: 3}"],
         r"component 0 has unknown key 'scale'; allowed: reward, weight, cap$"),
        (["{reward: hc, weight: .nan}"], r"reward binding 'mix': component 'hc' weight must be a finite number"),
        (["{reward: hc, weight: 1.0, cap: two}"], r"component 'hc' cap must be a finite number, got 'two'$"),
        (["hc"], r"component 0 must be a mapping with keys reward, weight, cap$"),
    ],
)
def test_bad_component(tmp_path, components, message):
    with pytest.raises(ConfigError, match=message):
        load(tmp_path, combined_body(*components))


def test_combined_without_components(tmp_path):
    with pytest.raises(ConfigError, match=r"reward binding 'mix': components must be a non-empty list, got \[\]$"):
        load(tmp_path, "rewards:\n  mix: {fn: combined, params: {components: []}}\n")


def test_combined_cycle(tmp_path):
    body = """
        rewards:
          a: {fn: combined, params: {components: [{reward: b, weight: 1.0}]}}
          b: {fn: combined, params: {components: [{reward: hc, weight: 1.0}, {reward: c, weight: 1.0}]}}
          c: {fn: combined, params: {components: [{reward: a, weight: 1.0}]}}
          hc: {fn: happy_count}
    """
    with pytest.raises(ConfigError, match=r"cycle in combined rewards: a -> b -> c -> a$"):
        load(tmp_path, body)
    with pytest.raises(ConfigError, match=r"cycle in combined rewards: s -> s$"):
        load(tmp_path, "rewards:\n  s: {fn: combined, params: {components: [{reward: s, weight: 1.0}]}}\n")


def test_nested_combined(tmp_path):
    body = """
        rewards:
          outer:
            fn: combined
            params: {components: [{reward: inner, weight: 2.0, cap: 1.0}, {reward: hb, weight: 1.0}]}
          inner: {fn: combined, params: {components: [{reward: hc, weight: 0.5}]}}
          hc: {fn: happy_count}
          hb: {fn: happy_binary}
    """
    cfg = load(tmp_path, body)
    # "happy" x3: inner = 0.5*3 = 1.5; outer = 2.0*min(1.5, 1.0) + 1.0*1 = 3.0
    assert cfg.reward("outer")(["happy happy happy", "sad"]) == [3.0, 0.0]


def test_malformed_yaml(tmp_path):
    path = write(tmp_path, "rewards:\n  r: {fn: happy_binary\n")
    with pytest.raises(ConfigError, match=r"malformed YAML: while parsing a flow mapping") as err:
        load_reward_config(path)
    assert str(err.value).startswith(f"{path}: ") and "\n" not in str(err.value)


def test_duplicate_key(tmp_path):
    with pytest.raises(ConfigError, match=r"malformed YAML: .*duplicate key 'r'"):
        load(tmp_path, "rewards:\n  r: {fn: happy_binary}\n  r: {fn: happy_count}\n")


def test_missing_file(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match=re.escape(f"reward config file not found: {missing}") + "$"):
        load_reward_config(missing)
