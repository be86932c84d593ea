"""A checkpoint's chat template: messages -> the prompt text the model was tuned on.

Templates are Jinja, written for transformers' `apply_chat_template`, and come from the
checkpoint (untrusted code): they run in Jinja's immutable sandbox, with a time and a
size budget (template_limits.py), and with what transformers gives them, so a template renders here exactly as there: `trim_blocks` and
`lstrip_blocks`, the loop-controls extension, `raise_exception`, `strftime_now`, a `tojson`
that does not HTML-escape, `bos_token` / `eos_token`, and `tools` / `documents` (None unless
given) as variables.

Where a template comes from: a GGUF file's `tokenizer.chat_template`; a Hugging Face
directory's chat_template.jinja, else the `chat_template` of its tokenizer_config.json (a
string, or a list of named templates of which "default" is used).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext

from model_service.errors import ModelLoadError
from model_service.text.template_limits import LimitedSandbox, TemplateLimitExceeded, limit_filters, run_with_deadline

KNOWN_ROLES = ("system", "user", "assistant", "tool")
TEMPLATE_FILE = "chat_template.jinja"
# A render that takes longer is a template that loops: real ones take milliseconds.
RENDER_SECONDS = 2.0
# What a render may build, unless the caller says (validation gives the prompt's byte cap).
DEFAULT_MAX_CHARS = 1 << 20


class ChatTemplateError(Exception):
    """The template refused these messages (its raise_exception) or failed on them."""


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _environment() -> LimitedSandbox:
    environment = LimitedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    environment.filters["tojson"] = _tojson
    limit_filters(environment)
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    return environment


class ChatTemplate:
    def __init__(self, source: str, *, bos_token: str | None = None, eos_token: str | None = None) -> None:
        self._environment = _environment()
        try:
            self._template = self._environment.from_string(source)
        except jinja2.TemplateSyntaxError as error:
            raise ModelLoadError(f"the chat template does not compile: {error} (line {error.lineno})") from None
        self.source = source
        self._special_tokens = {"bos_token": bos_token, "eos_token": eos_token}

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
               max_chars: int = DEFAULT_MAX_CHARS, seconds: float = RENDER_SECONDS, **template_kwargs: Any) -> str:
        """The prompt text; ChatTemplateError with the template's own message when it
        refuses, or when it builds more than `max_chars` or runs longer than `seconds`."""
        # transformers passes tools and documents always, None when there are none: templates
        # test `tools is not none` (Llama 3.1's does).
        variables = {"tools": None, "documents": None, **self._special_tokens, **template_kwargs}
        # One environment per template, its budget set per render (renders of one template
        # run on worker threads at once; every caller passes the service's one budget).
        self._environment.max_chars = max_chars
        try:
            text = run_with_deadline(lambda: self._template.render(
                messages=[dict(message) for message in messages],
                add_generation_prompt=add_generation_prompt,
                **variables,
            ), seconds)
            return self._environment.check(text)
        except TemplateLimitExceeded as error:
            raise ChatTemplateError(f"the chat template went over its limits on these messages: {error}") from None
        except jinja2.TemplateError as error:
            raise ChatTemplateError(f"the chat template refused the messages: {error}") from None
        except Exception as error:  # a template's own bug (a None + str...), triggered by these messages
            raise ChatTemplateError(f"the chat template failed on the messages: {type(error).__name__}: {error}") from None

    @classmethod
    def from_hf_dir(cls, directory: str | Path, *, bos_token: str | None, eos_token: str | None) -> ChatTemplate | None:
        source = hf_template_source(Path(directory))
        return None if source is None else cls(source, bos_token=bos_token, eos_token=eos_token)


def hf_template_source(directory: Path) -> str | None:
    jinja_file = directory / TEMPLATE_FILE
    if jinja_file.is_file():
        return jinja_file.read_text()
    config_file = directory / "tokenizer_config.json"
    if not config_file.is_file():
        return None
    try:
        template = json.loads(config_file.read_text()).get("chat_template")
    except (OSError, ValueError) as error:
        raise ModelLoadError(f"cannot read {config_file}: {error}") from None
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, dict)}
        template = named.get("default")
    return template if isinstance(template, str) and template else None
