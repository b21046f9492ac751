"""Validation of a compressor's hyper-parameters.

Methods are dataclasses that mix in :class:`_Validated`: their ``validate()`` runs when they are
built and raises ``ValueError`` on a bad parameter, using :func:`check_ratio` and
:func:`check_choice`. Validation of compressed chunks is another matter (``KVCompressor.check``,
``codec.validate``).
"""

from __future__ import annotations

import dataclasses
from typing import Any


class _Validated:
    """Dataclass mix-in: ``validate()`` runs after ``__init__`` and raises ``ValueError``."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:  # pragma: no cover - default accepts everything
        pass

    def params(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # type: ignore[call-overload]


def check_ratio(name: str, value: float) -> None:
    """Raise ``ValueError`` unless ``0 < value <= 1``."""
    if not (0.0 < value <= 1.0):
        raise ValueError(f"{name} must be in (0, 1], got {value!r}")


def check_choice(name: str, value: Any, choices: tuple) -> None:
    """Raise ``ValueError`` unless ``value`` is one of ``choices``, of the same type."""
    # Compare types too: bits=2.0 equals 2 but would fail later, deep inside encode.
    if not any(value == c and type(value) is type(c) for c in choices):
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
