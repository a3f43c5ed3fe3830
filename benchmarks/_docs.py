"""Writing a benchmark's table into docs/benchmarks.md: each script owns one section between HTML-comment
markers, so re-running a script replaces its own section and leaves the others alone."""

from __future__ import annotations

import pathlib

BENCHMARKS_MD = pathlib.Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"


def write_section(key: str, body: str, path: pathlib.Path = BENCHMARKS_MD) -> None:
    """Replace (or append) the section marked ``key`` with ``body`` (Markdown, heading included)."""
    begin, end = f"<!-- {key}:begin -->", f"<!-- {key}:end -->"
    section = f"{begin}\n{body}\n{end}"
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    if begin in text:
        text = text[: text.index(begin)] + section + text[text.index(end) + len(end):]
    else:
        text = text.rstrip() + "\n\n" + section + "\n"
    path.parent.mkdir(exist_ok=True)
    path.write_text(text)
