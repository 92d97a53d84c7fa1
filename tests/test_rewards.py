"""Reward functions, RH detectors, the TRL adapter and the accuracy rewards on hand-written texts (expected values
derived by hand)."""

import functools
import math

import pytest

from rewards import as_trl_reward, completion_texts, sentence_lengths, words
from rewards.accuracy import exact_match, final_answer, math_accuracy, normalize
from rewards.detectors import DETECTORS, detect_contains_words, detect_happy_count, detect_happy_density
from rewards.functions import (
    REWARD_FNS,
    Component,
    combined,
    happy_binary,
    happy_count,
    happy_exp,
    sentence_length,
    sentence_length_smooth,
)

EMPTY = ""
# words: happy happy day | i am unhappy | the end  -> 8 words, "happy" x2, sentences [3, 3, 2]
T1 = "Happy, happy day! I am unhappy... The end"
# the cat sat down quietly | it was a very sunny day | then it slept (trailing fragment) -> [5, 6, 3]
T2 = "The cat sat down quietly. It was a very sunny day?! Then it slept"
# HAPPY happy HaPpY | happyness and unhappy are not words we count -> 11 words, "happy" x3, [3, 8]
T3 = "HAPPY happy HaPpY. Happyness and unhappy are not words we count!"
PUNCT = " ...!? "  # no word, hence no sentence
TEXTS = [EMPTY, T1, T2, T3, PUNCT]


# ---------------------------------------------------------------------------------------------- text helpers
def test_words_are_lowercased_whole_words():
    assert words("Happy, HAPPY! unhappy happyness") == ["happy", "happy", "unhappy", "happyness"]
    assert words("Happy-go-lucky Tom.") == ["happy", "go", "lucky", "tom"]
    assert words("She didn't go; Sam's dog_bowl 42") == ["she", "didn't", "go", "sam's", "dog", "bowl", "42"]
    assert words("") == []


def test_sentence_lengths():
    assert sentence_lengths(T1) == [3, 3, 2]
    assert sentence_lengths(T2) == [5, 6, 3]
    assert sentence_lengths(T3) == [3, 8]
    assert sentence_lengths(PUNCT) == []
    assert sentence_lengths(EMPTY) == []
    # a closing quote after the full stop is a word-less fragment and is dropped
    assert sentence_lengths('She didn\'t cry. "I\'m happy!" she said."') == [3, 2, 2]
    assert sentence_lengths("No punctuation at all") == [4]


# ---------------------------------------------------------------------------------------------- rewards
def test_happy_rewards():
    assert happy_count(TEXTS) == [0.0, 2.0, 0.0, 3.0, 0.0]
    assert happy_binary(TEXTS) == [0.0, 1.0, 0.0, 1.0, 0.0]
    assert happy_exp(TEXTS) == [0.0, 1 - 1 / 4, 0.0, 1 - 1 / 8, 0.0]
    assert happy_binary(["I was unhappy", "happy's", "Happy."]) == [0.0, 0.0, 1.0]


def test_sentence_length_exact():
    assert sentence_length(TEXTS, target=5) == [0.0, 0.0, 1 / 3, 0.0, 0.0]
    assert sentence_length(TEXTS, target=3) == pytest.approx([0.0, 2 / 3, 1 / 3, 1 / 2, 0.0])


def test_sentence_length_smooth():
    # target 5: T1 [3,3,2] -> (0.6 + 0.6 + 0.4)/3; T2 [5,6,3] -> (1 + 0.8 + 0.6)/3; T3 [3,8] -> (0.6 + 0.4)/2
    assert sentence_length_smooth(TEXTS, target=5) == pytest.approx([0.0, 1.6 / 3, 0.8, 0.5, 0.0])
    # target 2 clips at zero: T3 [3,8] -> (1 - 1/2 + max(0, 1 - 6/2)) / 2 = 0.25
    assert sentence_length_smooth([T3], target=2) == pytest.approx([0.25])
    # target 10: T2 [5,6,3] -> (0.5 + 0.6 + 0.3)/3
    assert sentence_length_smooth([T2], target=10) == pytest.approx([1.4 / 3])


