"""An exception as the one line a user reads: its message's first line, or its type where it has no message."""


def first_line(error: BaseException, limit: int | None = None) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:limit] if text else type(error).__name__
