"""The one exception type that means "the user asked for something we cannot do", and running
trio so that one raised inside its nurseries reaches the user as itself."""


class SwarmError(Exception):
    """A problem the user can fix: bad flag, unknown model, missing or corrupt file.

    The CLI prints its message (no traceback) and exits with status 2. Messages say what
    was wrong and, where possible, what to do instead.
    """


def run_trio(async_fn, *args):
    """trio.run, with a SwarmError raised inside nurseries unwrapped from its exception group
    so that the CLI prints it as a plain message."""
    import trio  # here, not at the top: the data and model modules that use SwarmError need no trio

    try:
        return trio.run(async_fn, *args)
    except BaseExceptionGroup as group:
        leaves = list(_leaves(group))
        user = [e for e in leaves if isinstance(e, SwarmError)]
        if user and all(isinstance(e, (SwarmError, trio.Cancelled)) for e in leaves):
            raise user[0] from None
        if leaves and all(isinstance(e, KeyboardInterrupt) for e in leaves):
            raise KeyboardInterrupt from None
        raise


def _leaves(exc: BaseException):
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            yield from _leaves(inner)
    else:
        yield exc
