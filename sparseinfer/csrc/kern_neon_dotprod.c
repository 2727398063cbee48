/* The `neon_dotprod` kernel level: NEON with SDOT (Armv8.2 dotprod: Apple M, Graviton 2 and
 * later, Cortex-A76 and later), chosen at run time where the CPU has it (see kern_neon_impl.h).
 * Only this file is compiled for the feature, so the library still runs on any AArch64 CPU. */
#include "common.h"
#if SI_ARM
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("dotprod"))), apply_to = function)
#else
#pragma GCC target("arch=armv8.2-a+dotprod")
#endif
#define SI_DOTPROD 1
#include "kern_neon_impl.h"
#if defined(__clang__)
#pragma clang attribute pop
#endif
#endif
