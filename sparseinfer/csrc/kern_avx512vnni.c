/* AVX-512 kernels with VNNI (VPDPBUSD); see kern_avx512_impl.h. */
#include "common.h"
#if SI_X86
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")
#define SI_VNNI 1
#include "kern_avx512_impl.h"

const kernels_t si_kernels_avx512vnni = {"avx512vnni", quantize, dot_q, dot_f, axpy, read_sum, si_act_avx2, 0, &si_attend_avx512, 16,
                                         si_kv_store_avx2, 0, NULL, NULL, cols_group, tiles_q4, tiles_q6, tiles_q4k, quantize_q8k};
#else
typedef int si_empty_translation_unit;
#endif
