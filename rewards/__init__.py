"""Reward functions, reward-hacking detectors and their config.yaml bindings."""

from .config import RewardConfig, TrlReward, as_trl_reward, completion_texts, load_reward_config
from .detectors import DETECTORS
from .functions import REWARD_FNS, Component, sentence_lengths, word_count, words

__all__ = [
    "DETECTORS",
    "REWARD_FNS",
    "Component",
    "RewardConfig",
    "TrlReward",
    "as_trl_reward",
    "completion_texts",
    "load_reward_config",
    "sentence_lengths",
    "word_count",
    "words",
]
