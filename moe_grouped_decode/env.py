"""Environment switches, parsed in one place.

``VLLM_AWQ_MOE_GROUPED_DECODE``
    unset or ``1``: the grouped route is on wherever it can run. ``0``: roll back
    to the dense route everywhere (read before startup). An explicit ``1`` where
    the kernels cannot run is an error at startup (fail closed), while unset means
    "on where possible, silently dense elsewhere".
``VLLM_AWQ_MOE_GROUPED_DECODE_TUNE``
    ``1``: opt-in autotune of small shapes at warmup. Default off.
``VLLM_AWQ_MOE_GROUPED_DECODE_GLUON``
    unset or ``1``: the grouped op's W13 runs as the Gluon kernel (``kernels/w13_ring.py``)
    where Gluon runs, and so does W2 where the config asks (``kernels/w2_ring.py``, M = 8's
    table entry). ``0``: the ``tl`` kernels everywhere, with their own (v8) table: the
    rollback should Triton's experimental Gluon misbehave.
"""

from __future__ import annotations

import enum
import os

GROUPED_DECODE_ENV = "VLLM_AWQ_MOE_GROUPED_DECODE"
TUNE_ENV = "VLLM_AWQ_MOE_GROUPED_DECODE_TUNE"
GLUON_W13_ENV = "VLLM_AWQ_MOE_GROUPED_DECODE_GLUON"

_TRUE = ("1", "true", "on", "yes")
_FALSE = ("0", "false", "off", "no")


class GroupedDecodeMode(enum.Enum):
    AUTO = "auto"  # unset: on where possible, dense elsewhere
    REQUIRED = "required"  # explicit 1: on, and fail at startup if it cannot run
    OFF = "off"  # explicit 0: rollback switch

    @property
    def enabled(self) -> bool:
        return self is not GroupedDecodeMode.OFF


def _parse_bool(name: str, default: bool | None) -> bool | None:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name}={raw!r} is not understood: use 1 (on) or 0 (off), or leave it unset")


def grouped_decode_mode() -> GroupedDecodeMode:
    explicit = _parse_bool(GROUPED_DECODE_ENV, None)
    if explicit is None:
        return GroupedDecodeMode.AUTO
    return GroupedDecodeMode.REQUIRED if explicit else GroupedDecodeMode.OFF


def tune_enabled() -> bool:
    return bool(_parse_bool(TUNE_ENV, False))


def gluon_w13_enabled() -> bool:
    return bool(_parse_bool(GLUON_W13_ENV, True))
