"""What every command-line entry point shares: bad input ends in one line, not a traceback."""

import functools
import sys

from .data.sources import DataError


def one_line_errors(main):
    """Report a bad config or bad data as `error: ...` on stderr and exit 2."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except (DataError, ValueError, FileNotFoundError) as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)

    return wrapper
