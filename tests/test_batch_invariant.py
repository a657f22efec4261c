"""Batch-invariant mode (MOE_GROUPED_DECODE_BATCH_INVARIANT, or vLLM's VLLM_BATCH_INVARIANT):
one route at every token count, one launch config, and on CPU one matmul shape, so a token's
output bits depend on nothing else in the call. The GPU half is in tests/test_cuda_prefill.py."""

from __future__ import annotations

import pytest
import torch

from moe_grouped_decode import env
from moe_grouped_decode.awq import AwqMoeWeights, synthetic_moe_weights
from moe_grouped_decode.contract import QWEN38_TP4, LayerShape, admits
from moe_grouped_decode.kernels.config import BATCH_INVARIANT_PREFILL
from moe_grouped_decode.ops import prefill_plan_for

SWITCHES = (env.BATCH_INVARIANT_ENV, env.VLLM_BATCH_INVARIANT_ENV)


@pytest.fixture
def clean_env(monkeypatch):
    for name in SWITCHES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.mark.parametrize("plugin,vllm,want", [
    (None, None, False), ("1", None, True), ("0", None, False), (None, "1", True), (None, "0", False),
    ("0", "1", False),  # the plugin's own switch wins
    ("1", "0", True), (None, "2", True),  # vLLM reads any nonzero integer as on
])
def test_switch(clean_env, plugin, vllm, want):
    for name, value in zip(SWITCHES, (plugin, vllm)):
        if value is not None:
            clean_env.setenv(name, value)
    assert env.batch_invariant() is want


def test_bad_switch_value_is_an_error(clean_env):
    clean_env.setenv(env.BATCH_INVARIANT_ENV, "maybe")
    with pytest.raises(ValueError, match="MOE_GROUPED_DECODE_BATCH_INVARIANT='maybe'"):
        env.batch_invariant()


def test_mode_admits_the_layer_but_no_grouped_token_count(clean_env):
    shape = LayerShape(*QWEN38_TP4.shape, torch.float16)
    assert admits(shape, QWEN38_TP4.min_tokens)  # the grouped route serves its window normally
    clean_env.setenv(env.BATCH_INVARIANT_ENV, "1")
    assert admits(shape)  # still the plugin's layer ...
    for M in (1, QWEN38_TP4.max_tokens, (1, 8)):
        decision = admits(shape, M)
        assert not decision and "batch-invariant" in decision.reason  # ... on the prefill route


