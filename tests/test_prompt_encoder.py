"""Prompts from dataset conversations: the whole conversation goes through the chat template."""
from __future__ import annotations

import pytest

from streamrl.rollout.prompts import PromptEncoder
from streamrl.tasks.registry import Problem


class ChatTok:
    """A tokenizer with a chat template that renders roles visibly (byte-level ids)."""

    chat_template = "roles"

    def encode(self, text, add_special_tokens=False):
        return list(text.encode())

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages) + ("<assistant>" if add_generation_prompt else "")
        return {"input_ids": list(text.encode())}


def text(ids):
    return bytes(ids).decode()


@pytest.fixture
def convo():
    msgs = ({"role": "system", "content": "Answer with a number."}, {"role": "user", "content": "2+2?"})
    return Problem(prompt="2+2?", answer="4", messages=msgs)


def test_conversation_rendered_whole_with_template(convo):
    assert text(PromptEncoder(ChatTok(), True).problem(convo)) == "<system>Answer with a number.<user>2+2?<assistant>"


def test_plain_problem_is_one_user_turn():
    assert text(PromptEncoder(ChatTok(), True).problem(Problem("3+4?", "7"))) == "<user>3+4?<assistant>"


def test_without_template_only_the_last_user_text(convo):
    assert text(PromptEncoder(ChatTok(), False).problem(convo)) == "2+2?"


def test_a_template_asked_of_a_tokenizer_without_one_is_plain_text_and_said(convo, caplog):
    class BaseTok(ChatTok):  # a base model's tokenizer: no chat template
        chat_template = None
        name_or_path = "models/base"

    with caplog.at_level("WARNING", logger="streamrl.rollout.prompts"):
        assert text(PromptEncoder(BaseTok(), True).problem(convo)) == "2+2?"
    assert "rollout.chat_template = true, but the tokenizer of models/base has no chat template" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="streamrl.rollout.prompts"):
        PromptEncoder(BaseTok(), True)  # an evaluation's next encoder: said once a process
        PromptEncoder(BaseTok(), False)
    assert caplog.text == ""
