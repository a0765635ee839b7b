// Softmax over the last axis and silu(gate) * up for MLX's CPU backend, in f32, with an
// exponential the compiler vectorizes.
//
// MLX's CPU kernels compute exp one element at a time where they are built without
// vector types for the CPU (its x86 wheels), and each element's polynomial then calls
// libm for its fused multiply-adds and its floor, which made the softmax of attention
// and the SiLU of the MLP cost more than the products around them (docs/benchmarks.md,
// "Where a CPU step's time goes"). These two kernels are MLX primitives of their own, so
// they sit in the same lazy graphs as every other op, gradients included.
//
// Results depend on a row's values alone: no fused multiply-adds (the file is built
// with -ffp-contract=off, so a vector loop and its scalar tail round alike), and each
// row's sum runs in sixteen fixed lanes by index. A row padded with masked keys (whose
// exponentials are exactly 0) therefore sums as the same row without them, which keeps
// a verify's queries equal to one-token decoding, bit for bit.

#include <cstdint>
#include <cstring>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"

#include "mlx/c/private/array.h"
#include "mlx/c/private/stream.h"

namespace dspec {

using mlx::core::array;
using mlx::core::Stream;

// One build per vector width on x86-64 Linux, picked when the library loads; elsewhere
// the compiler's default target (NEON on arm64 vectorizes these loops as they are).
#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && !defined(__clang__)
#define DSPEC_VECTOR_CLONES \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define DSPEC_VECTOR_CLONES
#endif

constexpr int kLanes = 16;

// e^x for x in f32: x = n ln2 + r with n an integer and |r| <= ln2/2, e^r by its Taylor
// series to r^7 (the remainder is below a tenth of an ulp there), 2^n from the bits.
// Below -87.3 it is 0 (subnormals skipped), above 88.7 infinity; NaN stays NaN.
static inline float exp_f32(float x) {
  const float clamped = x < -87.3f ? -87.3f : (x > 88.7f ? 88.7f : x);
  const float t = clamped * 1.44269504088896341f;
  // Adding and taking back 1.5 * 2^23 rounds to the nearest integer.
  const float n = (t + 12582912.0f) - 12582912.0f;
  // ln 2 in two parts: n times the first is exact, so r keeps its low bits.
  float r = clamped - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  float e = p * scale;
  e = x < -87.3f ? 0.0f : e;
  e = x > 88.7f ? __builtin_inff() : e;
  return x != x ? x : e;
}

DSPEC_VECTOR_CLONES
static void softmax_rows(const float* in, float* out, int64_t rows, int64_t width) {
  for (int64_t row = 0; row < rows; ++row, in += width, out += width) {
    float lane_max[kLanes];
    for (int j = 0; j < kLanes; ++j) {
      lane_max[j] = -__builtin_inff();
    }
    int64_t i = 0;
    for (; i + kLanes <= width; i += kLanes) {
      for (int j = 0; j < kLanes; ++j) {
        lane_max[j] = in[i + j] > lane_max[j] ? in[i + j] : lane_max[j];
      }
    }
    for (int j = 0; i + j < width; ++j) {
      lane_max[j] = in[i + j] > lane_max[j] ? in[i + j] : lane_max[j];
    }
    float top = lane_max[0];
    for (int j = 1; j < kLanes; ++j) {
      top = lane_max[j] > top ? lane_max[j] : top;
    }
    for (int64_t k = 0; k < width; ++k) {
      out[k] = exp_f32(in[k] - top);
    }
    float lane_sum[kLanes] = {};
    i = 0;
    for (; i + kLanes <= width; i += kLanes) {
      for (int j = 0; j < kLanes; ++j) {
        lane_sum[j] += out[i + j];
      }
    }
    for (int j = 0; i + j < width; ++j) {
      lane_sum[j] += out[i + j];
    }
    // A fixed tree over the lanes.
    for (int half = kLanes / 2; half > 0; half /= 2) {
      for (int j = 0; j < half; ++j) {
        lane_sum[j] += lane_sum[j + half];
      }
    }
    const float inverse = 1.0f / lane_sum[0];
    for (int64_t k = 0; k < width; ++k) {
      out[k] *= inverse;
    }
  }
}

DSPEC_VECTOR_CLONES
static void silu_product(const float* gate, const float* up, float* out, int64_t n) {
  for (int64_t k = 0; k < n; ++k) {
    const float sigmoid = 1.0f / (1.0f + exp_f32(-gate[k]));
    out[k] = gate[k] * sigmoid * up[k];
  }
}

static void need_f32(const array& a, const char* op) {
  if (a.dtype() != mlx::core::float32) {
    std::ostringstream msg;
    msg << "[" << op << "] takes float32 arrays";
    throw std::invalid_argument(msg.str());
  }
}

// An f32 primitive that runs on the CPU only, its output shaped as its first input;
// `Op` gives its name, the task that computes it, and its gradients.
template <typename Op>
class CpuF32 : public mlx::core::UnaryPrimitive {
 public:
  explicit CpuF32(Stream stream) : UnaryPrimitive(stream) {}

