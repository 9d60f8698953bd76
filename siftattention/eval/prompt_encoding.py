"""How a task's sample becomes the model's prompt: chat template (with the reply's opening words) or plain text.

One place for it, so that a task measuring its prompts in tokens (RULER fits each haystack to
a length) counts exactly the ids the evaluation loop decodes from.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # no import at run time: the tasks package imports this module
    from .tasks.base import Sample


def prompt_text(tokenizer: Any, sample: Sample, chat: bool) -> tuple[str, bool]:
    """(the prompt as text, whether the tokenizer adds its special tokens to it).

    With ``chat`` the text is the chat template with a generation prompt, then the sample's
    ``reply_prefix`` (the words the answer starts with, as RULER puts them in the assistant's
    turn); the template already holds the special tokens. Without it, ``plain`` as it is.
    """
    if chat:
        text = tokenizer.apply_chat_template(list(sample.messages), add_generation_prompt=True, tokenize=False)
        return text + sample.reply_prefix, False
    return sample.plain, True


def encode_prompt(tokenizer: Any, sample: Sample, chat: bool) -> list[int]:
    """Token ids of one prompt, as ``prompt_text`` describes it."""
    text, special = prompt_text(tokenizer, sample, chat)
    return list(tokenizer(text, add_special_tokens=special)["input_ids"])
