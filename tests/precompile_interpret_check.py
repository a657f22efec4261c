"""``tune``'s compile workers on a tiny shape under TRITON_INTERPRET=1, on the CPU.

Launched by test_precompile.py in a subprocess (the variable must be set before triton is
imported, here and in the spawned workers, which inherit it). Two workers run real launches of
one grouped and one prefill candidate, and a job whose launch raises (a prefill config given to
the grouped route). Exits non-zero on the first failure.
"""

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

from moe_grouped_decode.benchmarking.precompile import CompileJob, compile_candidates  # noqa: E402
from moe_grouped_decode.kernels.config import GroupedConfig, PrefillConfig  # noqa: E402

SHAPE = (8, 2, 64, 64, 32)


def main() -> int:
    jobs = [
        CompileJob("grouped", GroupedConfig(w13_kernel="tl", w2_kernel="tl", w13_block_k=32), (1, 3)),
        CompileJob("prefill", PrefillConfig(), (1, 5)),
        CompileJob("grouped", PrefillConfig(), (5,)),  # raises in the worker: recorded, not raised
    ]
    lines = []
    results = compile_candidates(SHAPE, "fp16", jobs, workers=2, timeout_s=600, log=lines.append, max_grouped=3)
    assert [r.job for r in results] == jobs, results  # every job's result, in the jobs' order
    assert results[0].error is None and results[1].error is None, results
    assert results[2].error.startswith("AttributeError"), results
    assert lines[-1].startswith("[tune] ran 3 of 3 candidates in 2 processes in ") and \
        lines[-1].endswith("(1 did not run at this shape)"), lines
    print("precompile interpreter check passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
