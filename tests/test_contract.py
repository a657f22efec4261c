"""Shape contracts: the one admission function at every boundary."""

import dataclasses
import os
import subprocess
import sys

import pytest
import torch

from moe_grouped_decode import tables
from moe_grouped_decode.contract import (
    QWEN38_TP4,
    LayerShape,
    ShapeContract,
    admits,
    admitted_window,
    apply_tables,
    contract_registered,
    contracts_fingerprint,
    register_contract,
    registered_contracts,
)

QWEN = LayerShape(num_experts=512, top_k=10, hidden_size=2560, intermediate_size=160, group_size=32, dtype=torch.float16)
LO, HI = QWEN38_TP4.min_tokens, QWEN38_TP4.max_tokens  # the measured route table's grouped window


def test_qwen38_tp4_preset():
    c = QWEN38_TP4
    assert (c.num_experts, c.top_k, c.hidden_size, c.intermediate_size, c.group_size) == (512, 10, 2560, 160, 32)
    preferred = tables.find_table(tables.PREFERRED_GPUS[0], c.shape, "fp16")
    assert (c.min_tokens, c.max_tokens) == preferred.routes.grouped_tokens  # from the preferred GPU's table
    assert c.dtypes == (torch.float16, torch.bfloat16) and c.measured
    assert c.max_rows == 10 * c.max_tokens
    assert QWEN38_TP4 in registered_contracts()


def test_every_shipped_table_gives_its_gpu_a_window_from_its_own_data():
    for table in tables.shipped_tables():
        lo, hi = table.routes.grouped_tokens
        grouped = [m for m, route in zip(table.routes.tokens, table.routes.routes) if route == "grouped"]
        assert lo == 1 and grouped == [m for m in table.routes.tokens if m <= hi], table.path
        try:
            apply_tables(table.gpu)
            shape = LayerShape(*table.shape, {"fp16": torch.float16, "bf16": torch.bfloat16}[table.dtype])
            assert admits(shape, hi) and not admits(shape, hi + 1)
        finally:
            apply_tables(None)


def _contract_window_in_a_fresh_process(window):
    env = {k: v for k, v in os.environ.items() if k != "MOE_GROUPED_DECODE_WINDOW"}
    if window is not None:
        env["MOE_GROUPED_DECODE_WINDOW"] = window
    code = "from moe_grouped_decode.contract import QWEN38_TP4 as c; print(c.min_tokens, c.max_tokens)"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)


def test_the_seed_window_is_a_setting():
    """MOE_GROUPED_DECODE_WINDOW=2..8 gives back the seeds' window (read when the contracts are
    built, at import); a malformed value fails naming the variable."""
    assert _contract_window_in_a_fresh_process("2..8").stdout.split() == ["2", "8"]
    assert _contract_window_in_a_fresh_process(None).stdout.split() == [str(LO), str(HI)]
    bad = _contract_window_in_a_fresh_process("8..2")
    assert bad.returncode != 0 and "MOE_GROUPED_DECODE_WINDOW='8..2'" in bad.stderr


@pytest.mark.parametrize(
    "tokens,admitted",
    [
        (0, False),  # empty step
        (LO - 1, False),  # just below the window (no count when it starts at 1)
        (LO, True),  # bottom of the window
        (HI, True),  # top of the window
        (HI + 1, False),  # just past it: the prefill route
        (4 * HI, False),  # prefill-sized
    ],
)
def test_token_window_boundaries(tokens, admitted):
    result = admits(QWEN, tokens)
    assert bool(result) is admitted
    if admitted:
        assert result.contract is QWEN38_TP4
    else:
        assert f"outside window {LO}..{HI}" in result.reason


@pytest.mark.parametrize(
    "field,value,letter",
    [
        ("num_experts", 256, "E=256"),
        ("top_k", 8, "k=8"),
        ("hidden_size", 2592, "K=2592"),
        ("intermediate_size", 384, "N=384"),
        ("group_size", 128, "G=128"),
        ("dtype", torch.float32, "dtype=torch.float32"),
    ],
)
def test_every_shape_mismatch_is_rejected_with_reason(field, value, letter):
    shape = dataclasses.replace(QWEN, **{field: value})
    for tokens in (None, 4):
        result = admits(shape, tokens)
        assert not result
        assert letter in result.reason


def test_bf16_admitted():
    assert admits(dataclasses.replace(QWEN, dtype=torch.bfloat16), 4)


def test_shape_only_question():
    assert admits(QWEN).contract is QWEN38_TP4


@pytest.mark.parametrize(
    "token_range,admitted",
    [
        ((LO, HI), True),  # exactly the window: a compile range of its own
        ((HI, HI), True),
        ((LO, HI + 1), False),
        ((1, 8192), False),  # vLLM's default whole range
    ],
)
def test_symbolic_ranges_must_lie_inside_the_window(token_range, admitted):
    assert bool(admits(QWEN, token_range)) is admitted


def test_bad_range_raises():
    with pytest.raises(ValueError, match="lo <= hi"):
        admits(QWEN, (8, 2))


