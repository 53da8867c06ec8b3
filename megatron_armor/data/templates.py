"""Prompt templates: how a problem (or a row's chat messages) becomes the text the model sees.

Two things vary between templates: whether the problem is wrapped in DAPO's "Answer:"
instruction, and whether the tokenizer's chat template renders the messages.

==========  ==================================  =====================================
template    benchmark rows (problem + answer)   DAPO-Math rows (chat messages)
==========  ==================================  =====================================
``dapo``    DAPO instruction around the         messages used as they are (DAPO-Math
            problem, raw text                   already carries the instruction), raw text
``chat``    DAPO instruction around the         messages used as they are, rendered by
            problem, rendered by the            the tokenizer's chat template
            tokenizer's chat template
``plain``   the problem alone, raw text         the problem alone: the DAPO instruction
                                                is removed when the user message has it
==========  ==================================  =====================================

"Raw text" joins the message contents with a blank line. ``chat`` ends with the
template's generation prompt (``add_generation_prompt=True``).
"""

from __future__ import annotations

from typing import Any

TEMPLATES = ("dapo", "chat", "plain")

DAPO_PREFIX = (
    "Solve the following math problem step by step. The last line of your response should be "
    "of the form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
)
DAPO_SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'

Messages = list[dict[str, str]]


def format_dapo_prompt(problem: str) -> str:
    """The DAPO-Math-17K user message for ``problem`` (the recipe's exact wording)."""
    return f"{DAPO_PREFIX}{problem}{DAPO_SUFFIX}"


def strip_dapo_instruction(text: str) -> str:
    """Inverse of :func:`format_dapo_prompt`; text without the exact wrapper is returned as is."""
    if text.startswith(DAPO_PREFIX) and text.endswith(DAPO_SUFFIX):
        return text[len(DAPO_PREFIX) : len(text) - len(DAPO_SUFFIX)]
    return text


def check_template(template: str) -> None:
    """Raise a clear error for an unknown template name."""
    if template not in TEMPLATES:
        raise ValueError(
            f"data.template={template!r} is not a prompt template; use one of {list(TEMPLATES)}"
        )


def has_chat_template(tokenizer: Any) -> bool:
    """Whether ``tokenizer`` carries a chat template (``tokenizer.chat_template`` set)."""
    return bool(getattr(tokenizer, "chat_template", None))


def require_chat_template(tokenizer: Any) -> None:
    """Raise for ``template: chat`` with a tokenizer that has no chat template."""
    if not has_chat_template(tokenizer):
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise ValueError(
            f"data.template='chat' but the tokenizer {name!r} has no chat template; "
            "use data.template=dapo (DAPO instruction, raw text) or plain, or use a model "
            "directory whose tokenizer_config.json defines chat_template"
        )


def problem_messages(problem: str, template: str) -> Messages:
    """Chat messages for a benchmark-schema problem under ``template``."""
    content = problem if template == "plain" else format_dapo_prompt(problem)
    return [{"role": "user", "content": content}]


def dataset_messages(messages: Messages, template: str) -> Messages:
    """Chat messages for a DAPO-Math row: as is, or with the instruction removed (``plain``)."""
    if template != "plain":
        return messages
    return [
        {**m, "content": strip_dapo_instruction(m["content"])} if m["role"] == "user" else m
        for m in messages
    ]


def render_messages(messages: Messages, template: str, tokenizer: Any) -> str:
    """The prompt text: the chat template's rendering (``chat``) or the joined contents."""
    if template == "chat":
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return "\n\n".join(m["content"] for m in messages)
