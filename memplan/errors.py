class MemplanError(ValueError):
    """A bad input or an impossible request, worded for the user (one line)."""
