"""The search environment through TRL's tool convention (environments/search_tools.py), the byte-level tokenizer that
lets a tiny model speak TRL's Qwen2.5 template, and ExtGRPOTrainer training on ``environment_factory`` end to end
with scripted tool calls (a random tiny model writes none)."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
import torch

from environments.base import HELDOUT_LEVELS
from environments.search_corpus import build_corpus
from environments.search_tools import EPISODE_OVER, INSTRUCTIONS, SearchTools, tool_dataset
from trl_ext.registry import ConfigError

PAGES = 40


def _episode(level: int = 3):
    env = SearchTools.factory(max_turns=4, n_pages=PAGES)()
    return env, env.reset(level=level, prompt="ignored row column")


def test_tools_play_the_search_episode():
    env, shown = _episode()
    q = env._env.question
    assert shown == f"\nquestion: {q.text}"
    results = env.search(q.subject)
    assert results.splitlines()[0] == "results:" and results.splitlines()[1].startswith(f"{q.title}: ")
    page = env.read(q.title)
    assert page.startswith(f"page: {q.title}\n") and q.fact in page
    assert env.answer(q.answer) == "the answer is correct." and env.get_reward() == 1.0 and env.success
    assert env.search(q.subject) == EPISODE_OVER and env.get_reward() == 1.0  # after the end: nothing changes


def test_invalid_calls_cost_the_penalty_and_the_episode_goes_on():
    env, _ = _episode()
    q = env._env.question
    assert env.read("no such page").startswith("invalid read: question: ")
    assert env.search("   ").startswith("invalid search: ")
    assert env.get_reward() == -2.0 and not env.success
    assert env.answer("not " + q.answer) == "the answer is wrong." and env.get_reward() == -2.0
    assert env.answer(q.answer) == EPISODE_OVER and env.get_reward() == -2.0


def test_max_turns_ends_the_episode_and_reset_starts_over():
    env, _ = _episode()
    q = env._env.question
    for _ in range(4):
        assert env.search(q.subject).startswith("results:")
    assert env.answer(q.answer) == EPISODE_OVER and env.get_reward() == 0.0
    env.reset(level=3)
    assert env.answer(q.answer) == "the answer is correct." and env.get_reward() == 1.0


def test_factory_checks_parameters_once_and_levels_are_the_text_environments():
    with pytest.raises(ConfigError, match="k must be"):
        SearchTools.factory(k=0, n_pages=PAGES)
    with pytest.raises(ConfigError, match="max_turns"):
        SearchTools.factory(max_turns=0, n_pages=PAGES)
    from environments.base import make_env

    text_env = make_env("search", n_pages=PAGES)
    tools, _ = _episode(level=HELDOUT_LEVELS + 5)
    assert tools._env.question == (text_env.reset(HELDOUT_LEVELS + 5), text_env.question)[1]
    rows = tool_dataset(3, heldout=True)
    assert rows["level"] == [HELDOUT_LEVELS, HELDOUT_LEVELS + 1, HELDOUT_LEVELS + 2]
    assert rows["prompt"][0] == [{"role": "user", "content": INSTRUCTIONS}]


def test_tool_schemas_are_what_trl_renders():
    from transformers.utils import get_json_schema

    schemas = {name: get_json_schema(getattr(SearchTools, name)) for name in ("search", "read", "answer")}
    assert schemas["read"]["function"]["parameters"]["required"] == ["title"]
    assert schemas["search"]["function"]["parameters"]["properties"]["query"] == {"type": "string",
                                                                      "description": "The words to search for."}


def test_byte_tokenizer_round_trips_and_renders_trls_tool_template():
    from trl.chat_template_utils import supports_tool_calling

    from trl_ext.models.byte_tokenizer import EOS, byte_tokenizer
    from trl_ext.models.tiny import CHAT_TEMPLATES, trl_template

    tok = byte_tokenizer()
    text = 'Ünïcode, tabs\t and "json": {"a": [1, 2]}\n<tool_call>\n{"name": "read"}\n</tool_call>' + EOS
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text and tok.unk_token_id is None and tok.eos_token == EOS
    assert tok.convert_ids_to_tokens(ids[-1]) == EOS and "<tool_call>" in tok.convert_ids_to_tokens(ids)
    assert byte_tokenizer().get_vocab() == tok.get_vocab()  # deterministic
    tok.chat_template = trl_template("qwen2_5")
    assert supports_tool_calling(tok)
    for name in CHAT_TEMPLATES:  # the builtin templates render no tool call: TRL refuses them
        tok.chat_template = CHAT_TEMPLATES[name]
        assert not supports_tool_calling(tok)
    with pytest.raises(ValueError, match="TRL ships no such template"):
        trl_template("no_such_template")


def test_tiny_positions_set_the_context_length():
    from trl_ext.models.tiny import SIZE, tiny_config

    assert tiny_config("qwen2", 10, 0, positions=4096).max_position_embeddings == 4096
    assert tiny_config("gpt2", 10, 0).n_positions == SIZE["positions"]
    with pytest.raises(ValueError, match="positions must be an int >= 1"):
        tiny_config("qwen2", 10, 0, positions=0)


# ------------------------------------------------------------------------------------------------ end to end
def _example():
    path = Path(__file__).resolve().parents[1] / "examples" / "search_tools.py"
    spec = importlib.util.spec_from_file_location("search_tools_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tools_model(tmp_path_factory):
    from trl_ext.models.tiny import build_tiny, trl_template

    return str(build_tiny("qwen2", tmp_path_factory.mktemp("tiny_tools"), tokenizer="bytes",
                          chat_template=trl_template("qwen2_5"), positions=4096))  # fmt: skip


def _scripted(base):
    """``base`` with the model's turns scripted. Every rollout searches the question's entity; then, of the two
    rollouts of a question, the first reads the page and answers right (3 calls, reward 1), the second answers wrong
    without reading (2 calls, reward 0); then a plain closing turn. Records every training batch."""
    questions = {q.text: q for q in build_corpus(PAGES, 0).questions}

    class Scripted(base):
        batches: list = []
        second_turns: dict = {}

        def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
            turns = []
            for ids in prompt_ids:
                text = self.processing_class.decode(ids)
                q = questions[re.findall(r"question: (.*?\?)", text)[-1]]
                n = text.count("<tool_response>")
                call = None
                if n == 0:
                    call = ("search", "query", q.subject)
                elif n == 1:
                    right = self.second_turns.get(q.text, 0) % 2 == 0
                    self.second_turns[q.text] = self.second_turns.get(q.text, 0) + 1
                    call = ("read", "title", q.title) if right else ("answer", "text", "nobody")
                elif n == 2 and "page:" in text.split("<tool_response>")[-1]:
                    call = ("answer", "text", q.answer)
                turn = "done." if call is None else (
                    f'<tool_call>\n{json.dumps({"name": call[0], "arguments": {call[1]: call[2]}})}\n</tool_call>')
                turns.append(self.processing_class(turn + "<|im_end|>", add_special_tokens=False)["input_ids"])
            return turns, None

        def _generate_and_score_completions(self, inputs):
            batch = super()._generate_and_score_completions(inputs)
            self.batches.append({k: v for k, v in batch.items() if isinstance(v, torch.Tensor)})
            return batch

    return Scripted


@pytest.mark.slow
@pytest.mark.parametrize("feature", ["plain", "lora", "routing"])
def test_trainer_runs_the_tool_loop(tools_model, tmp_path, feature):
    from trl_ext import ExtGRPOTrainer

    ex = _example()
    trainer = ex.build_trainer(tools_model, feature, max_steps=2, output_dir=str(tmp_path), n_pages=PAGES,
                               trainer_class=_scripted(ExtGRPOTrainer), bf16=False, use_cpu=True)  # fmt: skip
    assert not trainer.tools and trainer.environment_factories is None  # the project's loop plays it, not TRL's
    tools = trainer.episode_source.episodes([{"prompt": [{"role": "user", "content": "q"}], "level": 0}],
                                            trainer.processing_class)[0].tools
    assert sorted(tool.__name__ for tool in tools) == ["answer", "read", "search"]  # not reset, get_reward
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2
    # 4 questions x 2 rollouts a step; in each group one right (reward 1, 3 calls), one wrong (reward 0, 2 calls)
    assert all(h["rewards/SearchTools/mean"] == 0.5 and h["env/tool_calls"] == 2.5 for h in logs)
    assert all(h["env/invalid_frac"] == 0 and h["env/success"] == 0.5 for h in logs)
    tok = trainer.processing_class
    for batch in trainer.batches:
        real, agent = batch["completion_mask"].bool(), batch["tool_mask"].bool()
        assert (real & ~agent).any()
        for ids, c, a in zip(batch["completion_ids"], real, agent, strict=True):
            trained, shown = tok.decode(ids[c & a]), tok.decode(ids[c & ~a])
            assert "results:" not in trained and "page:" not in trained and "the answer is" not in trained
            assert "results:" in shown and "the answer is" in shown and '"name": "search"' in trained
        if feature == "routing":  # the detector flags the rollouts that answered without reading
            reads = torch.tensor(['"name": "read"' in tok.decode(ids) for ids in batch["completion_ids"]])
            assert torch.equal(batch["is_rh"].cpu(), ~reads)
    moved = max((p.detach() - before[n]).abs().max().item() for n, p in trainer.model.named_parameters()
                if p.requires_grad)  # fmt: skip
    assert moved > 0


def test_trls_own_tool_loop_refuses_distillation_and_the_factory_excludes_args_env(tools_model, tmp_path):
    """Standalone ``tools=`` (no environment) run TRL's own tool loop, which distillation does not score; an
    ``environment_factory`` plays in the project's loop (every extension: tests/test_tool_trainer.py) and names the
    environment, so ``args.env`` beside it is refused."""
    from trl_ext import ExtGRPOTrainer
    from trl_ext.api import trainer_arguments
    from trl_ext.config import train_config

    def lookup(word: str) -> str:
        """Look a word up.

        Args:
            word: The word.
        """
        return word

    distill = train_config(output_dir=str(tmp_path), teacher_tau=0.5, student_tau=0.5, beta=0.02,
                           teacher_context="Read before you answer.", report_to=[])  # fmt: skip
    with pytest.raises(ValueError, match="TRL's own tool loop"):
        trainer_arguments((), {"model": tools_model, "args": distill, "tools": [lookup]})
    trainer_arguments((), {"model": tools_model, "args": distill,
                           "environment_factory": SearchTools.factory(n_pages=PAGES)})  # no refusal  # fmt: skip
    env = train_config(output_dir=str(tmp_path), env="search", report_to=[], use_cpu=True, bf16=False)
    with pytest.raises(ValueError, match="do not pass environment_factory too"):
        ExtGRPOTrainer(model=tools_model, args=env, train_dataset=tool_dataset(4),
                       environment_factory=SearchTools.factory(n_pages=PAGES))  # fmt: skip