def test_registry_add_remove_and_fingerprint():
    small = ShapeContract("test-small", num_experts=8, top_k=2, hidden_size=64, intermediate_size=32, group_size=32, min_tokens=1, max_tokens=4)
    before = contracts_fingerprint()
    shape = LayerShape(8, 2, 64, 32, 32, torch.bfloat16)
    assert not admits(shape, 2)
    with contract_registered(small):
        assert admits(shape, 2).contract is small
        assert contracts_fingerprint() != before
        register_contract(small)  # re-registering the same contract is a no-op
        with pytest.raises(ValueError, match="already registered"):
            register_contract(dataclasses.replace(small, max_tokens=5))
    assert not admits(shape, 2)
    assert contracts_fingerprint() == before


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(min_tokens=0, max_tokens=4), "token window"),
        (dict(min_tokens=5, max_tokens=4), "token window"),
        (dict(hidden_size=48), "multiple of group_size"),  # 48 % 32
        (dict(intermediate_size=36, group_size=4), "multiple of group_size=4 and of 8"),  # 36 % 8
        (dict(hidden_size=80, intermediate_size=48, group_size=16), "must be multiples of 32"),  # the kernels' chunks
    ],
)
def test_invalid_contracts_raise(kwargs, match):
    base = dict(name="bad", num_experts=8, top_k=2, hidden_size=64, intermediate_size=32, group_size=32, min_tokens=1, max_tokens=4)
    with pytest.raises(ValueError, match=match):
        ShapeContract(**{**base, **kwargs})


def test_layer_shape_from_tensors():
    x = torch.empty(3, 2560, dtype=torch.bfloat16)
    ids = torch.empty(3, 10, dtype=torch.int64)
    w13 = torch.empty(512, 2560, 40, dtype=torch.int32)
    w2 = torch.empty(512, 160, 320, dtype=torch.int32)
    assert LayerShape.from_tensors(x, ids, w13, w2, 32) == dataclasses.replace(QWEN, dtype=torch.bfloat16)


@pytest.mark.parametrize(
    "token_range,window",
    [
        ((1, 8192), (LO, HI)),  # vLLM's whole range: the grouped route runs inside the window only
        ((HI - 1, HI + 20), (HI - 1, HI)),  # a range reaching above it
        ((LO, LO + 1), (LO, LO + 1)),  # a range inside it is its own window
        ((HI + 1, 8192), None),  # past the window: the prefill route only
    ],
)
def test_admitted_window(token_range, window):
    assert admitted_window(QWEN, token_range) == window


def test_admitted_window_needs_a_matching_shape():
    assert admitted_window(dataclasses.replace(QWEN, top_k=8), (1, 8192)) is None


def _table(gpu, grouped_tokens, shape=QWEN38_TP4.shape, dtype="fp16", name="qwen3.8-tp4", speedup=1.5):
    tokens = (1, 2, 16, 17, 16384)
    plugin = tuple(float(m) for m in tokens)
    return tables.MeasuredTable(
        gpu=gpu, shape=shape, dtype=dtype, name=name, generator="test", versions={},
        routes=tables.RouteTable(tokens=tokens, routes=tuple("grouped" if m <= grouped_tokens[1] else "prefill"
                                                             for m in tokens),
                                 plugin_us=plugin, vllm_us={"marlin": tuple(us * speedup for us in plugin),
                                                            "humming": tuple(us * 2 * speedup for us in plugin)},
                                 grouped_tokens=grouped_tokens))


def test_a_gpu_with_its_own_table_gets_its_window():
    """apply_tables (the vLLM plugin calls it with the GPU's name) re-registers the measured
    contracts with that GPU's windows; the preferred GPU's windows are restored after."""
    with tables.table_registered(_table("NVIDIA B200", (1, 16))), \
            tables.table_registered(_table("NVIDIA B200", (1, 16), dtype="bf16")):
        try:
            apply_tables("NVIDIA B200")
            assert admits(QWEN, 16) and not admits(QWEN, 17)
            assert "outside window 1..16" in admits(QWEN, 17).reason
        finally:
            apply_tables(None)
    assert admits(QWEN, HI).contract == QWEN38_TP4


def test_dtypes_with_different_windows_get_a_contract_each():
    with tables.table_registered(_table("NVIDIA B200", (1, 16))), \
            tables.table_registered(_table("NVIDIA B200", (1, 2), dtype="bf16")):
        try:
            apply_tables("NVIDIA B200")
            fp16 = admits(QWEN).contract
            bf16 = admits(dataclasses.replace(QWEN, dtype=torch.bfloat16)).contract
            assert (fp16.name, fp16.max_tokens, fp16.dtypes) == ("qwen3.8-tp4-fp16", 16, (torch.float16,))
            assert (bf16.name, bf16.max_tokens, bf16.dtypes) == ("qwen3.8-tp4-bf16", 2, (torch.bfloat16,))
        finally:
            apply_tables(None)
    assert admits(QWEN).contract == QWEN38_TP4
