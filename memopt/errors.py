"""The error every entry point raises for bad input: a ``ValueError`` whose message is one line per problem, so a
caller (the CLI, ``memopt.plan``, a saved plan's loader) reports all of them at once and names the fix."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["InputError", "UserArgumentError", "as_input_errors", "raise_problems"]


class InputError(ValueError):
    """Bad input: ``problems`` lists one line per problem; the message is that line, or all of them."""

    def __init__(self, problems: list[str], what: str = "input") -> None:
        self.problems = list(problems)
        if len(self.problems) == 1:
            super().__init__(self.problems[0])
        else:
            super().__init__(f"invalid {what}:\n  - " + "\n  - ".join(self.problems))


class UserArgumentError(InputError):
    """What the user's own code made for memopt (the optimizer an ``optimizer=`` callable builds) is wrong for every
    plan. The planner takes a ``ValueError`` raised while it estimates a candidate for a candidate that cannot run,
    and tries the next; this one it lets through, so the user reads the one line that names their argument."""

    def __init__(self, problem: str) -> None:
        super().__init__([problem])


def raise_problems(problems: list[str], what: str = "input") -> None:
    if problems:
        raise InputError(problems, what)


@contextmanager
def as_input_errors() -> Iterator[None]:
    """Around an entry point's reading of what the user passed (a model name, a sample, a hardware name, a plan
    file), and nothing else: every ``ValueError`` raised there is about that input, whichever layer's check said
    so, and leaves as an ``InputError`` with the same message. The work that follows (tracing, the search) stays
    outside, so a ``ValueError`` that is memopt's own bug is not reported as the user's."""
    try:
        yield
    except InputError:
        raise
    except ValueError as exc:
        raise InputError([str(exc)]) from exc
