"""The base of every section of the trainer's config: frozen, unknown keys refused, no booleans as numbers.

YAML 1.1 reads ``yes``, ``no``, ``on``, ``off``, ``true`` and ``false`` as booleans, and pydantic
would take them for 1 and 0 in a number field: ``max_steps: on`` would train for one step, silently.
Torch-free, like the config itself.
"""

from __future__ import annotations

import types
import typing
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator

__all__ = ["ConfigSection"]


def _takes_bool(annotation: Any) -> bool:
    """Whether a field of type ``annotation`` accepts a boolean as such (``bool``, a union holding it, ``Any``)."""
    if annotation is bool or annotation is Any:
        return True
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType, typing.Annotated):
        return any(_takes_bool(arg) for arg in typing.get_args(annotation))
    return False


class ConfigSection(BaseModel):
    """A section of the config: frozen, with unknown keys and booleans in non-boolean fields refused."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_booleans_as_numbers(cls, value: object, info: ValidationInfo) -> object:
        field = cls.model_fields.get(info.field_name or "")
        if isinstance(value, bool) and field is not None and not _takes_bool(field.annotation):
            raise ValueError(
                "a boolean, which this key does not take: write the number or text it takes (text that reads "
                "true or false goes in quotes)"
            )
        return value