def test_combined_weights_and_caps():
    sl3 = functools.partial(sentence_length, target=3)
    comps = [Component("happy_count", happy_count, weight=0.25, cap=2), Component("sl3", sl3, weight=1.0)]
    # T1: 0.25*min(2,2) + 2/3; T2: 0 + 1/3; T3: 0.25*min(3,2) + 1/2
    assert combined(TEXTS, components=comps) == pytest.approx([0.0, 0.5 + 2 / 3, 1 / 3, 1.0, 0.0])
    uncapped = [Component("happy_count", happy_count, weight=0.25)]
    assert combined([T3], components=uncapped) == [0.75]
    penalty = [Component("happy_count", happy_count, weight=-1.0, cap=2.5)]
    assert combined([T1, T3], components=penalty) == [-2.0, -2.5]


def test_registry_names():
    assert REWARD_FNS.names() == sorted(
        ["happy_binary", "happy_count", "happy_exp", "sentence_length", "sentence_length_smooth", "combined",
         "exact_match", "math_accuracy"])
    assert DETECTORS.names() == ["contains_words", "env_info_flag", "happy_count", "happy_density",
                                "ml_task_leak"]


@pytest.mark.parametrize("target", [0, -3, 2.5, True, "5", None])
def test_sentence_length_rejects_bad_target(target):
    for fn in (sentence_length, sentence_length_smooth):
        with pytest.raises(ValueError, match="target must be a positive integer"):
            fn(["a b."], target=target)


def test_rewards_reject_non_text_input():
    with pytest.raises(TypeError, match="list of strings, got str"):
        happy_count("happy")  # a bare string would otherwise be read character by character
    with pytest.raises(TypeError, match=r"completions\[1\] must be a string"):
        happy_binary(["happy", None])


def test_component_validation():
    with pytest.raises(ValueError, match="weight must be a finite number"):
        Component("h", happy_count, weight=math.nan)
    with pytest.raises(ValueError, match="cap must be a finite number"):
        Component("h", happy_count, weight=1.0, cap="2")
    with pytest.raises(ValueError, match="non-empty list"):
        combined(["x"], components=[])


# ---------------------------------------------------------------------------------------------- detectors
def test_detect_happy_count():
    assert detect_happy_count(TEXTS, threshold=1) == [False, True, False, True, False]
    assert detect_happy_count(TEXTS, threshold=3) == [False, False, False, True, False]


def test_detect_happy_density():
    # densities: T1 2/8 = 0.25, T2 0/14, T3 3/11 ~ 0.273; EMPTY and PUNCT have no words -> False
    assert detect_happy_density(TEXTS, max_density=0.25) == [False, False, False, True, False]
    assert detect_happy_density(TEXTS, max_density=0.0) == [False, True, False, True, False]
    assert detect_happy_density(TEXTS, max_density=0.27) == [False, False, False, True, False]
    assert detect_happy_density(TEXTS, max_density=0.28) == [False] * 5


def test_detect_contains_words():
    assert detect_contains_words(TEXTS, words=["Glad", "unhappy"]) == [False, True, False, True, False]
    assert detect_contains_words(TEXTS, words=["SAT"]) == [False, False, True, False, False]
    assert detect_contains_words(["so unhappy", "happyness"], words=["happy"]) == [False, False]
    assert detect_contains_words(["Don't!"], words=["don't"]) == [True]


@pytest.mark.parametrize(
    "fn, params, message",
    [
        (detect_happy_count, {"threshold": 0}, "threshold must be a positive integer"),
        (detect_happy_density, {"max_density": 1.0}, r"max_density must lie in \[0, 1\)"),
        (detect_happy_density, {"max_density": -0.1}, r"max_density must lie in \[0, 1\)"),
        (detect_happy_density, {"max_density": "0.1"}, "max_density must be a finite number"),
        (detect_contains_words, {"words": "happy"}, "words must be a non-empty list"),
        (detect_contains_words, {"words": []}, "words must be a non-empty list"),
        (detect_contains_words, {"words": ["very happy"]}, "single words.*'very happy'"),
    ],
)
def test_detectors_reject_bad_params(fn, params, message):
    with pytest.raises(ValueError, match=message):
        fn(["happy"], **params)


