"""The one error type users see: bad input, reported as one line and exit code 2."""

from __future__ import annotations


class InputError(Exception):
    """A file, field or argument that does not hold what fasop expects.

    The message names where the problem is (a file and field, or an argument: an ArgumentError) and what was
    expected; the library's messages name no option of the command line, which prints them as one line and
    exits with code 2.
    """

    def __init__(self, where: str, problem: str, remedy: str | None = None):
        self.where = where
        self.problem = problem
        self.remedy = remedy  # the argument that settles it (force, profiles_dir), named after the problem
        super().__init__(f"{where}: {problem}" + (f" ({remedy})" if remedy else ""))


class ArgumentError(InputError):
    """A bad value of an argument of a fasop function, named as the Python API names it (`train_tokens`,
    `layers_per_stage`); the command line names the option that gave it instead (fasop.cli.common)."""

    def __init__(self, argument: str, problem: str, value: object = None, remedy: str | None = None):
        self.argument = argument
        self.value = value
        super().__init__(argument if value is None else f"{argument}={value}", problem, remedy)
