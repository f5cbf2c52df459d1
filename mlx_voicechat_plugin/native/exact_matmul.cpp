// Exact-order matrix product for MLX's CPU backend.
//
// MLX's CPU matmul hands float32 products to the reference BLAS sgemm and runs bfloat16 /
// float16 products through its own simd_gemm (simd width 1 off Apple silicon). Both compute
// every output element as the in-order sum over k, ((0 + a0*b0) + a1*b1) + ..., with each
// product and each sum rounded to float32 (no fused multiply-add), and round the float32
// result once to the output dtype. This kernel computes exactly that sum in exactly that
// order, but vectorised across output columns and register-blocked across rows, so its
// results are bit-identical to mx.matmul on the CPU while running several times faster.
//
// Build with -ffp-contract=off: a contracted multiply-add would round differently.

#include <algorithm>
#include <cstring>
#include <memory>
#include <optional>
#include <type_traits>
#include <stdexcept>
#include <string>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "mlx/stream.h"
#include "mlx/utils.h"

namespace nb = nanobind;
namespace mx = mlx::core;

namespace {

constexpr int kLanes = 16;          // floats per vector
constexpr int kPanel = 2 * kLanes;  // output columns per panel
constexpr int kRows = 4;            // output rows per register block

typedef float vf __attribute__((vector_size(kLanes * sizeof(float)), aligned(4)));

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(vf));
  return v;
}

inline void store(float* p, vf v) {
  std::memcpy(p, &v, sizeof(vf));
}

// R rows of A (float32, row stride K) against one packed K x kPanel panel.
template <int R>
inline void block(const float* a, long K, const float* panel, long ldp, float* out, long ldo,
                  int width) {
  vf acc0[R], acc1[R];
  for (int r = 0; r < R; ++r) {
    acc0[r] = vf{};
    acc1[r] = vf{};
  }
  for (long k = 0; k < K; ++k) {
    const vf b0 = load(panel + k * ldp);
    const vf b1 = load(panel + k * ldp + kLanes);
    for (int r = 0; r < R; ++r) {
      const vf x = vf{} + a[r * K + k];
      const vf p0 = x * b0;
      const vf p1 = x * b1;
      acc0[r] = acc0[r] + p0;
      acc1[r] = acc1[r] + p1;
    }
  }
  for (int r = 0; r < R; ++r) {
    float row[kPanel];
    store(row, acc0[r]);
    store(row + kLanes, acc1[r]);
    std::memcpy(out + r * ldo, row, sizeof(float) * width);
  }
}

template <typename T>
inline float widen(T x) {
  return static_cast<float>(x);
}

// out (M x N, float32, row-major) = a (M x K, row-contiguous) . b, with b(k, n) at
// b[k * sbk + n * sbn]. Every output is the in-order float32 sum over k.
template <typename T>
void product(const T* a, const T* b, long M, long N, long K, long sbk, long sbn, float* out) {
  std::vector<float> panel(std::max<long>(K, 1) * kPanel);
  std::vector<float> rows;
  const float* a32 = nullptr;
  if constexpr (std::is_same_v<T, float>) {
    a32 = a;
  } else {
    rows.resize(static_cast<size_t>(M) * K);
    for (long i = 0; i < M * K; ++i) rows[i] = widen(a[i]);
    a32 = rows.data();
  }
  for (long j = 0; j < N; j += kPanel) {
    const int width = static_cast<int>(std::min<long>(kPanel, N - j));
    const float* p = panel.data();
    long ldp = kPanel;
    if constexpr (std::is_same_v<T, float>) {
      // Row-contiguous float32 (K, N) operand: read the full-width panels in place.
      if (sbn == 1 && width == kPanel) {
        p = b + j;
        ldp = sbk;
      }
    }
    for (long k = 0; p == panel.data() && k < K; ++k) {
      const T* src = b + k * sbk + j * sbn;
      float* dst = panel.data() + k * kPanel;
      if (sbn == 1) {
        for (int t = 0; t < width; ++t) dst[t] = widen(src[t]);
      } else {
        for (int t = 0; t < width; ++t) dst[t] = widen(src[t * sbn]);
      }
      for (int t = width; t < kPanel; ++t) dst[t] = 0.0f;
    }
    long i = 0;
    for (; i + kRows <= M; i += kRows) {
      block<kRows>(a32 + i * K, K, p, ldp, out + i * N + j, N, width);
    }
    switch (M - i) {
      case 3:
        block<3>(a32 + i * K, K, p, ldp, out + i * N + j, N, width);
        break;
      case 2:
        block<2>(a32 + i * K, K, p, ldp, out + i * N + j, N, width);
        break;
      case 1:
        block<1>(a32 + i * K, K, p, ldp, out + i * N + j, N, width);
        break;
      default:
        break;
    }
  }
}

template <typename T>
void run(const mx::array& a, const mx::array& b, const mx::array* bias, mx::array& out, long M,
         long N, long K) {
  const T* pa = a.data<T>();
  const T* pb = b.data<T>();
  const long sbk = b.strides()[0];
  const long sbn = b.strides()[1];
  T* po = out.data<T>();
  if (M == 0 || N == 0) return;
  std::vector<float> buffer;
  float* result = nullptr;
  if constexpr (std::is_same_v<T, float>) {
    result = po;
  } else {
    buffer.resize(static_cast<size_t>(M) * N);
    result = buffer.data();
  }
  if (K == 0) {
    std::fill(result, result + M * N, 0.0f);
  } else {
    product<T>(pa, pb, M, N, K, sbk, sbn, result);
  }
  if (bias != nullptr) {
    // The finished float32 sum plus the bias, rounded once (mx.addmm's epilogue).
    const T* pc = bias->data<T>();
    const long sc = bias->strides()[0];
    for (long i = 0; i < M; ++i) {
      for (long j = 0; j < N; ++j) result[i * N + j] = result[i * N + j] + widen(pc[j * sc]);
    }
  }
  if constexpr (!std::is_same_v<T, float>) {
    for (long i = 0; i < M * N; ++i) po[i] = T(result[i]);
  }
}

