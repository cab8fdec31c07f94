"""Turn environment messages into the tokens appended after a model turn.

The driver keeps the conversation as tokens: the prompt, then the model's *sampled* tokens
verbatim, then the environment's reply rendered here, and so on. Only the environment's part is
ever tokenised, so a model turn is never re-tokenised (its behaviour log-probs stay attached to
exactly the tokens that are trained).
"""
from __future__ import annotations

from typing import Protocol

from streamrl.envs.base import Message


class Renderer(Protocol):
    def prompt_tokens(self, messages: list[Message]) -> list[int]:
        """Tokens of the opening messages, ending where the model's first turn starts."""

    def env_tokens(self, messages: list[Message], model_ended: bool) -> list[int]:
        """Tokens of the environment's reply, ending where the model's next turn starts.
        ``model_ended``: the model turn before it ended with the end-of-turn token."""


class ChatTemplateRenderer:
    """Render with the tokenizer's chat template (SmolLM2, Qwen, ... instruct models).

    The reply's tokens are the template's output for ``[user, assistant] + messages`` (with the
    generation prompt) minus its output for ``[user, assistant]`` alone, so they are exactly what
    the template would put there, including its role headers. What the template writes after the
    assistant's end-of-turn token (``<|im_end|>`` then ``"\\n"``) belongs to the reply, because
    the model stops at the end-of-turn token.
    """

    _PROBE = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]

    def __init__(self, tokenizer):
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("tokenizer has no chat_template: use PlainTextRenderer")
        self.tok = tokenizer
        self.eos_id = tokenizer.eos_token_id
        base = self._ids(self._PROBE, generation_prompt=False)
        if self.eos_id not in base:
            raise ValueError(f"chat template never writes the end-of-turn token id {self.eos_id}")
        cut = len(base) - base[::-1].index(self.eos_id)  # just after the assistant's last end-of-turn
        self._base, self._after_eos = base[:cut], base[cut:]

    def _ids(self, messages: list[Message], generation_prompt: bool) -> list[int]:
        return list(self.tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=generation_prompt,
                                                 return_dict=False))

    def prompt_tokens(self, messages: list[Message]) -> list[int]:
        return self._ids(messages, generation_prompt=True)

    def env_tokens(self, messages: list[Message], model_ended: bool) -> list[int]:
        full = self._ids(self._PROBE + list(messages), generation_prompt=True)
        if full[: len(self._base)] != self._base:
            raise ValueError("chat template rewrites earlier turns; cannot append a reply token-wise")
        head = [] if model_ended else [self.eos_id]  # close a turn cut by the token limit
        return head + full[len(self._base):]


class PlainTextRenderer:
    """Render messages as ``template.format(role=..., content=...)`` text, for tokenizers without
    a chat template (the character tokenizer of the tiny model)."""

    def __init__(self, tokenizer, template: str = "{content}", prompt_template: str = "{content}"):
        self.tok, self.template, self.prompt_template = tokenizer, template, prompt_template

    def prompt_tokens(self, messages: list[Message]) -> list[int]:
        text = "".join(self.prompt_template.format(**m) for m in messages)
        return self.tok.encode(text, add_special_tokens=False)

    def env_tokens(self, messages: list[Message], model_ended: bool) -> list[int]:
        text = "".join(self.template.format(**m) for m in messages)
        return self.tok.encode(text, add_special_tokens=False)
