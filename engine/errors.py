"""The one exception type the engine raises for bad input; its message is one line for the user."""


class WorkbenchError(Exception):
    """A problem the user can act on: a bad file, an unsupported layout, a prompt too long.

    The message names the file, node or value and what is wrong, on one line.
    """

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


class ModelFileError(WorkbenchError):
    """A model folder's file is missing, truncated, corrupt or malformed."""


class PromptError(WorkbenchError):
    """A prompt that cannot be run: empty, or longer than the context."""


class UnsupportedModelError(WorkbenchError):
    """A model our engine cannot run yet, e.g. an expert layout without kernels."""
