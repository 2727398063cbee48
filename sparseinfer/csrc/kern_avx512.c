/* AVX-512 kernels without VNNI (VPMADDUBSW + VPMADDWD); see kern_avx512_impl.h. */
#include "common.h"
#if SI_X86
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#define SI_VNNI 0
#include "kern_avx512_impl.h"

const kernels_t si_kernels_avx512 = {"avx512", quantize, dot_q, dot_f, axpy, read_sum, si_act_avx2};
#else
typedef int si_empty_translation_unit;
#endif
