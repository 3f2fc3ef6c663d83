"""Argument checks the public constructors share: a TypeError for a wrong type, a ValueError
for a wrong value, each naming what was expected, what was given and what to do."""

NUMBER = (int, float)


def _is_instance(value, kinds) -> bool:
    """``isinstance``, except that a bool does not count as an int or a float."""
    kinds = kinds if isinstance(kinds, tuple) else (kinds,)
    return isinstance(value, kinds) and (bool in kinds or not isinstance(value, bool))


def is_non_negative(value) -> bool:
    return value >= 0


def is_positive(value) -> bool:
    return value > 0


def _shown(value) -> str:
    """The value as an error message shows it: type and a repr cut to one short line."""
    text = " ".join(repr(value).split())  # a module's repr spans lines
    text = text if len(text) <= 80 else text[:77] + "..."
    return text if value is None else f"{type(value).__name__} {text}"


def argument_error(error_type, message, value, fix):
    """``error_type('<message>, got <value>. <fix>')``: what was expected, what was given, what to do."""
    return error_type(f"{message}, got {_shown(value)}. {fix}")


def check_argument(value, kinds, message, fix, is_valid=None):
    """Raise TypeError when ``value`` is not one of ``kinds``, ValueError when ``is_valid`` rejects it.

    ``message`` says what the argument must be (the legacy assertion text); the error
    adds the value given and ``fix``.
    """
    if not _is_instance(value, kinds):
        raise argument_error(TypeError, message, value, fix)
    if is_valid is not None and not is_valid(value):
        raise argument_error(ValueError, message, value, fix)
