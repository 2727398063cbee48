/* The `neon` kernel level: AArch64 NEON, every AArch64 CPU (see kern_neon_impl.h). */
#include "common.h"
#if SI_ARM
#define SI_DOTPROD 0
#include "kern_neon_impl.h"
#endif
