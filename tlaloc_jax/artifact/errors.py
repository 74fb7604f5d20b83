"""The one error an artifact is refused with."""


class ManifestError(ValueError):
    """An artifact is refused at load; the message names the file, field or entry at fault."""
