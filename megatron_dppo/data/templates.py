"""Prompt text: how a data row's prompt becomes the text (and token ids) the policy continues.

    prompt ──► apply_chat_template off: the text as written (chat messages need the template: an error)
           ──► apply_chat_template on:  tokenizer.apply_chat_template(messages, add_generation_prompt=True),
                                        where a text prompt becomes one user turn

The tokenizer's own template renders the chat (the one SGLang and vLLM use), and its output carries its own special
tokens, so none are added when it is encoded. The built-in sets ask for the final answer in \\boxed{} (where the math
reward looks first): their prompt is the problem followed by BOXED_INSTRUCTION (`with_instruction`).
The synthetic task builds its own prompts (megatron_dppo.data.synthetic) and uses no template.
"""

BOXED_INSTRUCTION = "Solve the problem step by step, then write the final answer alone in \\boxed{}."

Messages = list[dict]  # [{"role": "user", "content": "..."}, ...]


def with_instruction(problem: str) -> str:
    """The prompt of a built-in set's problem: the problem, then the request for a boxed final answer."""
    return f"{problem}\n\n{BOXED_INSTRUCTION}"


def has_chat_template(tokenizer: object) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def require_chat_template(tokenizer: object) -> None:
    """Raise a clear error when --apply-chat-template meets a tokenizer without a chat template."""
    if not has_chat_template(tokenizer):
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise ValueError(
            f"--apply-chat-template: the tokenizer of {name} has no chat template (no chat_template in its "
            "tokenizer_config.json or chat_template.jinja): drop the flag to use prompts as written, or use a model "
            "whose tokenizer has one"
        )


def render_prompt(prompt: str | Messages, apply_chat_template: bool, tokenizer: object | None = None) -> str:
    """The text the policy continues for `prompt` (text or chat messages)."""
    if not apply_chat_template:
        if not isinstance(prompt, str):
            raise ValueError("the prompt is a list of chat messages: pass --apply-chat-template to render it with "
                             "the tokenizer's chat template")
        return prompt
    require_chat_template(tokenizer)
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def encode_prompt(prompt: str | Messages, apply_chat_template: bool, tokenizer) -> list[int]:
    """Prompt token ids. A chat template writes its own special tokens (BOS included), so none are added to it."""
    text = render_prompt(prompt, apply_chat_template, tokenizer)
    if apply_chat_template:
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer.encode(text)
