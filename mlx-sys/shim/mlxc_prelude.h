// Force-included into every mlx-c translation unit on non-ARM hosts.
// mlx-c's half.h only declares float16_t/bfloat16_t (and the functions using them)
// on ARM; MLX itself has portable half types, so we hand those to mlx-c.
#pragma once
#include "format_compat.h"
#ifdef __cplusplus
#include <mlx/types/half_types.h>
#define HAS_FLOAT16
#define HAS_BFLOAT16
typedef mlx::core::float16_t float16_t;
typedef mlx::core::bfloat16_t bfloat16_t;
#endif
