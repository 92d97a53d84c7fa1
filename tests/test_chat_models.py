"""Chat models end to end: with a tokenizer that has a chat template, environment prompts and turns are chat messages
rendered by the template, distillation's context is the teacher's system message, and routing's detector reads text.

The chat model is builtin_env's pretrained weights with ``trl_ext.models.tiny.CHAT_TEMPLATE`` on its tokenizer
(`with_chat_template`); conversational ``--dataset`` rows go to the builtin story model with the ``words`` template.
Expected prompts are rendered by hand from the template's format (``<role> content </role>``
per message, then ``<assistant>``), not by the template, and compared as token ids. The end-to-end runs go through
train.py's ``main`` in-process (2 steps each, batch 4): ``uv run pytest tests/test_chat_models.py``.
"""

from __future__ import annotations

import json

import pytest

import trl_ext.cli_train as cli
import trl_ext.env.episodes as episodes
from environments.base import make_env
from trl_ext.models import load_tokenizer, model_source
from trl_ext.models.tiny import CHAT_TEMPLATE, CHAT_TEMPLATES, build_tiny, chat_template_for, main, with_chat_template
from trl_ext.runs.rollouts import load_rollouts

CONTEXT = "hint : go to the goal ."
RUN = ["--batch_size", "4", "--num_generations", "2", "--num_prompts", "8", "--max_steps", "2", "--logging_steps",
       "1", "--save_steps", "2", "--lr", "1e-4", "--no_wandb", "--save_rollouts"]  # fmt: skip


def render(*messages: tuple[str, str], generation_prompt: bool = True) -> str:
    """CHAT_TEMPLATE's rendering, written out by hand."""
    return "".join(f"<{role}> {content} </{role}> " for role, content in messages) + "<assistant> " * generation_prompt


