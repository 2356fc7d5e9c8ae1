"""Render a model's Jinja chat template in a sandbox.

Templates come with the model file, so they are untrusted: they run in jinja2's
ImmutableSandboxedEnvironment (no attribute access to dunders, no mutation of passed-in
objects), with the globals Hugging Face templates expect (`raise_exception`,
`strftime_now`) and a `tojson` that keeps non-ASCII text as is.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The template failed to compile or render (or called raise_exception)."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"chat template raised: {message}")


def _tojson(value: Any, indent: int | None = None) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ChatTemplate:
    """A compiled chat template. `render` is safe to call from several threads."""

    def __init__(self, source: str, special_tokens: Mapping[str, str | None]) -> None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = _tojson
        env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template does not compile: {e}") from e
        self.source = source
        # bos_token / eos_token etc., as templates reference them by name.
        self._special = dict(special_tokens)

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
               **extra: Any) -> str:
        """Render `messages` ([{"role", "content"}, ...]); ChatTemplateError on any failure."""
        for i, m in enumerate(messages):
            if not isinstance(m, Mapping) or "role" not in m:
                raise ChatTemplateError(f"message {i} must be a mapping with a 'role'")
        try:
            return self._template.render(
                messages=[dict(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                **self._special,
                **extra,
            )
        except ChatTemplateError:
            raise
        except jinja2.exceptions.SecurityError as e:
            raise ChatTemplateError(f"chat template tried an unsafe operation: {e}") from e
        except Exception as e:  # a template is foreign code: any error is a bad template/input
            raise ChatTemplateError(f"chat template failed to render: {type(e).__name__}: {e}") from e
