"""A parsed JSON body to a request model, or a 400 that names the one field to fix.

We answer 400, as OpenAI does, not FastAPI's 422; ``param`` is the field's path
(``messages.0.content``) without pydantic's union-member tags (``function-after[...]``,
``list[TextPart]``), which name our types, not the client's fields.
"""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from services.frontend.errors import APIError
from services.frontend.schemas import body_field_names

M = TypeVar("M", bound=BaseModel)


def validate(model_cls: type[M], data: Any) -> M:
    try:
        return model_cls.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from None


def validation_error(e: ValidationError) -> APIError:
    """400 naming the first bad field. Where the field is a union (``prompt``: a string, a
    list of strings or a list of token ids) pydantic reports one error per member; the most
    telling is the one that got past the type check (``prompt.0: less than 4294967296``
    beats ``prompt: should be a valid string``), then the deepest."""
    errors = e.errors(include_url=False, include_context=False, include_input=False)
    path = [_path(x) for x in errors]
    field = path[0][:1]
    same = [i for i in range(len(errors)) if path[i][:1] == field]
    best = min(same, key=lambda i: (str(errors[i]["type"]).endswith("_type"), -len(path[i]), i))
    loc = ".".join(str(p) for p in path[best])
    msg = str(errors[best]["msg"]).removeprefix("Value error, ")
    head = msg.split(":", 1)[0] if ":" in msg else ""
    if head and (not loc or head.startswith(loc + ".")):
        loc = head  # our validators write "field: what is wrong", a list's item's path too
    return APIError(400, f"{loc}: {msg}" if loc and not msg.startswith(loc) else msg,
                    param=loc or None, code="invalid_value")


def _path(err: ErrorDetails) -> tuple[int | str, ...]:
    names = body_field_names()
    return tuple(p for p in err["loc"] if isinstance(p, int) or p in names)
