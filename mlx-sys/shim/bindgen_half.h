// For bindgen only: 16-bit stand-ins with the layout of MLX's half types. The Rust side
// gets float16_t/bfloat16_t from src/lib.rs in the shape mlx-rs expects.
#pragma once
typedef unsigned short float16_t;
typedef unsigned short bfloat16_t;
