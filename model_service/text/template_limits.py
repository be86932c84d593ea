"""Time and size limits for chat templates, which come with a checkpoint and are untrusted
code: Jinja's sandbox stops them reaching Python's internals, not from allocating
`"x" * 200000000` or looping `range(100000)` inside `range(100000)`.

Size: every operator that can multiply a string or list (`*`, `+`, `%`, `**`), every
attribute and item read, call and filter result is checked against a character budget,
and so are a filter's numeric arguments (`center(200000000)`) before it runs, so no string
grows past the budget by more than one doubling. The filters and string methods whose
result can be far larger than their inputs (`replace` with a long replacement, `join` of
many long items, `indent`, `wordwrap`, `center`, `expandtabs`) have that result's size
worked out from their arguments first, and are refused before they build it. Time: the render runs under a trace
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
        subject = getattr(__obj, "__self__", None)
        if isinstance(subject, str):  # a string's method: "-".join(items), s.replace(a, b)
            __self.check_size(_METHOD_SIZES.get(getattr(__obj, "__name__", "")), subject, args, kwargs)
        return __self.check(super().call(__context, __obj, *args, **kwargs))

    def check_size(self, size_of: Callable[..., int] | None, subject: Any, args: tuple, kwargs: dict) -> None:
        """Refuses a call whose result `size_of(budget, subject, *args, **kwargs)` says is past the budget."""
        if size_of is None:
            return
        try:
            size = size_of(self.max_chars, subject, *args, **kwargs)
        except (TypeError, ValueError, AttributeError):
            return  # arguments the call itself will refuse
        if size > self.max_chars:
            raise TemplateLimitExceeded(f"the template would build a string of {size:,} characters; "
                                        f"the limit is {self.max_chars:,}")


def _replaced_size(limit: int, text: str, old: str, new: str, count: int | None = None) -> int:
    found = len(text) + 1 if old == "" else text.count(old)
    if count is not None and count >= 0:
        found = min(found, count)
    return len(text) + found * (len(new) - len(old))


def _joined_size(limit: int, separator: str, items: Any) -> int:
    if isinstance(items, str):
        items = list(items)
    if not isinstance(items, (list, tuple)):
        return 0  # a generator: its result is checked once built
    size = len(separator) * max(len(items) - 1, 0)
    for item in items:
        size += _text_size(item, limit - size)
        if size > limit:
            break
    return size


def _text_size(value: Any, room: int) -> int:
    """About how long str(value) is, walked only until it passes `room` (a list repeating
    one long string thousands of times is not printed to find out)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, (list, tuple, dict)):
        size = 2 + 2 * len(value)
        for item in (value.items() if isinstance(value, dict) else value):
            size += _text_size(item, room - size)
            if size > room:
                break
        return size
    return len(str(value)) if isinstance(value, (int, float, bool)) or value is None else 0


def _lines(text: str) -> int:
    return text.count("\n") + 1


def _padded_size(limit: int, text: str, width: int, *_: Any) -> int:
    return max(len(text), int(width))


# What a filter's result would be, in characters, from (the budget, its value, its arguments).
_FILTER_SIZES: dict[str, Callable[..., int]] = {
    "replace": _replaced_size,
    "join": lambda limit, items, d="", attribute=None: 0 if attribute is not None else _joined_size(limit, d, items),
    "indent": lambda limit, text, width=4, first=False, blank=False: len(text) + _lines(text) * (
        len(width) if isinstance(width, str) else int(width)),
    "wordwrap": lambda limit, text, width=79, break_long_words=True, wrapstring=None, break_on_hyphens=True: len(
        text) + (len(text) // max(int(width), 1) + _lines(text)) * len(wrapstring or "\n"),
}
# And a string method's, from (the budget, the string, its arguments).
_METHOD_SIZES: dict[str, Callable[..., int]] = {
    "replace": _replaced_size,
    "join": _joined_size,
    "center": _padded_size,
    "ljust": _padded_size,
    "rjust": _padded_size,
    "zfill": _padded_size,
    "expandtabs": lambda limit, text, tabsize=8: len(text) + text.count("\t") * max(int(tabsize), 0),
}


def limit_filters(environment: LimitedSandbox) -> None:
    """Each filter refuses a number argument past the budget (a width), and a result its
    arguments say would be past it, and checks its result."""
    for name, function in list(environment.filters.items()):
        environment.filters[name] = _limited(function, environment, _FILTER_SIZES.get(name))


def _limited(function: Callable, environment: LimitedSandbox, size_of: Callable[..., int] | None = None) -> Callable:
    # Jinja passes the context, eval context or environment first to filters marked for it;
    # then comes the value filtered, then the filter's own arguments.
    pass_arg = getattr(function, "jinja_pass_arg", None)
    first_argument = 2 if pass_arg is not None else 1

    def limited(*args: Any, **kwargs: Any) -> Any:
        for value in (*args[first_argument:], *kwargs.values()):
            if isinstance(value, int) and not isinstance(value, bool) and abs(value) > environment.max_chars:
                raise TemplateLimitExceeded(f"a filter was given {value:,}; the limit is {environment.max_chars:,}")
        if size_of is not None and len(args) >= first_argument:
            environment.check_size(size_of, args[first_argument - 1], args[first_argument:], kwargs)
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
