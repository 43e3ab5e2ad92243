"""The one error type users see: bad input, reported as one line and exit code 2."""


class InputError(Exception):
    """A file, field or option that does not hold what fasop expects.

    The message names where the problem is (a file and field, or an option) and what was expected; the
    command line prints it as one line and exits with code 2.
    """

    def __init__(self, where: str, problem: str):
        self.where = where
        self.problem = problem
        super().__init__(f"{where}: {problem}")
