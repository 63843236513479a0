"""The project's expected failures: what a user can fix, named in one line by common.cli.main_cli
(exit 2). A leaf module: every package raises these, and it imports nothing of the project's."""


class UserError(Exception):
    """A failure the user can fix: the message names the file, record, field or flag
    and says what to do."""
    exit_code = 2


class InputError(UserError, ValueError):
    """Bad input data, settings or checkpoint (still a ValueError for library callers)."""


class MissingFileError(UserError, FileNotFoundError):
    """A required input file or directory is absent."""


class MissingWeightError(UserError, KeyError):
    """A checkpoint lacks a weight the model needs."""

    def __str__(self):  # KeyError quotes its message
        return str(self.args[0]) if self.args else ""
