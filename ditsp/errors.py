"""How ditsp words an error for a person: one line."""

from __future__ import annotations


def one_line(msg: str, limit: int = 400) -> str:
    """A multi-line message (a checkpoint report, say) as one line: its lines joined, long ones cut."""
    text = "; ".join(part.strip().rstrip(":") for part in str(msg).splitlines() if part.strip())
    return text if len(text) <= limit else text[: limit - 3] + "..."
