"""Prompt text: how a data row's prompt becomes the text (and token ids) the policy continues.

    prompt ──► apply_chat_template off: the text as written (chat messages need the template: an error)
           ──► apply_chat_template on:  tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                        **template_kwargs), where a text prompt becomes one user turn

`template_kwargs` (--apply-chat-template-kwargs JSON, slime's flag) are the template's own variables, such as
Qwen3's enable_thinking: a JSON object, checked when the flag is parsed (chat_template_kwargs_flag), whose every key
the tokenizer's template must mention (require_chat_template): a template ignores an unknown variable silently, so a
misspelt key would change nothing and say nothing.

The tokenizer's own template renders the chat (the one SGLang and vLLM use), and its output carries its own special
tokens, so none are added when it is encoded. The built-in sets ask for the final answer in \\boxed{} (where the math
reward looks first): their prompt is the problem followed by BOXED_INSTRUCTION (`with_instruction`).
The synthetic task builds its own prompts (megatron_dppo.data.synthetic) and uses no template.
"""

import argparse
import json

BOXED_INSTRUCTION = "Solve the problem step by step, then write the final answer alone in \\boxed{}."

Messages = list[dict]  # [{"role": "user", "content": "..."}, ...]


def with_instruction(problem: str) -> str:
    """The prompt of a built-in set's problem: the problem, then the request for a boxed final answer."""
    return f"{problem}\n\n{BOXED_INSTRUCTION}"


def has_chat_template(tokenizer: object) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


# the arguments render_prompt gives apply_chat_template itself, which --apply-chat-template-kwargs cannot replace
RENDER_ARGUMENTS = ("conversation", "tokenize", "add_generation_prompt")


def chat_template_kwargs_flag(text: str) -> dict:
    """--apply-chat-template-kwargs's argparse type: a JSON object (of the template's variables), or parsing stops
    with one line saying what is wrong."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON ({error.msg} at character {error.pos}): give an "
                                         "object, e.g. '{\"enable_thinking\": false}'") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r} is a JSON {type(value).__name__}, not an object: give the "
                                         "template's arguments by name, e.g. '{\"enable_thinking\": false}'")
    reserved = [key for key in value if key in RENDER_ARGUMENTS]
    if reserved:
        raise argparse.ArgumentTypeError(f"{reserved[0]!r} is set by the trainer itself (it sets "
                                         f"{', '.join(RENDER_ARGUMENTS)}): drop it")
    return value


def _template_text(tokenizer: object) -> str:
    """The chat template's source: one template, or every named one (a tokenizer may hold a dict or list of them)."""
    template = tokenizer.chat_template
    if isinstance(template, dict):
        return "\n".join(template.values())
    if isinstance(template, list):
        return "\n".join(entry.get("template", "") for entry in template)
    return str(template)


def require_chat_template(tokenizer: object, template_kwargs: dict | None = None) -> None:
    """Raise a clear error when --apply-chat-template meets a tokenizer without a chat template, or
    --apply-chat-template-kwargs a key its template never mentions."""
    name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
    if not has_chat_template(tokenizer):
        raise ValueError(
            f"--apply-chat-template: the tokenizer of {name} has no chat template (no chat_template in its "
            "tokenizer_config.json or chat_template.jinja): drop the flag to use prompts as written, or use a model "
            "whose tokenizer has one"
        )
    unknown = [key for key in template_kwargs or {} if key not in _template_text(tokenizer)]
    if unknown:
        raise ValueError(f"--apply-chat-template-kwargs: the chat template of {name} never mentions "
                         f"{', '.join(map(repr, unknown))}, so it would render every prompt as if the key were not "
                         "given: check the key's name against the template, or drop it")


def render_prompt(prompt: str | Messages, apply_chat_template: bool, tokenizer: object | None = None,
                  template_kwargs: dict | None = None) -> str:
    """The text the policy continues for `prompt` (text or chat messages); `template_kwargs`: the chat template's
    own arguments (--apply-chat-template-kwargs)."""
    if not apply_chat_template:
        if not isinstance(prompt, str):
            raise ValueError("the prompt is a list of chat messages: pass --apply-chat-template to render it with "
                             "the tokenizer's chat template")
        return prompt
    require_chat_template(tokenizer, template_kwargs)
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                         **(template_kwargs or {}))


def encode_prompt(prompt: str | Messages, apply_chat_template: bool, tokenizer,
                  template_kwargs: dict | None = None) -> list[int]:
    """Prompt token ids. A chat template writes its own special tokens (BOS included), so none are added to it."""
    text = render_prompt(prompt, apply_chat_template, tokenizer, template_kwargs)
    if apply_chat_template:
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer.encode(text)
