import pytest

from environments.base import extract_answer, make_env, run_episode
from environments.solvers import bfs, sft_pairs, shortest_actions
from trl_ext.registry import ConfigError


def test_bfs_on_a_small_graph():
    # 0 -a-> 1 -a-> 2 -a-> 3 and a shortcut 0 -b-> 2: shortest 0 -> 3 is [b, a]
    edges = {0: [("a", 1), ("b", 2)], 1: [("a", 2)], 2: [("a", 3)], 3: []}
    assert bfs(0, edges.__getitem__, lambda s: s == 3) == ["b", "a"]
    assert bfs(3, edges.__getitem__, lambda s: s == 3) == []
    assert bfs(3, edges.__getitem__, lambda s: s == 0) is None


@pytest.mark.parametrize("name", ["frozenlake", "sokoban"])
def test_sft_pairs_follow_optimal_paths(name):
    pairs = sft_pairs(name, n=5, seed=100)
    env = make_env(name, **({"slippery": False} if name == "frozenlake" else {}))
    expected = []
    for seed in range(100, 105):
        obs = env.reset(seed)
        path = shortest_actions(env)
        moves = iter(path)
        prompts = []

        def policy(history):
            prompts.append(history)
            return f"<answer>{next(moves)}</answer>"

        traj = run_episode(env, policy, seed=seed, max_turns=len(path))
        assert traj.success and prompts[0] == obs + "\n<think>"
        expected += [{"prompt": p, "completion": f"<answer>{a}</answer>"} for p, a in zip(prompts, path)]
    assert pairs == expected
    assert all(extract_answer(p["completion"]) in env.action_words for p in pairs)


def test_arithmetic_sft_pairs_are_the_exact_values():
    """Arithmetic's script is one answer, the exact value; the pair's prompt is the problem with the prefill."""
    pairs = sft_pairs("arithmetic", n=20, seed=7, max_operand=4, max_factor=3)
    assert len(pairs) == 20
    for pair in pairs:
        a, op, b = pair["prompt"].removesuffix(" =\n<think>").split(" ")
        value = {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
        assert 0 <= value <= 9 and pair["completion"] == f"<answer>{value}</answer>"


def test_sft_pairs_errors():
    for name in ("two_armed_bandit", "prisoners_dilemma"):
        with pytest.raises(ConfigError, match="has no solver.*frozenlake.*sokoban"):
            sft_pairs(name, n=2, seed=0)
    with pytest.raises(ConfigError, match="unknown environment"):
        sft_pairs("chess", n=2, seed=0)
    with pytest.raises(ConfigError, match="n must be an int"):
        sft_pairs("frozenlake", n=0, seed=0)



def test_sft_on_slippery_ice_uses_non_slippery_paths():
    """RAGEN ran SFT on slippery ice: the records are the non-slippery paths on the same maps."""
    assert sft_pairs("frozenlake", n=20, seed=0) == sft_pairs("frozenlake", n=20, seed=0, slippery=False)
    strict = sft_pairs("frozenlake", n=2, seed=0, strict=True)
    assert not strict[0]["prompt"].endswith("<think>") and strict[0]["completion"].startswith("<answer>")
