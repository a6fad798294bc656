"""The markdown every bench prints: tables, and the generated blocks of a page (docs/results.md) that
bench/time_to_accuracy.py and bench/estimator_check.py rewrite, each between its markers."""

from pathlib import Path


def markdown(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def write_page(page: Path, block: str, generated: str) -> None:
    """Replace the page's generated block named `block` (between its markers), keeping the text around it."""
    begin, end = f"<!-- BEGIN GENERATED {block} by bench/time_to_accuracy.py -->", f"<!-- END GENERATED {block} -->"
    text = page.read_text() if page.is_file() else "# Results\n"
    if begin not in text:
        text = f"{text.rstrip()}\n\n{begin}\n{end}\n"
    if end not in text:
        raise ValueError(f"{page} has {begin!r} but not {end!r}: restore the end marker after the generated block")
    head, rest = text.split(begin, 1)
    tail = rest.split(end, 1)[1]
    page.write_text(f"{head}{begin}\n{generated}\n{end}{tail}")
