"""Prompt templates: how a problem becomes the text the policy continues.

    problem ──► "plain": "Question: ...\\n<instruction>\\nAnswer:"
            ──► "chat":  the tokenizer's chat template around one user turn (problem + instruction)
            ──► "auto":  "chat" when the tokenizer has a chat template, else "plain" (the default)

Every template asks for the final answer in \\boxed{}, which is where the math reward looks first.
The synthetic task builds its own prompts (megatron_dppo.data.synthetic) and uses no template.
"""

BOXED_INSTRUCTION = "Solve the problem step by step, then write the final answer alone in \\boxed{}."
TEMPLATES = ("auto", "plain", "chat")


def has_chat_template(tokenizer: object) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def resolve_template(template: str, tokenizer: object | None) -> str:
    """'plain' or 'chat': what `template` means for this tokenizer."""
    if template not in TEMPLATES:
        raise ValueError(f"unknown prompt template {template!r}; choose one of {TEMPLATES}")
    if template == "auto":
        return "chat" if has_chat_template(tokenizer) else "plain"
    return template


def render_prompt(problem: str, template: str = "auto", tokenizer: object | None = None) -> str:
    """The prompt text for `problem` under `template` (one of TEMPLATES)."""
    if resolve_template(template, tokenizer) == "plain":
        return f"Question: {problem}\n{BOXED_INSTRUCTION}\nAnswer:"
    if not has_chat_template(tokenizer):
        raise ValueError("prompt template 'chat' needs a tokenizer with a chat template; use 'plain' or 'auto'")
    messages = [{"role": "user", "content": f"{problem}\n\n{BOXED_INSTRUCTION}"}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def encode_prompt(problem: str, template: str, tokenizer) -> list[int]:
    """Prompt token ids. A chat template writes its own special tokens (BOS included), so none are added to it."""
    text = render_prompt(problem, template, tokenizer)
    if resolve_template(template, tokenizer) == "chat":
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer.encode(text)
