import pytest

from environments.base import make_env

EXPECTED = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def problem(obs):
    a, op, b, eq = obs.split()
    assert eq == "="
    return int(a), op, int(b)


def test_problems_in_range_deterministic_and_verified():
    env, twin = make_env("arithmetic"), make_env("arithmetic")
    ops = set()
    for seed in range(300):
        obs = env.reset(seed)
        assert obs == twin.reset(seed)
        a, op, b = problem(obs)
        ops.add(op)
        high = 10 if op == "*" else 20
        assert 0 <= a <= high and 0 <= b <= high
        value = EXPECTED[op](a, b)
        assert value >= 0
        r = env.step(f"<think>compute</think><answer>{value}</answer>")
        assert (r.reward, r.done, r.info["success"]) == (1.0, True, True)
        wrong = twin.step(f"<answer>{value + 1}</answer>")
        assert (wrong.reward, wrong.done, wrong.info["success"]) == (0.0, True, False)
    assert ops == {"+", "-", "*"}


@pytest.mark.parametrize(
    "answer,valid",
    [(" 17 ", True), ("017", True), ("-3", True), ("17.0", False), ("seventeen", False), ("1 7", False),
     ("", False)],
)
def test_answer_forms(answer, valid):
    env = make_env("arithmetic")
    env.reset(0)
    r = env.step(f"<answer>{answer}</answer>")
    assert r.done and r.info["valid"] == valid
    if not valid:
        assert r.reward == -1.0


def test_leading_zero_is_the_same_integer():
    env = make_env("arithmetic")
    a, op, b = problem(env.reset(5))
    assert env.step(f"<answer>00{EXPECTED[op](a, b)}</answer>").reward == 1.0


def test_operand_ranges_are_parameters():
    env = make_env("arithmetic", max_operand=3, max_factor=2)
    for seed in range(100):
        a, op, b = problem(env.reset(seed))
        assert max(a, b) <= (2 if op == "*" else 3)