def _meta_layer(M: int):
    E, k, K, N, G = QWEN38_TP4.shape
    meta = dict(device="meta")
    weights = AwqMoeWeights(torch.empty(E, K, 2 * N // 8, dtype=torch.int32, **meta),
                            torch.empty(E, K // G, 2 * N, dtype=torch.float16, **meta),
                            torch.empty(E, K // G, 2 * N // 8, dtype=torch.int32, **meta),
                            torch.empty(E, N, K // 8, dtype=torch.int32, **meta),
                            torch.empty(E, N // G, K, dtype=torch.float16, **meta),
                            torch.empty(E, N // G, K // 8, dtype=torch.int32, **meta), G)
    return torch.empty(M, K, dtype=torch.float16, **meta), torch.empty(M, k, dtype=torch.int32, **meta), weights


TOKENS = (1, 64, 1024, 1025, 4096, 8192)


def test_mode_runs_one_prefill_config_at_every_token_count(clean_env):
    configs = {M: prefill_plan_for(*_meta_layer(M)).config for M in TOKENS}
    assert len(set(configs.values())) > 1, "the table should vary with M, or this test shows nothing"
    clean_env.setenv(env.BATCH_INVARIANT_ENV, "1")
    plans = [prefill_plan_for(*_meta_layer(M)) for M in TOKENS]
    assert {p.config for p in plans} == {BATCH_INVARIANT_PREFILL}
    # and the GEMMs' binaries are the same ones (same kernels, same constexprs and options)
    gemms = {tuple((l.kernel, l.constexprs, l.options) for l in p.launches if l.stage in ("w13", "w2")) for p in plans}
    assert len(gemms) == 1


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_cpu_dense_op_gives_each_token_the_same_bits(clean_env, dtype):
    """The real K and N (the CPU GEMM's kernel choice, and so its summation order, follows the
    row count; at the real sizes it shows): a token's bits alone, in a prefix, and shuffled."""
    clean_env.setenv(env.BATCH_INVARIANT_ENV, "1")
    E, k, K, N, G = 16, 10, QWEN38_TP4.hidden_size, QWEN38_TP4.intermediate_size, QWEN38_TP4.group_size
    weights = synthetic_moe_weights(E, K, N, G, dtype=dtype, seed=3)
    gen = torch.Generator().manual_seed(5)
    M = 48
    x = torch.randn(M, K, generator=gen).to(dtype)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(M)]).to(torch.int32)
    tw = torch.rand(M, k, generator=gen)
    op = torch.ops.moe_grouped_decode.awq_moe_dense
    full = op(x, tw, ids, *weights.op_args()).view(torch.int16)
    for m in (1, 2, 5, 17):
        assert torch.equal(op(x[:m], tw[:m], ids[:m], *weights.op_args()).view(torch.int16), full[:m]), m
    perm = torch.randperm(M, generator=gen)
    assert torch.equal(op(x[perm], tw[perm], ids[perm], *weights.op_args()).view(torch.int16), full[perm])


def test_compile_cache_key_follows_the_mode(clean_env):
    """A graph compiled without the mode (grouped ops in it) must not be replayed with it."""
    from moe_grouped_decode.contract import contracts_fingerprint

    off = contracts_fingerprint()
    clean_env.setenv(env.BATCH_INVARIANT_ENV, "1")
    assert contracts_fingerprint() != off


def test_routed_op_takes_the_prefill_route_in_the_mode(clean_env):
    """awq_moe_routed (in graphs compiled before the mode was on) asks the mode at run time: inside
    its grouped window it runs the dense op, not the grouped one. Which op ran shows in the
    workspace, which only the grouped op writes (the two routes' bits may agree on a given CPU,
    whose GEMMs pick their summation order), and in the result, which must be the dense op's."""
    from moe_grouped_decode.ops import alloc_workspace

    E, k, K, N, G = 16, 10, QWEN38_TP4.hidden_size, QWEN38_TP4.intermediate_size, QWEN38_TP4.group_size
    weights = synthetic_moe_weights(E, K, N, G, dtype=torch.float16, seed=4)
    gen = torch.Generator().manual_seed(6)
    M = 24
    x = torch.randn(M, K, generator=gen).half()
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(M)]).to(torch.int32)
    tw = torch.rand(M, k, generator=gen)
    workspace = alloc_workspace(M, k, K, N, "cpu")
    ops = torch.ops.moe_grouped_decode
    poison = torch.iinfo(torch.int32).min + 7

    def routed_call():
        workspace.fill_(poison)
        out = ops.awq_moe_routed(x, tw, ids, *weights.op_args(), workspace, 1, M).view(torch.int16)
        return out, bool((workspace != poison).any())

    grouped_out, grouped_wrote = routed_call()  # the mode off: the grouped route, which writes its scratch
    assert grouped_wrote, "the grouped route must write the workspace, or this test shows nothing"
    assert torch.equal(grouped_out, ops.awq_moe_grouped_decode(x, tw, ids, *weights.op_args(), workspace).view(torch.int16))
    clean_env.setenv(env.BATCH_INVARIANT_ENV, "1")
    dense = ops.awq_moe_dense(x, tw, ids, *weights.op_args()).view(torch.int16)
    routed, wrote = routed_call()
    assert not wrote  # no grouped op ran
    assert torch.equal(routed, dense)
