"""The one exception type that means "the user asked for something we cannot do"."""


class SwarmError(Exception):
    """A problem the user can fix: bad flag, unknown model, missing or corrupt file.

    The CLI prints its message (no traceback) and exits with status 2. Messages say what
    was wrong and, where possible, what to do instead.
    """
