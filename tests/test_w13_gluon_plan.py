"""The Gluon W13's shared-memory plan (kernels/w13_gluon.py), checked on index arithmetic (the
interpreter cannot run Gluon; the GPU tests check its bits against the tl kernel): the copies'
row permutation composed with the permuted shared view must hand every lane awq_mma's fragment
rows, and each register's reads must hit 32 distinct banks."""
import inspect

import numpy as np

from moe_grouped_decode.kernels import w13_gluon


def pi(q):  # global chunk row held by shared row q (the copies' chunk_row)
    return (q & 16) | ((q & 3) << 2) | ((q >> 2) & 3)


def shared_rows_seen():
    """[g, t, e] -> shared row read, through the kernel's view: reshape [2, 4, 4, 8], permute
    (3, 2, 0, 1), reshape [8, 4, 8] (Gluon's permute order has numpy's transpose meaning)."""
    rows = np.arange(32)[:, None].repeat(8, 1)
    return rows.reshape(2, 4, 4, 8).transpose(3, 2, 0, 1).reshape(8, 4, 8)


def test_lanes_get_awq_mma_fragment_rows():
    seen = shared_rows_seen()
    for g in range(8):
        for t in range(4):
            for e in range(8):
                assert pi(int(seen[g, t, e])) == 16 * (e // 4) + 4 * t + e % 4


def test_fragment_reads_are_bank_conflict_free():
    seen = shared_rows_seen()
    for e in range(8):
        banks = {(int(seen[g, t, e]) * 8 + g) % 32 for g in range(8) for t in range(4)}
        assert len(banks) == 32


def test_row_permutation_is_a_bijection():
    assert sorted(pi(q) for q in range(32)) == list(range(32))


def test_activation_view_gives_fragment_rows():
    """x_rows.index(c): [32] -> reshape [2, 4, 4], permute (1, 0, 2), reshape [4, 8] is read as
    [t, e]: lane t's element e must be chunk row 16 (e // 4) + 4 t + e % 4, as the words'."""
    seen = np.arange(32).reshape(2, 4, 4).transpose(1, 0, 2).reshape(4, 8)
    for t in range(4):
        for e in range(8):
            assert int(seen[t, e]) == 16 * (e // 4) + 4 * t + e % 4


def test_the_kernel_uses_this_plan():
    """The plan above is what w13_gluon.py's source does (Gluon cannot run here to check it)."""
    source = inspect.getsource(w13_gluon)
    assert "chunk_row = (q & 16) | ((q & 3) << 2) | ((q >> 2) & 3)" in source
    assert ".reshape([2, 4, 4, 8]).permute([3, 2, 0, 1]).reshape([8, 4, 8])" in source
    assert ".reshape([2, 4, 4]).permute([1, 0, 2]).reshape([4, 8])" in source
