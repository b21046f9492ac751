"""One validator for every flat option set of the package (store config, vLLM proposer options).

Each entry point (Python, CLI JSON, LMCache YAML ``extra_config``, the L2 adapter's JSON, vLLM's
extra configs) hands a mapping to :func:`parse_options` with the prefix its user wrote and where
it came from, so the same mistake gets the same message everywhere, naming the key as written.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

T = TypeVar("T")


def parse_options(cls: type[T], values: Mapping[str, Any], *, where: str, prefix: str = "",
                  spell: Callable[[str], str] | None = None) -> T:
    """Build the dataclass ``cls`` from ``values``; call its ``validate()`` if it has one.

    Unknown keys, missing required keys, values of the wrong type (``bool`` is not accepted for an
    ``int`` nor the reverse) and ``validate()``'s ``ValueError`` (whose message starts with the
    field's name) all raise ``ValueError`` starting with ``where`` and naming the key as the user
    wrote it: ``prefix + key``, or ``spell(key)`` (e.g. an environment variable's name)."""
    spell = spell or (lambda name: prefix + name)
    if not isinstance(values, Mapping):
        raise ValueError(f"{where}: expected a mapping of options, got {type(values).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    hints = typing.get_type_hints(cls)
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ValueError(f"{where}: unknown key {', '.join(repr(spell(k)) for k in unknown)}; "
                         f"valid keys: {', '.join(spell(k) for k in fields)}")
    missing = [spell(n) for n, f in fields.items() if _required(f) and n not in values]
    if missing:
        raise ValueError(f"{where}: missing required key {', '.join(map(repr, missing))}")
    for name, value in values.items():
        if not _matches(value, hints[name]):
            raise ValueError(f"{where}: {spell(name)} must be {_describe(hints[name])}, "
                             f"got {type(value).__name__} {value!r}")
    obj = cls(**values)
    validate = getattr(obj, "validate", None)
    if validate is not None:
        try:
            validate()
        except ValueError as e:
            msg = str(e)
            head = msg.split(" ", 1)[0].rstrip(":")
            raise ValueError(f"{where}: {spell(head) + msg[len(head):] if head in fields else msg}") from e
    return obj


def _required(f: dataclasses.Field) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


def _matches(value: Any, hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, h) for h in typing.get_args(hint))
    if hint is Any:
        return True
    if hint is type(None):
        return value is None
    base = origin or hint
    if base is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if base is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, base)


def _describe(hint: Any) -> str:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(_describe(h) for h in typing.get_args(hint))
    if hint is type(None):
        return "null"
    base = typing.get_origin(hint) or hint
    return {dict: "an object", list: "a list"}.get(base, getattr(base, "__name__", str(base)))