class ExactMatmul : public mx::UnaryPrimitive {
 public:
  explicit ExactMatmul(mx::Stream stream) : mx::UnaryPrimitive(stream) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const mx::array& a = inputs[0];
    const mx::array& b = inputs[1];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    const long K = b.shape(0);
    const long N = b.shape(1);
    const long M = K == 0 ? static_cast<long>(out.size() / std::max<long>(N, 1))
                          : static_cast<long>(a.size() / K);
    auto& encoder = mx::cpu::get_command_encoder(stream());
    const bool has_bias = inputs.size() == 3;
    encoder.set_input_array(a);
    encoder.set_input_array(b);
    if (has_bias) encoder.set_input_array(inputs[2]);
    encoder.set_output_array(out);
    encoder.dispatch([a = mx::array::unsafe_weak_copy(a), b = mx::array::unsafe_weak_copy(b),
                      c = mx::array::unsafe_weak_copy(has_bias ? inputs[2] : b), has_bias,
                      out = mx::array::unsafe_weak_copy(out), M, N, K]() mutable {
      const mx::array* bias = has_bias ? &c : nullptr;
      switch (out.dtype()) {
        case mx::float32:
          run<float>(a, b, bias, out, M, N, K);
          break;
        case mx::bfloat16:
          run<mx::bfloat16_t>(a, b, bias, out, M, N, K);
          break;
        case mx::float16:
          run<mx::float16_t>(a, b, bias, out, M, N, K);
          break;
        default:
          throw std::runtime_error("exact_matmul: unsupported dtype");
      }
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("exact_matmul has no GPU implementation; use mx.matmul");
  }

  std::vector<mx::array> vjp(
      const std::vector<mx::array>& primals,
      const std::vector<mx::array>& cotangents,
      const std::vector<int>& argnums,
      const std::vector<mx::array>&) override {
    const mx::array& a = primals[0];
    const mx::array& b = primals[1];
    const mx::array& cotangent = cotangents[0];
    std::vector<mx::array> grads;
    for (int arg : argnums) {
      if (arg == 2) {
        const int N = b.shape(1);
        grads.push_back(mx::sum(mx::reshape(cotangent, {-1, N}, stream()), 0, false, stream()));
      } else if (arg == 0) {
        grads.push_back(mx::matmul(cotangent, mx::transpose(b, stream()), stream()));
      } else {
        const int K = b.shape(0);
        const int N = b.shape(1);
        auto rows = mx::reshape(a, {-1, K}, stream());
        auto cot = mx::reshape(cotangent, {-1, N}, stream());
        grads.push_back(mx::matmul(mx::transpose(rows, stream()), cot, stream()));
      }
    }
    return grads;
  }

  const char* name() const override {
    return "ExactMatmul";
  }

  bool is_equivalent(const mx::Primitive&) const override {
    return true;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    mx::Shape shape = inputs[0].shape();
    shape.back() = inputs[1].shape(1);
    return {shape};
  }
};

mx::array exact_matmul(const mx::array& a, const mx::array& b, std::optional<mx::array> bias) {
  if (a.ndim() < 1 || b.ndim() != 2) {
    throw std::invalid_argument(
        "exact_matmul: a must have at least 1 dimension and b exactly 2, got shapes " +
        std::to_string(a.ndim()) + "-D and " + std::to_string(b.ndim()) + "-D");
  }
  if (a.shape(-1) != b.shape(0)) {
    throw std::invalid_argument(
        "exact_matmul: inner dimensions differ (" + std::to_string(a.shape(-1)) + " vs " +
        std::to_string(b.shape(0)) + ")");
  }
  if (a.dtype() != b.dtype() ||
      (a.dtype() != mx::float32 && a.dtype() != mx::bfloat16 && a.dtype() != mx::float16)) {
    throw std::invalid_argument(
        "exact_matmul: a and b must share one of float32, bfloat16, float16");
  }
  mx::Stream stream = mx::default_stream(mx::default_device());
  if (stream.device.type != mx::Device::DeviceType::cpu) {
    throw std::invalid_argument("exact_matmul runs on the CPU stream only");
  }
  std::vector<mx::array> inputs = {mx::contiguous(a, false, stream), b};
  if (bias.has_value()) {
    if (bias->ndim() != 1 || bias->shape(0) != b.shape(1) || bias->dtype() != a.dtype()) {
      throw std::invalid_argument(
          "exact_matmul: bias must be a vector of the output width with the same dtype");
    }
    inputs.push_back(*bias);
  }
  mx::Shape shape = a.shape();
  shape.back() = b.shape(1);
  return mx::array(std::move(shape), a.dtype(), std::make_shared<ExactMatmul>(stream),
                   std::move(inputs));
}

}  // namespace

NB_MODULE(_exact_matmul, m) {
  m.doc() = "Exact-order CPU matrix product (bit-identical to mx.matmul on the CPU).";
  m.def("exact_matmul", &exact_matmul, nb::arg("a"), nb::arg("b"), nb::arg("bias") = nb::none(),
        "a (..., K) @ b (K, N) [+ bias (N,)] -> (..., N), one dtype; bit-identical to\n"
        "mx.matmul(a, b) (float32: (a @ b) + bias; bfloat16/float16: mx.addmm(bias, a, b))\n"
        "on the CPU.");
}
