"""The planner's one error: bad input, naming the command-line flag at fault."""

from __future__ import annotations


class CapacityInputError(ValueError):
    """`flag` is the command-line flag (``--context``); the console maps it to its field.
    The message is one line and names the flag itself."""

    def __init__(self, flag: str, message: str) -> None:
        super().__init__(message)
        self.flag = flag
