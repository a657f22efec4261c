"""The launcher's cache of compiled kernels (kernels/launcher.py), on a real Triton JIT function
whose dispatch is replaced by a recorder: which calls reach Triton's dispatch, which go straight
to the binary, and with which arguments. The GPU tests of the ops run the real thing."""

import os

import pytest
import torch
import triton
import triton.language as tl

from moe_grouped_decode.kernels import launcher
from moe_grouped_decode.kernels.plan import Launch


@triton.jit
def _kernel(x, y, n, flag, BLOCK: tl.constexpr, CHECK: tl.constexpr = False):
    pass


class _Compiled:
    """What Triton's dispatch returns for one specialization: a binary with its runner."""

    function = 0
    packed_metadata = None

    def __init__(self, calls, spec):
        self.calls, self.spec = calls, spec

    def launch_metadata(self, *args):
        return None

    def run(self, *args):
        raise AssertionError("the launcher calls the runner, not run")

    def __getitem__(self, grid):
        def runner(*args, stream=None):
            self.calls.append(("direct", self.spec, grid, args, stream))
        return runner


def _spec(args):
    """Triton's view of the arguments, coarser than the launcher's key."""
    return tuple((a.dtype, a.data_ptr() % 16 == 0) if isinstance(a, torch.Tensor)
                 else ("int1" if a == 1 and type(a) is int else type(a).__name__, a % 16 == 0 if type(a) is int else a)
                 for a in args)


@pytest.fixture
def recorded(monkeypatch):
    """(_kernel's launch, the calls log): each Triton dispatch is logged and returns its binary."""
    calls, binaries = [], {}

    def dispatch(*args, grid, warmup, **kwargs):
        spec = _spec(args)
        calls.append(("triton", spec, grid, args, kwargs))
        return binaries.setdefault(spec, _Compiled(calls, spec))

    monkeypatch.setattr(_kernel, "run", dispatch)
    monkeypatch.setattr(_kernel, "pre_run_hooks", [])
    monkeypatch.setattr(launcher, "_current_device", lambda: 0)
    monkeypatch.setattr(launcher, "_current_stream", lambda device: ("stream of", device))
    monkeypatch.setattr(launcher, "ENABLED", True)
    launcher.clear()
    launch = Launch(name="k", stage="sort", kernel=_kernel, grid=(4, 2), args=("x", "y", "n", "flag"),
                    constexprs=(("BLOCK", 8),), options=(("num_warps", 4),), max_shared_carveout=False)
    yield launch, calls
    launcher.clear()


