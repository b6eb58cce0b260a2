"""How a turn that is not the model's (an environment's observation, a tool's result)
becomes text and token ids: once, when it is said, with the model's own tokenizer.

The text of such a turn is its content framed the way the prompt frames turns, so
that the model reads it as the next message:

- a chat prompt on a Hugging Face tokenizer with a chat template: what the template
  adds for one more message of that role after an assistant turn, with the
  generation prompt after it (the template rendered with and without the message,
  the difference taken);
- a chat prompt otherwise: ``"\\n{role}: {content}\\nassistant:"``, the layout of the
  byte tokenizer's chat prompts;
- a plain prompt: ``"\\n{role}: {content}\\n"``;
- or the agent option ``turn_template``, a format string with ``{role}`` and
  ``{content}``.

The ids are that text's, without special tokens added (a BOS in the middle of a
trajectory would be a token the model never sees there at inference); bytes for the
byte tokenizer. They are appended to the trajectory as they are: the model's turns
before them are never decoded and encoded again.
"""

from __future__ import annotations

from typing import Any

from rollstream.producer.tokenizer import BytesTokenizer, HFTokenizer, Tokenizer
from rollstream.shared.errors import SettingsError
from rollstream.shared.records import PromptText

CHAT_LAYOUT = "\n{role}: {content}\nassistant:"
TEXT_LAYOUT = "\n{role}: {content}\n"
# the conversation the chat template renders a message after: its difference is the message
_BEFORE = [{"role": "user", "content": "?"}, {"role": "assistant", "content": "!"}]


def check_template(template: str) -> str:
    """A turn template that formats, or a SettingsError naming the option."""
    try:
        template.format(role="user", content="x")
    except (KeyError, IndexError, ValueError) as exc:
        raise SettingsError(
            "invalid setting producer.agent_options (ROLLSTREAM_PRODUCER__AGENT_OPTIONS): turn_template "
            f"{template!r} is not a format string of {{role}} and {{content}}: {exc!r}"
        ) from None
    return template


class TurnText:
    """Text and ids of the turns of one prompt's trajectories."""

    def __init__(self, tokenizer: Tokenizer, prompt: PromptText, template: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.template = template
        self._hf: Any = tokenizer.tokenizer if isinstance(tokenizer, HFTokenizer) else None
        self._chat = isinstance(prompt, list) and bool(getattr(self._hf, "chat_template", None))
        self._before: str | None = None  # the template's rendering of the turns before one
        if template is None and not self._chat:
            self.template = CHAT_LAYOUT if isinstance(prompt, list) else TEXT_LAYOUT

    def render(self, role: str, content: str) -> str:
        return self.render_many([(role, content)])

    def render_many(self, messages: list[tuple[str, str]]) -> str:
        """The text of several messages in a row that answer the model (the proxy's calls
        may add a tool result and a user message at once), ending in the generation prompt."""
        if self.template is not None:
            parts = [self.template.format(role=role, content=content) for role, content in messages]
            if self.template == CHAT_LAYOUT:  # the generation prompt once, after the last
                parts[:-1] = [part.removesuffix("\nassistant:") for part in parts[:-1]]
            return "".join(parts)
        roles = ", ".join(repr(role) for role, _ in messages)
        try:
            if self._before is None:
                self._before = str(self._hf.apply_chat_template(_BEFORE, tokenize=False))
            after = str(
                self._hf.apply_chat_template(
                    [*_BEFORE, *({"role": role, "content": content} for role, content in messages)],
                    tokenize=False,
                    add_generation_prompt=True,
                )
            )
        except Exception as exc:  # a template that knows no such role, or wants other turns
            raise ValueError(
                f"the chat template cannot render a {roles} message after an assistant turn ({exc}): "
                "set the agent option turn_template, or the role (observation_role, tool_role)"
            ) from exc
        if not after.startswith(self._before):  # a template that rewrites earlier messages
            raise ValueError(
                f"the chat template does not render a {roles} message as an addition to the messages "
                "before it: set the agent option turn_template"
            )
        return after[len(self._before) :]

    def encode(self, role: str, content: str) -> tuple[list[int], str]:
        """The turn's ids and its text, tokenised once."""
        text = self.render(role, content)
        if isinstance(self.tokenizer, BytesTokenizer):
            return list(text.encode("utf-8")), text
        if self._hf is not None:
            return list(self._hf.encode(text, add_special_tokens=False)), text
        encode_text = getattr(self.tokenizer, "encode_text", None)  # a tokenizer of another kind
        return (list(encode_text(text)) if encode_text else self.tokenizer.encode(text)), text