  void eval_cpu(const std::vector<array>& inputs, array& out) override {
    out.set_data(mlx::core::allocator::malloc(out.nbytes()));
    auto& encoder = mlx::core::cpu::get_command_encoder(stream());
    for (const array& in : inputs) {
      encoder.set_input_array(in);
    }
    encoder.set_output_array(out);
    encoder.dispatch(Op::task(inputs, out));
  }

  void eval_gpu(const std::vector<array>&, array&) override {
    std::ostringstream msg;
    msg << "[" << name() << "] runs on the CPU only";
    throw std::runtime_error(msg.str());
  }

  std::vector<array> vjp(
      const std::vector<array>& primals,
      const std::vector<array>& cotangents,
      const std::vector<int>& argnums,
      const std::vector<array>& outputs) override {
    return Op::vjp(primals, cotangents[0], argnums, outputs[0], stream());
  }

  const char* name() const override {
    return Op::name;
  }

  bool is_equivalent(const mlx::core::Primitive& other) const override {
    return dynamic_cast<const CpuF32*>(&other) != nullptr;
  }

  std::vector<mlx::core::Shape> output_shapes(const std::vector<array>& inputs) override {
    return {inputs[0].shape()};
  }
};

struct Softmax {
  static constexpr const char* name = "DspecSoftmaxF32";

  static auto task(const std::vector<array>& inputs, array& out) {
    const array& in = inputs[0];
    const int64_t width = in.ndim() == 0 ? 1 : in.shape().back();
    const int64_t rows = width == 0 ? 0 : static_cast<int64_t>(in.size()) / width;
    return [src = in.data<float>(), dst = out.data<float>(), rows, width]() {
      softmax_rows(src, dst, rows, width);
    };
  }

  // y · (g − Σ g·y) over the last axis.
  static std::vector<array> vjp(
      const std::vector<array>&,
      const array& cotangent,
      const std::vector<int>&,
      const array& y,
      Stream s) {
    namespace mx = mlx::core;
    auto dot = mx::sum(mx::multiply(cotangent, y, s), -1, true, s);
    return {mx::multiply(y, mx::subtract(cotangent, dot, s), s)};
  }
};

struct SiluProduct {
  static constexpr const char* name = "DspecSiluProductF32";

  static auto task(const std::vector<array>& inputs, array& out) {
    return [g = inputs[0].data<float>(),
            u = inputs[1].data<float>(),
            dst = out.data<float>(),
            n = static_cast<int64_t>(out.size())]() { silu_product(g, u, dst, n); };
  }

  static std::vector<array> vjp(
      const std::vector<array>& primals,
      const array& cotangent,
      const std::vector<int>& argnums,
      const array&,
      Stream s) {
    namespace mx = mlx::core;
    const array& gate = primals[0];
    const array& up = primals[1];
    auto sig = mx::sigmoid(gate, s);
    std::vector<array> grads;
    for (int arg : argnums) {
      if (arg == 0) {
        // d/dg g·σ(g) = σ(g)·(1 + g·(1 − σ(g)))
        auto one = mx::array(1.0f, gate.dtype());
        auto slope = mx::multiply(
            sig, mx::add(one, mx::multiply(gate, mx::subtract(one, sig, s), s), s), s);
        grads.push_back(mx::multiply(mx::multiply(cotangent, up, s), slope, s));
      } else {
        grads.push_back(mx::multiply(cotangent, mx::multiply(gate, sig, s), s));
      }
    }
    return grads;
  }
};

// Builds `Op` over `inputs` (f32, one shape) into `res`. Errors go back as text in
// `error` (at most `error_len` bytes with the NUL), so the caller need not share mlx-c's
// error handler.
template <typename Op>
static int build(
    mlx_array* res,
    std::vector<mlx_array> inputs,
    const mlx_stream stream,
    char* error,
    size_t error_len) {
  try {
    auto s = mlx_stream_get_(stream);
    std::vector<array> contiguous;
    for (mlx_array input : inputs) {
      const array& a = mlx_array_get_(input);
      need_f32(a, Op::name);
      if (!contiguous.empty() && a.shape() != contiguous[0].shape()) {
        throw std::invalid_argument(std::string("[") + Op::name + "] inputs differ in shape");
      }
      contiguous.push_back(mlx::core::contiguous(a, false, s));
    }
    auto shape = contiguous[0].shape();
    mlx_array_set_(
        *res,
        array(
            std::move(shape),
            mlx::core::float32,
            std::make_shared<CpuF32<Op>>(s),
            std::move(contiguous)));
    return 0;
  } catch (const std::exception& e) {
    if (error != nullptr && error_len > 0) {
      std::strncpy(error, e.what(), error_len - 1);
      error[error_len - 1] = '\0';
    }
    return 1;
  }
}

} // namespace dspec

extern "C" int dspec_softmax_f32(
    mlx_array* res,
    const mlx_array x,
    const mlx_stream stream,
    char* error,
    size_t error_len) {
  return dspec::build<dspec::Softmax>(res, {x}, stream, error, error_len);
}

extern "C" int dspec_silu_product_f32(
    mlx_array* res,
    const mlx_array gate,
    const mlx_array up,
    const mlx_stream stream,
    char* error,
    size_t error_len) {
  return dspec::build<dspec::SiluProduct>(res, {gate, up}, stream, error, error_len);
}
