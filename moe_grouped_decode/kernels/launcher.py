"""One launch of a plan: through Triton's dispatch the first time, straight to its binary after.

Outside vLLM's CUDA graphs (prefill steps above the largest captured batch) every MoE layer's
call launches its kernels from Python, and a step of 48 layers is then bound by the host's time.
Most of a launch's host time is Triton's dispatch (``kernel[grid](...)``: its options, the
specialization of every argument, a cache key built as a string), not the launch itself.

Which binary Triton runs depends on the arguments only through their specialization (each
tensor's dtype and whether its address is 16-byte aligned; each int's range, divisibility by 16
and being 1; None and bools as constants), the current device, and the constexprs and options,
which a ``Launch`` fixes. The cache here keys on something finer: the ``Launch`` itself, the
current device, each tensor's dtype, alignment and being on the GPU, and every other argument's
type and exact value. A hit is therefore an argument list Triton would have given the same
binary, and it is launched the way Triton launches it (the compiled kernel's own runner: the
current stream, the launch hooks), with each tensor given as its address: the key has read it
already, and Triton's launcher would otherwise ask the tensor again and the driver whether it is
a device address (a host tensor is a key of its own, which Triton's dispatch refuses; a kernel
that declares launch metadata, whose hooks see its arguments, keeps Triton's dispatch). The
launches of one op call share one query of the current device and stream (``Call``). Not part
of the key, as they cost host time to read: Triton's debug and instrumentation knobs (a binary
compiled before one is set keeps running) and the module globals a kernel reads (Triton refuses
a changed one; the kernels here read constants only).

Only compiled ``JITFunction`` launches over tensors, ints, floats, bools and None are cached:
under ``TRITON_INTERPRET=1`` every launch goes through Triton, as does any kernel with pre-run
hooks or of a Triton whose compiled kernels lack the runner this relies on. The cache keeps the
most recently used ``MAX_ENTRIES`` (a prefill plan per token count, seven launches each).
``MOE_GROUPED_DECODE_DIRECT_LAUNCH=0`` keeps Triton's dispatch for every launch.
"""

from __future__ import annotations

import inspect
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from triton.runtime.jit import JITFunction

from .. import env

# MOE_GROUPED_DECODE_DIRECT_LAUNCH, read at the first launch (None until then; tests set it)
ENABLED: Optional[bool] = None
MAX_ENTRIES = 8192  # (launch, specialization) pairs kept, the least recently used dropped first
_PLAIN = (torch.Tensor, int, float, bool, type(None))

# key -> (the Launch, its compiled kernel, runner, the constexprs and defaults after the runtime
# arguments), least recently used first
_entries: "OrderedDict[Tuple, Tuple[Any, Any, Any, Tuple]]" = OrderedDict()
# id -> [Launch, its entries], for the launches with an entry (holding them keeps their ids unique)
_cached_launches: Dict[int, List] = {}


def _current_device() -> int:
    return torch.cuda.current_device()


_stream_of = None  # the current stream of a device index, as Triton's runner asks it (set at first use)


def _current_stream(device: int):
    global _stream_of
    if _stream_of is None:
        from triton.runtime import driver

        _stream_of = driver.active.get_current_stream
    return _stream_of(device)


class Call:
    """What the launches of one op call share: the current device and stream, each asked at most
    once (and not at all where no launch is cached: under the interpreter there is no CUDA)."""

    __slots__ = ("_device", "_stream")

    def __init__(self):
        self._device = self._stream = None

    def device(self) -> int:
        if self._device is None:
            self._device = _current_device()
        return self._device

    def stream(self):
        if self._stream is None:
            self._stream = _current_stream(self.device())
        return self._stream


def _key_and_addresses(launch, args: Sequence, device: int) -> Tuple[Tuple, List]:
    """``_key`` and the arguments with every tensor replaced by its address, in one pass."""
    key, plain = [id(launch), device], []
    for arg in args:
        if isinstance(arg, torch.Tensor):
            address = arg.data_ptr()
            # is_cuda: a host tensor's address is no device address; Triton's dispatch refuses it
            key.append((arg.dtype, address % 16 == 0, arg.is_cuda))
            plain.append(address)
        else:
            key.append((type(arg), arg))
            plain.append(arg)
    return tuple(key), plain


def _key(launch, args: Sequence, device: int) -> Tuple:
    return _key_and_addresses(launch, args, device)[0]


def enabled() -> bool:
    """Whether launches skip Triton's dispatch after their first (``MOE_GROUPED_DECODE_DIRECT_LAUNCH``,
    read once: a read per launch would cost what the cache saves)."""
    global ENABLED
    if ENABLED is None:
        ENABLED = env.direct_launch()
    return ENABLED


def run(launch, args: Sequence, call: Optional[Call] = None):
    """Launch ``launch`` (a plan's ``Launch``) on its runtime ``args``, in the kernel's order;
    returns the compiled kernel (None under the interpreter). ``call``: shared by the launches of
    one op call (a fresh one when None)."""
    direct = ENABLED if ENABLED is not None else enabled()
    key = None
    if direct and id(launch) in _cached_launches and not launch.kernel.pre_run_hooks:
        call = call or Call()
        key, addresses = _key_and_addresses(launch, args, call.device())
        entry = _entries.get(key)
        if entry is not None:
            _entries.move_to_end(key)
            entry[2](*addresses, *entry[3], stream=call.stream())
            return entry[1]
    compiled = launch.kernel[launch.grid](*args, **dict(launch.constexprs), **dict(launch.options))
    # a kernel that declares launch metadata shows its arguments to the launch hooks: keep tensors there
    if (direct and isinstance(launch.kernel, JITFunction) and not launch.kernel.pre_run_hooks
            and getattr(launch.kernel, "launch_metadata", None) is None
            and _launches_directly(compiled) and all(isinstance(arg, _PLAIN) for arg in args)):
        _remember(key if key is not None else _key(launch, args, (call or Call()).device()), launch, compiled, args)
    return compiled


def _launches_directly(compiled) -> bool:
    return (compiled is not None and not hasattr(compiled, "result")
            and all(hasattr(compiled, name) for name in ("function", "run", "packed_metadata", "launch_metadata")))


def every_argument_after(launch, args: Sequence) -> Optional[Tuple]:
    """The kernel's parameters after its runtime ``args``, as Triton binds them (the launch's
    constexprs, the defaults); None where the signature does not take them so."""
    try:
        signature = getattr(launch.kernel, "signature", None) or inspect.signature(launch.kernel.fn)
        bound = signature.bind(*args, **dict(launch.constexprs))
    except (TypeError, AttributeError, ValueError):
        return None
    bound.apply_defaults()
    return tuple(bound.arguments.values())[len(args):]


def _remember(key: Tuple, launch, compiled, args: Sequence) -> None:
    tail = every_argument_after(launch, args)
    if tail is None:  # not this Triton's calling convention: keep Triton's dispatch
        return
    while len(_entries) >= MAX_ENTRIES:
        _, (dropped, *_) = _entries.popitem(last=False)
        held = _cached_launches[id(dropped)]
        held[1] -= 1
        if not held[1]:
            del _cached_launches[id(dropped)]
    grid = tuple(launch.grid) + (1,) * (3 - len(launch.grid))
    _entries[key] = (launch, compiled, compiled[grid], tail)
    _cached_launches.setdefault(id(launch), [launch, 0])[1] += 1


def clear() -> None:
    """Forget every cached binary: the next launch of each goes through Triton's dispatch."""
    _entries.clear()
    _cached_launches.clear()
