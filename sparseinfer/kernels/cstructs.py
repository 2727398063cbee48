"""ctypes mirrors of the C core's structs (`csrc/common.h` qmat_t, `csrc/ops.h` decode plans).

A weight reaches C as the address of a `QMat`, a decode step as the address of its plan; the C
side completes and checks each one (`si_qmat_init`, `check_*_plan`) before it reads anything
through it.  Field order and types follow the C declarations exactly; `check_layout` compares
the sizes and offsets with what the compiled extension reports, so a change on one side that
is not made on the other fails at import instead of reading wrong memory.
"""
from __future__ import annotations

import ctypes as C

_i32, _i64, _f32, _f64, _p = C.c_int32, C.c_int64, C.c_float, C.c_double, C.c_void_p


class QMat(C.Structure):
    """One weight: format, shape, data pointers; row strides (0 = natural) in `row_bytes` / `ds`.
    C recomputes the derived fields (kp, nb, nd) and checks the strides."""

    _fields_ = [("fmt", C.c_int), ("rows", _i64), ("cols", _i64), ("kp", _i64), ("nb", _i64),
                ("row_bytes", _i64), ("nd", _i64), ("ds", _i64), ("qs", _p), ("d", _p), ("m", _p)]


NO_WEIGHT = QMat(fmt=-1)


class AttnPlan(C.Structure):
    """One attention half-block (`si_attn_plan_t`): x + o(attend(rope(qkv(rms_norm(x)))))."""

    _fields_ = [("n", _i64), ("H", _i64), ("Hk", _i64), ("D", _i64), ("n_rot", _i64), ("kv_type", _i64),
                ("eps", _f32), ("scale", _f32), ("norm_w", _p),
                ("q", QMat), ("k", QMat), ("v", QMat), ("o", QMat),
                ("bq", _p), ("bk", _p), ("bv", _p), ("bo", _p)]


class FFNStats(C.Structure):
    """What the sparse FFN step did, summed over tokens (`si_ffn_stats_t`)."""

    _fields_ = [("tokens", _i64), ("fused_rows", _i64), ("first_rows", _i64), ("gate_up_passes", _i64),
                ("dense_ups", _i64), ("up_rows", _i64), ("dense_downs", _i64), ("down_rows", _i64),
                ("kept", _i64), ("predictions", _i64), ("predictor_seconds", _f64)]


FFN_DENSE, FFN_SPARSE = 0, 1
FFN_FUSED, FFN_GATE_UP, FFN_RECORDS = 1, 2, 4


class FFNPlan(C.Structure):
    """One FFN, dense or activation-sparse (`si_ffn_plan_t`); with `norm_w` the half-block
    x + ffn(rms_norm(x)), without it ffn(x)."""

    _fields_ = [("kind", _i32), ("act", _i32), ("relu_up", _i32), ("flags", _i32),
                ("n", _i64), ("F", _i64), ("eps", _f32), ("threshold", _f32), ("crossover", _f32),
                ("up_crossover", _f32), ("topk", _i64), ("norm_w", _p),
                ("first", QMat), ("second", QMat), ("gate_up", QMat), ("down", QMat), ("down_t", QMat),
                ("w1", QMat), ("w2t", QMat),
                ("first_bias", _p), ("second_bias", _p), ("down_bias", _p), ("b1", _p), ("cut", _p),
                ("order", _p), ("records", _p), ("stats", FFNStats)]


_MIRRORS = {"qmat": QMat, "attn": AttnPlan, "ffn": FFNPlan, "stats": FFNStats}


def check_layout(cpu_module) -> None:
    """Raise if a mirror's size or a field offset differs from the compiled struct's."""
    for name, (size, offsets) in cpu_module.plan_layout().items():
        cls = _MIRRORS[name]
        got = {f: getattr(cls, f).offset for f in offsets}
        if C.sizeof(cls) != size or got != offsets:
            raise ImportError(f"sparseinfer._cpu was built from other struct definitions than "
                              f"sparseinfer/kernels/cstructs.py ({name}: size {C.sizeof(cls)} vs {size}, "
                              f"offsets {got} vs {offsets}); rebuild it with `pip install -e .`")
