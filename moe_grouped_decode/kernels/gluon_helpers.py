"""What the Gluon kernels (``w13_gluon.py``, ``w2_gluon.py``, ``prefill_wgmma.py``) share: whether Gluon is here, the
clock and SM reads of the timeline's stamps, and programmatic dependent launch.

``AVAILABLE`` is False on a Triton without ``triton.experimental.gluon``: then nothing below is
defined and the ``tl`` kernels serve every config (``plan.gluon_runs``).
"""

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy  # noqa: F401  (re-exported)

    AVAILABLE = True
except ImportError:
    AVAILABLE = False

from .timeline import GLOBALTIMER_PTX, SMID_PTX

if AVAILABLE:

    @gluon.jit
    def now():
        """timeline.now, in Gluon: %globaltimer as an int64 scalar."""
        return gl.inline_asm_elementwise(GLOBALTIMER_PTX, "=l", [], dtype=gl.int64, is_pure=False, pack=1)

    @gluon.jit
    def sm_id():
        """timeline.sm_id, in Gluon: the SM this program runs on."""
        return gl.inline_asm_elementwise(SMID_PTX, "=r", [], dtype=gl.int32, is_pure=True, pack=1).to(gl.int64)

    @gluon.jit
    def let_next_launch_start(USE_PDL: gl.constexpr):
        """pdl.let_next_launch_start, in Gluon."""
        if USE_PDL:
            gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32,
                                      is_pure=False, pack=1)

    @gluon.jit
    def wait_for_previous_launch(USE_PDL: gl.constexpr):
        """pdl.wait_for_previous_launch, in Gluon: the previous launch's writes are visible past here."""
        if USE_PDL:
            gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
