"""Problem -> prompt token ids, the one encoding the rollout workers and the evaluator share."""
from __future__ import annotations

import logging

from streamrl.tasks.registry import Problem

log = logging.getLogger(__name__)
_warned_no_template: set[str] = set()  # once per model a process encodes for (evaluations make new encoders)


def uses_chat_template(tok, wanted: bool) -> bool:
    """Whether prompts go through ``tok``'s chat template: asked for (``rollout.chat_template``) and there."""
    return bool(wanted) and getattr(tok, "chat_template", None) is not None


class PromptEncoder:
    """Prompts as token ids, through the tokenizer's chat template for instruct models.

    A problem that came as a conversation (``Problem.messages``: a dataset row's system / few-shot
    / user turns) is rendered whole by the chat template; without a template only its last user
    message (``Problem.prompt``) is used, as plain text. Asked for a template the tokenizer lacks
    (a base model's), it encodes plain text too, and says so: the prompts then differ from what an
    instruct model of the family would be shown.
    """

    def __init__(self, tok, chat_template: bool):
        self.tok = tok
        self.chat = uses_chat_template(tok, chat_template)
        name = getattr(tok, "name_or_path", None) or "model.path"
        if chat_template and not self.chat and name not in _warned_no_template:
            _warned_no_template.add(name)
            log.warning("rollout.chat_template = true, but the tokenizer of %s has no chat template: prompts "
                        "are encoded as plain text (set rollout.chat_template = false to silence this)", name)

    def __call__(self, text: str, raw: bool = False) -> list[int]:
        """One user message (``raw``: the text's own tokens, no template)."""
        if self.chat and not raw:
            return self._template([{"role": "user", "content": text}])
        return self.tok.encode(text, add_special_tokens=False)

    def problem(self, p: Problem) -> list[int]:
        """A problem's prompt: its whole conversation when it has one and the template is on."""
        if self.chat and p.messages:
            return self._template([dict(m) for m in p.messages])
        return self(p.prompt)

    def _template(self, messages: list[dict]) -> list[int]:
        ids = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