def _tensors(seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(64, generator=gen).half()
    y = torch.randint(0, 9, (64,), generator=gen, dtype=torch.int32)
    return x, y


def test_second_launch_goes_to_the_binary_with_every_argument(recorded):
    launch, calls = recorded
    x, y = _tensors(0)
    first = launcher.run(launch, [x, y, 17, None])
    assert [c[0] for c in calls] == ["triton"]
    assert calls[0][3] == (x, y, 17, None) and calls[0][4] == {"BLOCK": 8, "num_warps": 4}
    x2, y2 = _tensors(1)
    second = launcher.run(launch, [x2, y2, 17, None])
    assert second is first
    kind, _, grid, args, stream = calls[1]
    # the runtime arguments (each tensor as its address), then the constexprs and defaults in the
    # signature's order; a 3-D grid; the current device's stream
    assert (kind, grid, stream) == ("direct", (4, 2, 1), ("stream of", 0))
    assert args[:2] == (x2.data_ptr(), y2.data_ptr()) and args[2:] == (17, None, 8, False)


def test_the_launches_of_one_call_ask_the_device_and_stream_once(recorded, monkeypatch):
    launch, calls = recorded
    asked = []
    monkeypatch.setattr(launcher, "_current_device", lambda: asked.append("device") or 3)
    monkeypatch.setattr(launcher, "_current_stream", lambda device: asked.append(("stream", device)) or "s")
    x, y = _tensors(12)
    launcher.run(launch, [x, y, 17, None])  # through Triton: the device for the key, no stream
    assert asked == ["device"]
    asked.clear()
    call = launcher.Call()
    for _ in range(3):
        launcher.run(launch, [x, y, 17, None], call)
    assert asked == ["device", ("stream", 3)]
    assert [c[0] for c in calls] == ["triton"] + ["direct"] * 3 and {c[4] for c in calls[1:]} == {"s"}


def test_what_triton_specializes_on_sends_the_launch_back_to_triton(recorded):
    launch, calls = recorded
    x, y = _tensors(2)
    launcher.run(launch, [x, y, 17, None])
    cases = {
        "misaligned tensor": [x[1:], y, 17, None],  # 2 bytes off a 16-byte boundary
        "other dtype": [x.float(), y, 17, None],
        "other int": [x, y, 32, None],
        "int 1": [x, y, 1, None],
        "bool": [x, y, True, None],
        "tensor for None": [x, y, 17, y],
    }
    for name, args in cases.items():
        before = len(calls)
        launcher.run(launch, args)
        assert calls[before][0] == "triton", name
        launcher.run(launch, args)
        assert calls[before + 1][0] == "direct", name
        assert calls[before + 1][1] == calls[before][1], name  # the binary Triton gave those arguments


def test_true_and_1_are_different_keys(recorded):
    launch, calls = recorded
    x, y = _tensors(3)
    launcher.run(launch, [x, y, 1, None])
    launcher.run(launch, [x, y, True, None])
    assert [c[0] for c in calls] == ["triton", "triton"]


def test_another_device_goes_through_triton(recorded, monkeypatch):
    launch, calls = recorded
    x, y = _tensors(4)
    launcher.run(launch, [x, y, 17, None])
    monkeypatch.setattr(launcher, "_current_device", lambda: 1)
    launcher.run(launch, [x, y, 17, None])
    assert [c[0] for c in calls] == ["triton", "triton"]


def test_pre_run_hooks_keep_triton_dispatch(recorded, monkeypatch):
    launch, calls = recorded
    x, y = _tensors(5)
    launcher.run(launch, [x, y, 17, None])
    monkeypatch.setattr(_kernel, "pre_run_hooks", [lambda *a, **k: None])
    launcher.run(launch, [x, y, 17, None])
    launcher.run(launch, [x, y, 17, None])
    assert [c[0] for c in calls] == ["triton", "triton", "triton"]


def test_disabled_never_caches(recorded, monkeypatch):
    launch, calls = recorded
    monkeypatch.setattr(launcher, "ENABLED", False)
    x, y = _tensors(6)
    for _ in range(3):
        launcher.run(launch, [x, y, 17, None])
    assert [c[0] for c in calls] == ["triton"] * 3


@pytest.mark.parametrize("returned", [None, "future"])
def test_no_binary_no_cache(recorded, monkeypatch, returned):
    """The interpreter's dispatch returns None; an asynchronous compile a future."""
    launch, calls = recorded

    class Future:
        def result(self):
            raise AssertionError("not waited on by the launcher")

    def dispatch(*args, grid, warmup, **kwargs):
        calls.append(("triton",))
        return None if returned is None else Future()

    monkeypatch.setattr(_kernel, "run", dispatch)

    def no_cuda(*args):
        raise AssertionError("the interpreter has no CUDA to ask")

    monkeypatch.setattr(launcher, "_current_device", no_cuda)
    monkeypatch.setattr(launcher, "_current_stream", no_cuda)
    x, y = _tensors(7)
    for _ in range(3):
        launcher.run(launch, [x, y, 17, None])
    assert calls == [("triton",)] * 3


def test_a_kernel_with_launch_metadata_keeps_tritons_dispatch(recorded, monkeypatch):
    """Its launch hooks see its arguments, which a direct launch would give as addresses."""
    launch, calls = recorded
    monkeypatch.setattr(_kernel, "launch_metadata", lambda grid, metadata, args: {"name": "k"})
    x, y = _tensors(13)
    for _ in range(3):
        launcher.run(launch, [x, y, 17, None])
    assert [c[0] for c in calls] == ["triton"] * 3 and not launcher._entries


def test_a_host_tensor_is_another_key(recorded):
    """A tensor off the GPU with another tensor's dtype and alignment goes back to Triton's
    dispatch (which refuses it), not to a binary that would read its host address."""
    launch, calls = recorded
    x, y = _tensors(14)
    launcher.run(launch, [x, y, 17, None])
    launcher.run(launch, [x, y, 17, None])
    assert [c[0] for c in calls] == ["triton", "direct"]
    key = launcher._key(launch, [x, y, 17, None], 0)
    assert key[2] == (torch.float16, x.data_ptr() % 16 == 0, False)  # host tensors in this test


def test_the_least_recently_used_entry_goes_first(recorded, monkeypatch):
    launch, calls = recorded
    monkeypatch.setattr(launcher, "MAX_ENTRIES", 3)
    x, y = _tensors(8)
    for n in (16, 32, 48):
        launcher.run(launch, [x, y, n, None])
    launcher.run(launch, [x, y, 16, None])  # used again: 32 is now the least recently used
    assert calls[-1][0] == "direct"
    launcher.run(launch, [x, y, 64, None])  # a fourth entry: 32's goes
    assert calls[-1][0] == "triton"
    for n, kind in ((16, "direct"), (48, "direct"), (64, "direct"), (32, "triton")):
        launcher.run(launch, [x, y, n, None])
        assert calls[-1][0] == kind, n


def test_a_launch_whose_entries_are_all_dropped_is_let_go(recorded, monkeypatch):
    launch, calls = recorded
    other = Launch(name="k2", stage="sort", kernel=_kernel, grid=(1,), args=launch.args,
                   constexprs=(("BLOCK", 16),), options=(("num_warps", 4),), max_shared_carveout=False)
    monkeypatch.setattr(launcher, "MAX_ENTRIES", 2)
    x, y = _tensors(9)
    launcher.run(launch, [x, y, 16, None])
    launcher.run(other, [x, y, 16, None])
    assert set(launcher._cached_launches) == {id(launch), id(other)}
    launcher.run(other, [x, y, 32, None])  # drops launch's only entry
    assert set(launcher._cached_launches) == {id(other)} and launcher._cached_launches[id(other)][1] == 2


def test_arguments_triton_specializes_otherwise_are_not_cached(recorded):
    """A tuple (or a tensor descriptor) is not among the kinds the key describes."""
    launch, calls = recorded
    x, y = _tensors(10)
    for _ in range(3):
        launcher.run(launch, [x, y, 17, (1, 2)])
    assert [c[0] for c in calls] == ["triton"] * 3 and not launcher._entries


def test_a_kernel_that_is_not_a_jit_function_is_not_cached(recorded, monkeypatch):
    """An autotuner or heuristics wrapper picks its binary per call: Triton's dispatch keeps it."""
    launch, calls = recorded

    class Wrapper:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: (calls.append(("triton",)), _Compiled(calls, None))[1]

    wrapped = Launch(name="w", stage="sort", kernel=Wrapper(), grid=(1,), args=launch.args, constexprs=(),
                     options=(), max_shared_carveout=False)
    x, y = _tensors(11)
    for _ in range(3):
        launcher.run(wrapped, [x, y, 17, None])
    assert calls == [("triton",)] * 3 and not launcher._entries


def _plans():
    import dataclasses

    from moe_grouped_decode.kernels import plan
    from moe_grouped_decode.kernels.config import GroupedConfig, PrefillConfig

    grouped = [GroupedConfig(), GroupedConfig(w13_kernel="tl", w2_kernel="gluon", max_shared_carveout=True),
               GroupedConfig(w13_over_groups=True, w2_kernel="gluon"), GroupedConfig(fused_combine=False)]
    prefill = [PrefillConfig(), PrefillConfig(kernel="dot", block_rows=32, w13_block_k=32),
               PrefillConfig(kernel="wgmma", block_rows=64, w13_block_k=64)]
    plans = []
    for config, capability in ((c, cap) for c in grouped for cap in ((9, 0), (8, 0))):
        plans.append(plan.grouped_plan(4, 8, 2560, 192, 32, torch.float16, capability, config.fitted(2560),
                                       num_experts=128, check_ids=True))
    plans += [plan.prefill_plan(300, 8, 128, 2560, 192, 32, torch.float16, (9, 0), c) for c in prefill]
    assert all(dataclasses.is_dataclass(p) for p in plans)
    return plans


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="the interpreter's kernels are never cached")
def test_every_plan_launch_passes_what_tritons_binder_passes():
    """The runtime arguments and ``every_argument_after`` are, for every kernel the plans launch,
    the argument list Triton's own binder gives its compiled kernel's runner."""
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    from moe_grouped_decode.kernels.plan import ARGUMENT_TYPES

    tensor = torch.zeros(64, dtype=torch.float16)
    values = {name: 7 if kind == "i32" else tensor for name, kind in ARGUMENT_TYPES.items()}
    values.update(id_flag=None, w13_stamps=None, w2_stamps=None)
    kernels = set()
    for plan in _plans():
        for launch in plan.launches:
            assert isinstance(launch.kernel, JITFunction), launch.name
            assert launch.kernel.launch_metadata is None, launch.name  # else never launched directly
            args = [values[name] for name in launch.args]
            binder = create_function_from_signature(launch.kernel.signature, launch.kernel.params, CUDABackend)
            bound, _, _ = binder(*args, **dict(launch.constexprs), **dict(launch.options), debug=False,
                                 instrumentation_mode="")
            mine = list(args) + list(launcher.every_argument_after(launch, args))
            theirs = list(bound.values())
            assert len(mine) == len(theirs), launch.name
            for a, b in zip(mine, theirs):
                assert a is b or (type(a) is type(b) and a == b), launch.name
            kernels.add(launch.name)
    assert len(kernels) == 17, kernels  # both routes' kernels, the Gluon ones among them