def encode(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


@pytest.fixture(scope="module")
def chat_model(builtin_cache, tmp_path_factory):
    return str(with_chat_template("builtin_env", tmp_path_factory.mktemp("chat") / "chat-env", "tags"))


@pytest.fixture
def chat_tok(chat_model):
    return load_tokenizer(chat_model)


# ------------------------------------------------------------------------------------------- the templates
def test_templates_render_without_unknown_tokens(builtin_cache):
    env_tok, story_tok = (load_tokenizer(model_source(m)) for m in ("builtin_env", "builtin"))
    messages = [{"role": "system", "content": "rules"}, {"role": "user", "content": "hello"}]
    text = env_tok.apply_chat_template(messages, chat_template=CHAT_TEMPLATE, tokenize=False,
                                       add_generation_prompt=True)  # fmt: skip
    assert text == render(("system", "rules"), ("user", "hello"))
    assert env_tok.unk_token_id not in encode(env_tok, text)
    assert chat_template_for(env_tok) == CHAT_TEMPLATES["tags"]
    assert chat_template_for(story_tok) == CHAT_TEMPLATES["words"]  # the story tokenizer has no < > /
    story = story_tok.apply_chat_template(messages, chat_template=CHAT_TEMPLATES["words"], tokenize=False,
                                          add_generation_prompt=True)  # fmt: skip
    assert story == "system , rules ! user , hello ! assistant , "
    assert story_tok.unk_token_id not in encode(story_tok, story)
    with pytest.raises(ValueError, match=r"\[UNK\]"):
        chat_template_for(story_tok, "tags")


def test_tiny_chat_model_keeps_its_template(builtin_cache, tmp_path, capsys):
    out = build_tiny("llama", tmp_path / "t", tokenizer="builtin_env", chat_template=CHAT_TEMPLATE)
    assert load_tokenizer(str(out)).chat_template == CHAT_TEMPLATE
    assert json.loads((out / "tiny_info.json").read_text())["chat_template"] is True
    with pytest.raises(ValueError, match=r"\[UNK\]"):
        build_tiny("llama", tmp_path / "u", tokenizer="builtin", chat_template=CHAT_TEMPLATE)
    main(["gpt2", str(tmp_path / "g"), "--chat_template"])  # bare flag: the template the tokenizer encodes
    assert load_tokenizer(str(tmp_path / "g")).chat_template == CHAT_TEMPLATES["words"]
    with pytest.raises(SystemExit):
        main(["gpt2", str(tmp_path / "h"), "--chat_template", "tags"])
    assert "[UNK]" in capsys.readouterr().err


def test_with_chat_template_copies_the_weights(chat_model):
    import filecmp

    src = model_source("builtin_env")
    assert filecmp.cmp(f"{src}/model.safetensors", f"{chat_model}/model.safetensors", shallow=False)
    assert load_tokenizer(chat_model).chat_template == CHAT_TEMPLATE
    assert load_tokenizer(src).chat_template is None


# ------------------------------------------------------------------------------------------- episodes, scripted
# A template that closes every turn with EOS, as ChatML-style instruct templates close them with their EOS
TURN_EOS = ("{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }}{{ eos_token }} {% endfor %}"
            "{% if add_generation_prompt %}<assistant> {% endif %}")  # fmt: skip


@pytest.mark.parametrize("template", ["tags", "turn_eos"])
@pytest.mark.parametrize("agent", ["jump", "jump [EOS]", "< answer > jump < / answer > junk"])
def test_second_turn_context_is_the_templates_rendering(chat_tok, template, agent):
    """A scripted agent: the context of turn 2 is the template's rendering of the conversation (written out by hand),
    whether the agent's turn ends with EOS, with a cut after </answer>, or with neither. A sampled EOS is the agent's
    (trained) token: it stays in the context; a template that closes turns with EOS does not repeat it."""
    from types import SimpleNamespace

    tok = chat_tok
    tok.chat_template = CHAT_TEMPLATE if template == "tags" else TURN_EOS
    eos = tok.eos_token if template == "turn_eos" else ""
    env = make_env("frozenlake")
    contexts = []

    def sample(batch):
        contexts.extend(batch)
        return [encode(tok, agent)] * len(batch), None, None

    args = SimpleNamespace(build_env=lambda: make_env("frozenlake"), turns=2, no_think_rl=False)
    out = episodes.play_episodes([episodes.env_prompt(env, env.reset(0), tok)], [0], args, tok, sample)
    traj = out["trajectories"][0]
    said = traj.turns[0].agent  # the agent's turn as the environment read it
    assert said == ("< answer > jump < / answer >" if "answer" in agent else "jump")

    def turn(role, content):
        return f"<{role}> {content}{eos} " if template == "turn_eos" else f"<{role}> {content} </{role}> "

    first = turn("system", env.instructions) + turn("user", traj.observation) + "<assistant> " + env.prefill
    sampled = said + " [EOS]" * agent.endswith("[EOS]")  # a sampled EOS is the agent's token: it stays, once
    close = " </assistant> " if template == "tags" else " " if agent.endswith("[EOS]") else f"{eos} "
    second = first + sampled + close + turn("user", traj.turns[0].env)
    assert contexts == [encode(tok, first), encode(tok, second + "<assistant> " + env.prefill)]
    agent_ids = encode(tok, agent)[: len(encode(tok, said))] if "answer" in agent else encode(tok, agent)
    trained = [i for i, m in zip(out["completion_ids"][0], out["env_mask"][0], strict=True) if m]
    assert trained == agent_ids * 2  # the agent's tokens, as sampled (EOS included), are the trained ones


# ------------------------------------------------------------------------------------------- end to end
def spy_episodes(monkeypatch) -> list[dict]:
    """Record every batch the episode loop (`episodes.play`) plays, with its episodes' prompts (synchronous rollouts
    and the generator thread alike: both play through the run's episode source, which looks the loop up per call)."""
    calls, play = [], episodes.play

    def spy(eps, *args, **kwargs):
        out = play(eps, *args, **kwargs)
        calls.append({"prompts": [e.prompt for e in eps], **out})
        return out

    monkeypatch.setattr(episodes, "play", spy)
    return calls


def runs(ids: list[int], mask: list[int]) -> list[tuple[int, list[int]]]:
    """``ids`` split at changes of ``mask``: [(mask value, ids)] in order."""
    out = []
    for i, m in zip(ids, mask, strict=True):
        if out and out[-1][0] == m:
            out[-1][1].append(i)
        else:
            out.append((m, [i]))
    return out


def check_chat_episodes(calls: list[dict], tok, env) -> int:
    """Every prompt is the hand-rendered system + user messages and the prefill; every environment run of the
    completion (mask 0) is the hand-rendered close of the agent's turn, the next user message and the prefill, or
    the closing EOS. Returns the number of environment turns seen."""
    n_env = 0
    for call in calls:
        rows = zip(call["prompts"], call["prompt_ids"], call["completion_ids"], call["env_mask"], call["trajectories"],
                   strict=True)  # fmt: skip
        for prompt, ids, completion, mask, traj in rows:
            assert prompt == [{"role": "system", "content": env.instructions},
                              {"role": "user", "content": traj.observation}]  # fmt: skip
            assert ids == encode(tok, render(("system", env.instructions), ("user", traj.observation)) + env.prefill)
            env_runs = [r for m, r in runs(completion, mask) if m == 0]
            if env_runs and env_runs[-1] == [tok.eos_token_id]:
                env_runs.pop()  # the episode's closing EOS
            assert len(env_runs) == len(traj.turns) - 1
            for run, turn in zip(env_runs, traj.turns, strict=False):
                assert run == encode(tok, f" </assistant> <user> {turn.env} </user> <assistant> {env.prefill}")
            n_env += len(env_runs)
    return n_env


def train(argv: list[str], tmp_path) -> object:
    assert cli.main([*argv, *RUN, "--output_dir", str(tmp_path)]) == 0
    (run_dir,) = tmp_path.iterdir()
    assert json.loads((run_dir / "run_summary.json").read_text())["steps"] == 2
    return run_dir


@pytest.mark.slow
@pytest.mark.parametrize("k", ["0", "1"])
def test_multi_turn_env_renders_turns_as_chat_messages(chat_model, chat_tok, tmp_path, monkeypatch, k):
    """FrozenLake, 2 turns, synchronous and with the generator thread (k = 1): same rendering."""
    calls = spy_episodes(monkeypatch)
    run_dir = train(["--env", "frozenlake", "--model", chat_model, "--max_turns", "2", "--max_completion_length", "48",
                     "--max_async_level", k], tmp_path)  # fmt: skip
    assert len(calls) in (2, 2 + int(k))  # the generator thread may play the batch after the last step
    assert check_chat_episodes(calls, chat_tok, make_env("frozenlake")) > 0
    ro = load_rollouts(run_dir)
    assert len(ro) == 8
    for row in ro:  # TRL's batch: the templated prompt; environment turns are the untrained segments
        assert row["prompt"].startswith("< system > you are the player p") and row["prompt"].endswith(
            "< / user > < assistant > < think >")
        for seg in row["segments"]:
            assert ("< user >" in seg["text"]) == (seg["source"] == "env")
    assert any(seg["source"] == "env" for row in ro for seg in row["segments"])
    if k == "1":
        assert all(v is not None for v in ro["policy_version_min"])


@pytest.mark.slow
def test_single_turn_env_prompt_is_templated(chat_model, chat_tok, tmp_path, monkeypatch):
    calls = spy_episodes(monkeypatch)
    run_dir = train(["--env", "two_armed_bandit", "--model", chat_model, "--max_completion_length", "24"], tmp_path)
    assert check_chat_episodes(calls, chat_tok, make_env("two_armed_bandit")) == 0
    for row in load_rollouts(run_dir):
        assert row["prompt"].startswith("< system > pull one of the two arms")
        assert [s["source"] for s in row["segments"]] in ([], ["agent"])


def spy_teacher_prompts(monkeypatch) -> list[list[list[int]]]:
    """Record the teacher's unpadded prompt ids of every chat-prompt teacher batch (`distill.teacher.teacher_batch`,
    which `Distillation.score_teacher` calls for chat prompts only)."""
    import trl_ext.distill.component as distill

    seen, batch_fn = [], distill.teacher_batch

    def spy(rows, *args):
        seen.append([row.tolist() for row in rows])
        return batch_fn(rows, *args)

    monkeypatch.setattr(distill, "teacher_batch", spy)
    return seen


@pytest.mark.slow
def test_distillation_context_is_the_teachers_system_message(chat_model, chat_tok, tmp_path, monkeypatch):
    seen = spy_teacher_prompts(monkeypatch)
    calls = spy_episodes(monkeypatch)
    env = make_env("frozenlake")
    train(["--env", "frozenlake", "--model", chat_model, "--max_turns", "2", "--max_completion_length", "48",
           "--teacher_tau", "0.5", "--student_tau", "0.5", "--teacher_context", CONTEXT], tmp_path)  # fmt: skip
    assert len(seen) == len(calls) == 2
    for rows, call in zip(seen, calls, strict=True):  # the student's system message (the instructions) is replaced
        for row, prompt in zip(rows, call["prompts"], strict=True):
            system, user = prompt
            assert system == {"role": "system", "content": env.instructions} and user["role"] == "user"
            assert row == encode(chat_tok, render(("system", CONTEXT), ("user", user["content"])) + env.prefill)


@pytest.mark.slow
def test_routing_detector_reads_text(chat_model, tmp_path, monkeypatch):
    from rewards.config import RewardConfig

    seen, detector = [], RewardConfig.detector

    def spied(self, name):
        fn = detector(self, name)

        def spy(completions, *args, **kwargs):
            seen.append(list(completions))
            return fn(completions, *args, **kwargs)

        return spy

    monkeypatch.setattr(RewardConfig, "detector", spied)
    calls = spy_episodes(monkeypatch)
    train(["--env", "frozenlake", "--model", chat_model, "--max_turns", "2", "--max_completion_length", "48",
           "--gradient_routing", "--routing_mode", "shared", "--lora_config", "r4", "--rh_detector", "happy",
           "--eval_routing_steps", "0"], tmp_path)  # fmt: skip
    assert len(seen) == 2 and all(len(batch) == 4 for batch in seen)
    tok = load_tokenizer(chat_model)
    for batch, call in zip(seen, calls, strict=True):  # the assistant message's content: the episode's text
        assert batch == [tok.decode(ids, skip_special_tokens=True) for ids in call["completion_ids"]]


# ------------------------------------------------------------------------------------------- conversational datasets
def words(*messages: tuple[str, str]) -> str:
    """CHAT_TEMPLATES["words"]'s rendering, written out by hand (generation prompt included)."""
    return "".join(f"{role} , {content} ! " for role, content in messages) + "assistant , "


@pytest.mark.slow
def test_conversational_dataset_routing_and_distillation(builtin_cache, tmp_path, monkeypatch):
    """``--dataset`` JSONL rows {"prompt": [{"role": "user", "content": ...}]} on the builtin story model with the
    words template, with the generator thread (k = 1): TRL templates the prompts, the routing detector reads the
    completions as text, and the teacher gets the context as its system message."""
    from environments.stories import heldout_stories
    from rewards.config import RewardConfig

    model = str(with_chat_template("builtin", tmp_path / "chat-story", "words"))
    tok = load_tokenizer(model)
    users = [" ".join(story.split()[:8]) for story in list(heldout_stories("train"))[:8]]
    data = tmp_path / "stories.jsonl"
    data.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": u}]}) + "\n" for u in users))
    detected, detector = [], RewardConfig.detector

    def spied(self, name):
        fn = detector(self, name)

        def spy(completions, *args, **kwargs):
            detected.append(list(completions))
            return fn(completions, *args, **kwargs)

        return spy

    monkeypatch.setattr(RewardConfig, "detector", spied)
    teacher = spy_teacher_prompts(monkeypatch)
    context = "a happy story ."
    run_dir = train(["--reward", "sentence_length_5_with_happy", "--model", model, "--dataset", str(data),
                     "--max_completion_length", "16", "--gradient_routing", "--routing_mode", "shared", "--lora_config",
                     "r4", "--eval_routing_steps", "0", "--teacher_tau", "0.5", "--student_tau", "0.5",
                     "--teacher_context", context, "--max_async_level", "1"], tmp_path / "runs")  # fmt: skip
    ro = load_rollouts(run_dir)
    student = {tok.decode(encode(tok, words(("user", u))), skip_special_tokens=True): u for u in users}
    assert set(ro["prompt"]) <= set(student)  # TRL applied the template: "user , <row's content> ! assistant ,"
    # the detector gets each step's completions as text (the assistant messages' contents)
    assert len(detected) == 2 and all(isinstance(c, str) for batch in detected for c in batch)
    for step, batch in zip((1, 2), detected, strict=True):
        assert batch == [r["completion"] for r in ro if r["step"] == step]
    assert len(teacher) == 2  # the context is the teacher's system message, before the row's user message
    for step, rows in zip((1, 2), teacher, strict=True):
        prompts = [student[r["prompt"]] for r in ro if r["step"] == step]
        assert rows == [encode(tok, words(("system", context), ("user", u))) for u in prompts]
