"""Environment switches, parsed in one place.

``MOE_GROUPED_DECODE``
    unset or ``1``: the plugin is on wherever its kernels can run (which layers it then
    serves: ``contract.choose_method``). ``0``: roll back to vLLM's own dispatch for every
    layer vLLM can serve (read before startup). An explicit ``1`` where the kernels cannot run
    is an error at startup (fail closed), while unset means "on where possible, off elsewhere".
``MOE_GROUPED_DECODE_FORCE``
    ``1``: the plugin serves every AWQ MoE layer its ops compute, measured or not, even where
    vLLM has its own backend for it (the grouped route where a contract matches, the dense
    route elsewhere). Unset or ``0``: a layer leaves vLLM only where a measurement says the
    plugin is faster here, a contract written by hand names it, or vLLM has no backend for it.
    Set together with ``MOE_GROUPED_DECODE=0`` it is an error (the two contradict).
``MOE_GROUPED_DECODE_COSERVE``
    unset or ``1``: on a CUDA GPU, a layer the plugin does not take whole is co-served where its
    measured table gives a window (``tables.coserve_verdict``): vLLM loads it for its Marlin
    backend and runs it, except at the window's token counts, where the plugin's kernel reads
    the same tensors. ``0``: off, every such layer vLLM's own method at every token count.
``MOE_GROUPED_DECODE_TUNE``
    ``1``: opt-in autotune of small shapes at warmup. Default off.
``MOE_GROUPED_DECODE_WINDOW``
    ``LO..HI`` (e.g. ``2..8``, the seeds' window): the token counts the grouped route serves on
    the measured contracts (qwen3.8-tp4, ...), over the measured tables' windows; unset:
    the table's. Contracts given in MOE_GROUPED_DECODE_CONTRACTS carry windows of their own.
``MOE_GROUPED_DECODE_GLUON``
    unset or ``1``: the grouped op's W13 runs as the Gluon kernel where Gluon runs,
    and so does W2 where the config asks. ``0``: the ``tl`` kernels everywhere, with
    their own table: the rollback should Triton's experimental Gluon misbehave.
``MOE_GROUPED_DECODE_BATCH_INVARIANT``
    ``1``: every token's output bits are the same whatever M and whatever other tokens share
    the call: admitted layers run one route (the prefill route) under one launch config at
    every M. Unset: follows vLLM's ``VLLM_BATCH_INVARIANT``. ``0``: off even when vLLM's is on.
``MOE_GROUPED_DECODE_DIRECT_LAUNCH``
    unset or ``1``: after the first launch of each kernel specialization, the CUDA launches go
    straight to the binary Triton chose (``kernels/launcher.py``: less host time per eager call).
    ``0``: every launch through Triton's own dispatch (the rollback). Read once, at the first
    launch (and parsed at the vLLM plugin's startup).
``MOE_GROUPED_DECODE_CHECK_IDS``
    ``1``: debug mode for routing ids: the CUDA kernels set a device flag when a routed id is
    outside [0, E) (such a slot still contributes nothing), and every eager call of the ops
    checks that flag before and after its launches and raises a clear error (two host syncs
    per call; a CUDA graph's replays are checked at the next eager call or by
    ``ops.raise_on_flagged_ids()``). Unset or ``0``: off, no flag, no sync.

Each switch also answers to its older name, ``VLLM_AWQ_MOE_GROUPED_DECODE``,
``VLLM_AWQ_MOE_GROUPED_DECODE_TUNE`` and ``VLLM_AWQ_MOE_GROUPED_DECODE_GLUON``.
The new names carry no ``VLLM_`` prefix because vLLM warns about (and with
``--fail-on-environ-validation`` rejects) every ``VLLM_*`` variable it does not
know, and it has no public way to make a plugin's variables known. Both names
set to values that mean the same is fine; set to values that disagree is an
error naming both (which one wins would be a guess). An empty value counts as
unset.
"""

from __future__ import annotations

import enum
import os
from typing import Dict, Optional, Tuple

GROUPED_DECODE_ENV = "MOE_GROUPED_DECODE"
TUNE_ENV = "MOE_GROUPED_DECODE_TUNE"
GLUON_W13_ENV = "MOE_GROUPED_DECODE_GLUON"

# switch -> its older, VLLM_-prefixed name (still read)
LEGACY_ENV_NAMES: Dict[str, str] = {
    GROUPED_DECODE_ENV: "VLLM_AWQ_MOE_GROUPED_DECODE",
    TUNE_ENV: "VLLM_AWQ_MOE_GROUPED_DECODE_TUNE",
    GLUON_W13_ENV: "VLLM_AWQ_MOE_GROUPED_DECODE_GLUON",
}
SWITCH_ENVS: Tuple[str, ...] = tuple(LEGACY_ENV_NAMES)

_TRUE = ("1", "true", "on", "yes")
_FALSE = ("0", "false", "off", "no")


class GroupedDecodeMode(enum.Enum):
    AUTO = "auto"  # unset: on where possible, dense elsewhere
    REQUIRED = "required"  # explicit 1: on, and fail at startup if it cannot run
    OFF = "off"  # explicit 0: rollback switch

    @property
    def enabled(self) -> bool:
        return self is not GroupedDecodeMode.OFF


def _raw(name: str) -> Optional[str]:
    raw = os.environ.get(name)
    return None if raw is None or raw.strip() == "" else raw


def _to_bool(name: str, raw: str) -> bool:
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name}={raw!r} is not understood: use 1 (on) or 0 (off), or leave it unset")