@pytest.mark.parametrize("value,enabled", [(None, True), ("1", True), ("0", False), ("off", False)])
def test_the_rollback_switch_is_read_once_at_the_first_launch(monkeypatch, value, enabled):
    from moe_grouped_decode import env

    monkeypatch.setattr(launcher, "ENABLED", None)
    if value is None:
        monkeypatch.delenv(env.DIRECT_LAUNCH_ENV, raising=False)
    else:
        monkeypatch.setenv(env.DIRECT_LAUNCH_ENV, value)
    assert launcher.enabled() is enabled
    monkeypatch.setenv(env.DIRECT_LAUNCH_ENV, "1" if not enabled else "0")
    assert launcher.enabled() is enabled  # once read, kept


def test_an_unknown_rollback_value_fails_at_startup_not_at_import(monkeypatch):
    """The package imports (the ops, the CLI); the vLLM plugin's startup check and the first
    launch say what is wrong."""
    import subprocess
    import sys

    from moe_grouped_decode import env
    from moe_grouped_decode.compile_plugin.startup import check_switch

    environ = dict(os.environ, MOE_GROUPED_DECODE_DIRECT_LAUNCH="maybe")
    code = "import moe_grouped_decode.kernels.launcher as l; print(l.ENABLED)"
    result = subprocess.run([sys.executable, "-c", code], env=environ, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "None", result.stderr[-2000:]
    monkeypatch.setenv(env.DIRECT_LAUNCH_ENV, "maybe")
    monkeypatch.setattr(launcher, "ENABLED", None)
    with pytest.raises(ValueError, match="MOE_GROUPED_DECODE_DIRECT_LAUNCH"):
        check_switch("cpu")
    with pytest.raises(ValueError, match="MOE_GROUPED_DECODE_DIRECT_LAUNCH"):
        launcher.enabled()
