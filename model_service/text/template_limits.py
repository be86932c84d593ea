"""Time and size limits for chat templates, which come with a checkpoint and are untrusted
code: Jinja's sandbox stops them reaching Python's internals, not from allocating
`"x" * 200000000` or looping `range(100000)` inside `range(100000)`.

Size: every operator that can multiply a string or list (`*`, `+`, `%`, `**`), every
attribute and item read, call and filter result is checked against a character budget,
and so are a filter's numeric arguments (`center(200000000)`) before it runs, so no string
grows past the budget by more than one doubling. Time: the render runs under a trace
function that, on each line of template code, checks the deadline; Python loops in the
compiled template are lines, so a loop that never ends ends there.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Where Jinja says its compiled code comes from (frames of templates made by from_string).
TEMPLATE_FILENAME = "<template>"
# How often (lines of template code) the clock is read.
_CLOCK_EVERY = 64


class TemplateLimitExceeded(SecurityError):
    """A render went over its time or size budget."""


class LimitedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox with a character budget on what a template builds."""

    intercepted_binops = frozenset({"*", "+", "%", "**"})

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.max_chars = 1 << 20  # set per render (ChatTemplate.render)

    def check(self, value: Any) -> Any:
        if isinstance(value, (str, list, tuple, dict)) and len(value) > self.max_chars:
            raise TemplateLimitExceeded(f"the template built a {type(value).__name__} of {len(value):,} items; "
                                        f"the limit is {self.max_chars:,}")
        return value

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            for sequence, times in ((left, right), (right, left)):
                if isinstance(sequence, (str, list, tuple)) and isinstance(times, int) and times > 0:
                    if len(sequence) * times > self.max_chars:
                        raise TemplateLimitExceeded(f"the template repeats {len(sequence):,} items {times:,} times; "
                                                    f"the limit is {self.max_chars:,} in all")
        elif operator == "+" and isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
            if len(left) + len(right) > self.max_chars:
                raise TemplateLimitExceeded(f"the template joins {len(left) + len(right):,} items; "
                                            f"the limit is {self.max_chars:,}")
        elif operator == "**" and isinstance(right, (int, float)) and abs(right) > 256 and \
                isinstance(left, (int, float)) and abs(left) > 1:
            raise TemplateLimitExceeded(f"the template raises a number to the power {right}; at most 256")
        return self.check(super().call_binop(context, operator, left, right))

    def getattr(self, obj: Any, attribute: str) -> Any:
        return self.check(super().getattr(obj, attribute))

    def getitem(self, obj: Any, argument: Any) -> Any:
        return self.check(super().getitem(obj, argument))

    def call(__self, __context, __obj, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 - Jinja's signature
        for value in (*args, *kwargs.values()):
            __self.check(value)
        return __self.check(super().call(__context, __obj, *args, **kwargs))


def limit_filters(environment: LimitedSandbox) -> None:
    """Each filter refuses a number argument past the budget (a width) and checks its result."""
    for name, function in list(environment.filters.items()):
        environment.filters[name] = _limited(function, environment)


def _limited(function: Callable, environment: LimitedSandbox) -> Callable:
    # Jinja passes the context, eval context or environment first to filters marked for it;
    # then comes the value filtered, then the filter's own arguments.
    pass_arg = getattr(function, "jinja_pass_arg", None)
    first_argument = 2 if pass_arg is not None else 1

    def limited(*args: Any, **kwargs: Any) -> Any:
        for value in (*args[first_argument:], *kwargs.values()):
            if isinstance(value, int) and not isinstance(value, bool) and abs(value) > environment.max_chars:
                raise TemplateLimitExceeded(f"a filter was given {value:,}; the limit is {environment.max_chars:,}")
        return environment.check(function(*args, **kwargs))

    if pass_arg is not None:
        limited.jinja_pass_arg = pass_arg
    return limited


def run_with_deadline(render: Callable[[], Any], seconds: float) -> Any:
    """render(), ended with TemplateLimitExceeded when template code runs past `seconds`."""
    deadline = time.monotonic() + seconds
    lines = 0

    def on_line(frame, event, arg):
        nonlocal lines
        if event == "line":
            lines += 1
            if lines % _CLOCK_EVERY == 0 and time.monotonic() > deadline:
                raise TemplateLimitExceeded(f"the template ran longer than {seconds:g} s")
        return on_line

    def on_call(frame, event, arg):
        return on_line if frame.f_code.co_filename == TEMPLATE_FILENAME else None

    previous = sys.gettrace()
    sys.settrace(on_call)
    try:
        return render()
    finally:
        sys.settrace(previous)