def switch_setting(name: str) -> Tuple[Optional[str], Optional[bool]]:
    """(the variable that sets switch ``name``, its value), or (None, None) when unset.

    ``name`` is one of :data:`SWITCH_ENVS`; its legacy name counts too. Both set
    and disagreeing: ValueError naming both.
    """
    legacy = LEGACY_ENV_NAMES[name]
    settings = [(n, _to_bool(n, raw)) for n in (name, legacy) if (raw := _raw(n)) is not None]
    if not settings:
        return None, None
    if len(settings) == 2 and settings[0][1] != settings[1][1]:
        raise ValueError(
            f"{name}={os.environ[name]!r} and its old name {legacy}={os.environ[legacy]!r} disagree: "
            f"set only {name}"
        )
    return settings[0]


def _parse_bool(name: str, default: bool | None) -> bool | None:
    value = switch_setting(name)[1]
    return default if value is None else value


def grouped_decode_mode() -> GroupedDecodeMode:
    explicit = _parse_bool(GROUPED_DECODE_ENV, None)
    if explicit is None:
        return GroupedDecodeMode.AUTO
    return GroupedDecodeMode.REQUIRED if explicit else GroupedDecodeMode.OFF


def tune_enabled() -> bool:
    return bool(_parse_bool(TUNE_ENV, False))


def gluon_w13_enabled() -> bool:
    return bool(_parse_bool(GLUON_W13_ENV, True))


def legacy_names_in_use() -> Tuple[str, ...]:
    """The old ``VLLM_``-prefixed switch names set in this environment."""
    return tuple(legacy for legacy in LEGACY_ENV_NAMES.values() if _raw(legacy) is not None)


def without_switches(environ: Dict[str, str], switches: Tuple[str, ...] = SWITCH_ENVS) -> Dict[str, str]:
    """``environ`` minus ``switches`` under both names (for a child process that is given its own)."""
    names = set(switches) | {LEGACY_ENV_NAMES[s] for s in switches}
    return {key: value for key, value in environ.items() if key not in names}


FORCE_ENV = "MOE_GROUPED_DECODE_FORCE"


def force_plugin() -> bool:
    """MOE_GROUPED_DECODE_FORCE=1: serve every layer the ops compute, whatever vLLM has (module docstring)."""
    raw = _raw(FORCE_ENV)
    if raw is None or not _to_bool(FORCE_ENV, raw):
        return False
    if grouped_decode_mode() is GroupedDecodeMode.OFF:
        name = switch_setting(GROUPED_DECODE_ENV)[0]
        raise ValueError(f"{FORCE_ENV}=1 and {name}=0 contradict (serve every layer with the plugin / roll every "
                         "layer back to vLLM): set one of them")
    return True


WINDOW_ENV = "MOE_GROUPED_DECODE_WINDOW"


def grouped_window_setting() -> Optional[Tuple[int, int]]:
    """MOE_GROUPED_DECODE_WINDOW as (lo, hi), or None when unset."""
    raw = _raw(WINDOW_ENV)
    if raw is None:
        return None
    try:
        lo, hi = (int(part) for part in raw.strip().split(".."))
    except ValueError:
        raise ValueError(f"{WINDOW_ENV}={raw!r} is not understood: use LO..HI, e.g. 2..8") from None
    if not 1 <= lo <= hi:
        raise ValueError(f"{WINDOW_ENV}={raw!r}: the window must satisfy 1 <= LO <= HI")
    return lo, hi


BATCH_INVARIANT_ENV = "MOE_GROUPED_DECODE_BATCH_INVARIANT"
VLLM_BATCH_INVARIANT_ENV = "VLLM_BATCH_INVARIANT"  # vLLM's own switch, read only


def batch_invariant() -> bool:
    """Whether batch-invariant mode is on: MOE_GROUPED_DECODE_BATCH_INVARIANT when set, else
    vLLM's VLLM_BATCH_INVARIANT (any value vLLM reads as on: a nonzero integer)."""
    raw = _raw(BATCH_INVARIANT_ENV)
    if raw is not None:
        return _to_bool(BATCH_INVARIANT_ENV, raw)
    raw = _raw(VLLM_BATCH_INVARIANT_ENV)
    if raw is None:
        return False
    try:
        return int(raw) != 0
    except ValueError:
        return _to_bool(VLLM_BATCH_INVARIANT_ENV, raw)


CHECK_IDS_ENV = "MOE_GROUPED_DECODE_CHECK_IDS"


def check_ids() -> bool:
    """Debug mode: the kernels flag routed ids outside [0, E) on the device (module docstring)."""
    raw = _raw(CHECK_IDS_ENV)
    return False if raw is None else _to_bool(CHECK_IDS_ENV, raw)


COSERVE_ENV = "MOE_GROUPED_DECODE_COSERVE"


def coserve_enabled() -> bool:
    """Whether declined layers may be co-served on vLLM's Marlin tensors (module docstring)."""
    raw = _raw(COSERVE_ENV)
    return True if raw is None else _to_bool(COSERVE_ENV, raw)


DIRECT_LAUNCH_ENV = "MOE_GROUPED_DECODE_DIRECT_LAUNCH"


def direct_launch() -> bool:
    """Whether launches after a specialization's first skip Triton's dispatch (module docstring)."""
    raw = _raw(DIRECT_LAUNCH_ENV)
    return True if raw is None else _to_bool(DIRECT_LAUNCH_ENV, raw)