# ---------------------------------------------------------------------------------------------- TRL adapter
def test_as_trl_reward_plain_and_conversational():
    f = as_trl_reward("sentence_length_3", functools.partial(sentence_length, target=3))
    assert f.__name__ == "sentence_length_3"  # TRL logs rewards/<__name__>/mean
    out = f(prompts=["p1", "p2"], completions=[T1, T3], completion_ids=[[1], [2]], trainer_state=None)
    assert out == pytest.approx([2 / 3, 1 / 2])
    conversational = [
        [{"role": "assistant", "content": T1}],
        [{"role": "assistant", "content": "ignored"}, {"role": "assistant", "content": T3}],
    ]
    assert f(prompts=[[], []], completions=conversational, completion_ids=[[1], [2]]) == pytest.approx([2 / 3, 1 / 2])


def test_completion_texts_rejects_malformed():
    with pytest.raises(TypeError, match="no string 'content'"):
        completion_texts([[]])
    with pytest.raises(TypeError, match="no string 'content'"):
        completion_texts([[{"role": "assistant", "content": [{"type": "text", "text": "x"}]}]])
    with pytest.raises(TypeError, match=r"completions\[0\] must be a string or a list of messages"):
        completion_texts([3])


def test_as_trl_reward_checks_length():
    f = as_trl_reward("broken", lambda texts: [1.0])
    with pytest.raises(ValueError, match="'broken' returned 1 values for 2 completions"):
        f(prompts=["a", "b"], completions=["x", "y"], completion_ids=[[1], [2]])


# ---------------------------------------------------------------------------------------------- accuracy
def test_final_answer_and_normalize():
    assert final_answer("so <answer> Paris. </answer> and <answer>Rome</answer>") == "Rome"  # the last tag
    assert final_answer(r"thus \boxed{\frac{1}{2}} or \boxed{x^{2}}") == "x^{2}"  # nested braces
    assert final_answer(r"<answer>a</answer> \boxed{b}") == "a"  # the tag first
    assert final_answer(r"open \boxed{1") == r"open \boxed{1"  # unclosed: the whole text
    assert normalize("  The  Eiffel\nTower. ") == "the eiffel tower"
    assert normalize("3.") == "3" and normalize("3.5") == "3.5" and normalize("...") == ".."


def test_exact_match():
    completions = ["<answer> Paris. </answer>", r"It is \boxed{PARIS}", "paris is it", "", "Rome", 42]
    answers = ["paris", "Paris", "Paris", "Paris", "Paris", "x"]
    assert exact_match(completions[:5], answers[:5]) == [1.0, 1.0, 0.0, 0.0, 0.0]
    assert exact_match(["7", "7.0"], [7, 7]) == [1.0, 0.0]  # numbers compare as their text
    chat = [[{"role": "assistant", "content": "<answer>Paris</answer>"}]]
    assert exact_match(chat, ["paris"]) == [1.0]
    with pytest.raises(ValueError, match=r"answer\[0\] must be a string or a number, got None"):
        exact_match(["x"], [None])
    with pytest.raises(ValueError, match="one value per completion"):
        exact_match(["x", "y"], ["x"])


def test_math_accuracy():
    cases = [
        (r"<answer>\frac{2}{4}</answer>", "0.5", 1.0),  # equal fractions, LaTeX vs decimal
        ("The answer is 1/2", r"\frac{1}{2}", 1.0),  # plain vs LaTeX gold
        (r"so $\boxed{\frac{3}{6}}$", "1/2", 1.0),
        (r"\boxed{3}", "3", 1.0),
        ("<answer>\\frac12</answer>", "0.5", 1.0),  # bare LaTeX inside the tag
        ("The answer is 7", "8", 0.0),  # wrong
        (r"\boxed{0.51}", "1/2", 0.0),
        ("", "3", 0.0),  # no answer
        ("no idea", "3", 0.0),
    ]
    got = math_accuracy([c for c, _, _ in cases], [a for _, a, _ in cases])
    assert got == [v for _, _, v in cases]
    with pytest.raises(ValueError, match=r"answer\[0\] 'banana' does not parse as math"):
        math_accuracy(["1"], ["banana"])
