// Exact CPU kernels for MLX: each computes what one MLX operation computes, in the same
// order and with the same roundings, so its results are bit-identical, only faster.
//
// exact_matmul: the matrix product (also float32 activations against 16-bit weights: MLX
// widens the weights to float32 exactly and multiplies in float32; so does the kernel).
//
// MLX's CPU matmul hands float32 products to the reference BLAS sgemm and runs bfloat16 /
// float16 products through its own simd_gemm (simd width 1 off Apple silicon). Both compute
// every output element as the in-order sum over k, ((0 + a0*b0) + a1*b1) + ..., with each
// product and each sum rounded to float32 (no fused multiply-add), and round the float32
// result once to the output dtype. This kernel computes exactly that sum in exactly that
// order, but vectorised across output columns and register-blocked across rows, so its
// results are bit-identical to mx.matmul on the CPU while running several times faster.
// Few rows against a row-major float32 or bfloat16 weight take the same sums in another
// loop order (outer_rows: the weight read in memory order; in_place: the panels read where
// they lie, without packing), a bfloat16 weight widened a vector at a time as it is read
// (widening is exact).
//
// lookup16: y[i] = table[bits(x[i])] for 16-bit floats (a 65,536-entry activation table),
// a contiguous loop instead of MLX's general gather.
//
// depthwise_conv1d: MLX's conv1d with groups == channels, stride 1, no padding/dilation.
// MLX sums the taps in order in float32 (products of the widened inputs) and rounds once.
//
// rvq_encode: EAR-TTS's residual quantisation steps (upstream _rvq_encode_step) in one pass.
//
// rms_norm: mx.fast.rms_norm on the CPU (MLX runs its fallback graph there).
//
// softmax: mx.softmax(x, -1, precise=True) on the CPU, MLX's scalar loop with the
// exponentials a vector at a time.
//
// top_p_keep: the mask of EAR-TTS's top-p filter (argsort, reverse cumulative sum, scatter).
//
// quantized_matmul: mx.quantized_matmul (affine, transposed weight, bits 2/4/8, group sizes
// 32/64/128) with MLX's scalar loop's order and roundings (see the section below).
//
// Build with -ffp-contract=off: a contracted multiply-add would round differently.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <type_traits>
#include <stdexcept>
#include <string>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#elif defined(__SSE2__)
#include <emmintrin.h>
#endif

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/fast.h"
#include "mlx/ops.h"
#include "mlx/transforms.h"
#include "mlx/primitives.h"
#include "mlx/stream.h"
#include "mlx/utils.h"

namespace nb = nanobind;
namespace mx = mlx::core;

namespace {

// Vector width per instruction set, chosen at build time (build.py passes -march for the
// variant): each row block keeps 2 * kRows accumulators, two panel vectors and one
// broadcast in registers (AVX-512 and NEON have 32 vector registers, AVX2 16).
#if defined(__AVX512F__)
#define VOICECHAT_ISA "avx512"
constexpr int kLanes = 16;  // floats per vector: one zmm register
#elif defined(__AVX2__)
#define VOICECHAT_ISA "avx2"
constexpr int kLanes = 8;  // one ymm register
#elif defined(__ARM_NEON) || defined(__aarch64__)
#define VOICECHAT_ISA "neon"
constexpr int kLanes = 4;  // one q register
#else
#define VOICECHAT_ISA "generic"
constexpr int kLanes = 4;  // SSE2 / any 128-bit vector unit (or scalar code)
#endif
constexpr int kPanel = 2 * kLanes;  // output columns per panel
constexpr int kRows = 4;            // output rows per register block
constexpr long kPrefetchRows = 16;  // weight rows prefetched ahead while packing a panel
constexpr int kOuterRows = 4;       // at most this many rows read a row-major weight in order
constexpr long kPackSpan = 64;      // elements of a contiguous column packed per pass
// At most this many rows (from 3) read a row-major weight in place, 2 accumulators per row
// in registers (`in_place`): on AVX-512 (32 registers) 1.1-2.6x faster than the order of
// `outer_rows` and than packed panels for a batched tick's 3-8 rows; with AVX2's 16
// registers no faster, and not measured on NEON, so there 0 (off).
#if defined(__AVX512F__)
constexpr int kInPlaceRows = 8;
#else
constexpr int kInPlaceRows = 0;
#endif
constexpr long kOuterColumns = 1024;  // columns of sums per pass of outer_rows (L1-resident)

typedef float vf __attribute__((vector_size(kLanes * sizeof(float)), aligned(4)));
// Unaligned, aliasing view for loads and stores: a memcpy here made GCC keep the
// accumulators on the stack (and call memcpy) for 8-float vectors.
typedef float vf_unaligned __attribute__((vector_size(kLanes * sizeof(float)), aligned(4), may_alias));

typedef int32_t vi __attribute__((vector_size(kLanes * sizeof(int32_t))));

inline vf load(const float* p) {
  return *reinterpret_cast<const vf_unaligned*>(p);
}

inline void store(float* p, vf v) {
  *reinterpret_cast<vf_unaligned*>(p) = v;
}

// x in every lane. Not ``vf{} + x``: that is an addition, 0 + x, which the compiler must
// keep for signed zeros (a scalar add and a register broadcast per use, competing with the
// products' vector multiplies and adds for the same ports).
inline vf broadcast(float x) {
#if defined(__AVX512F__)
  return (vf)_mm512_set1_ps(x);
#elif defined(__AVX2__)
  return (vf)_mm256_set1_ps(x);
#elif defined(__SSE2__)
  return (vf)_mm_set1_ps(x);  // the generic variant on x86-64 (4 lanes)
#else  // NEON and others
  vf v;
  for (int lane = 0; lane < kLanes; ++lane) v[lane] = x;
  return v;
#endif
}

// Prefetch the cache lines of `bytes` bytes at `p` into the L2 cache. A panel's rows are
// far apart in a row-major weight (4 KiB for 1,024 float32 columns: each in another page,
// where the hardware prefetchers stop); into L2 rather than L1, where a 4 KiB stride maps
// every row to the same few sets.
inline void prefetch_row(const void* p, size_t bytes) {
  const char* first = static_cast<const char*>(p);
  for (size_t offset = 0; offset < bytes; offset += 64) __builtin_prefetch(first + offset, 0, 2);
  __builtin_prefetch(first + bytes - 1, 0, 2);  // the last line when `first` is not line-aligned
}

template <typename T>
inline float widen(T x) {
  return static_cast<float>(x);
}

// `count` bfloat16 values at `src` widened to float32 at `dst`, a vector at a time: a
// bfloat16 is the upper half of the float32 with the same value, so widening is the 16-bit
// pattern shifted into the upper half (exact, as static_cast<float> computes it; NaN
// payloads included). The scalar conversion compiles to one element per instruction chain.
typedef uint16_t vh_unaligned __attribute__((vector_size(kLanes * sizeof(uint16_t)), aligned(2), may_alias));
typedef uint32_t vw __attribute__((vector_size(kLanes * sizeof(uint32_t))));

// kLanes weights at `p` as float32: a load, or for bfloat16 a widening load (exact).
inline vf load_widened(const float* p) { return load(p); }

inline vf load_widened(const mx::bfloat16_t* p) {
  static_assert(sizeof(mx::bfloat16_t) == sizeof(uint16_t), "bfloat16 is 16 bits");
  const vw wide = __builtin_convertvector(*reinterpret_cast<const vh_unaligned*>(p), vw) << 16;
  return (vf)wide;
}

inline void widen_bf16(const mx::bfloat16_t* src, float* dst, long count) {
  long t = 0;
  for (; t + kLanes <= count; t += kLanes) store(dst + t, load_widened(src + t));
  for (; t < count; ++t) dst[t] = widen(src[t]);
}

// R rows of A (float32, row stride K) against one packed K x kPanel panel.
template <int R>
inline void block(const float* a, long K, const float* panel, float* out, long ldo, int width) {
  vf acc0[R], acc1[R];
  for (int r = 0; r < R; ++r) {
    acc0[r] = vf{};
    acc1[r] = vf{};
  }
  // Two k steps per iteration: without it GCC rotates some accumulators through extra
  // register moves every step (measured 5-25 % slower on the codec's products, AVX-512 and AVX2).
#pragma GCC unroll 2
  for (long k = 0; k < K; ++k) {
    const vf b0 = load(panel + k * kPanel);
    const vf b1 = load(panel + k * kPanel + kLanes);
    for (int r = 0; r < R; ++r) {
      // broadcast, not 0 + a: the same sums (an accumulator starts at +0 and can never be
      // -0, so the sign of a zero product never shows)
      const vf x = broadcast(a[r * K + k]);
      const vf p0 = x * b0;
      const vf p1 = x * b1;
      acc0[r] = acc0[r] + p0;
      acc1[r] = acc1[r] + p1;
    }
  }
  for (int r = 0; r < R; ++r) {
    if (width == kPanel) {  // a full panel: straight to the output (no memcpy call per row)
      store(out + r * ldo, acc0[r]);
      store(out + r * ldo + kLanes, acc1[r]);
      continue;
    }
    float row[kPanel];
    store(row, acc0[r]);
    store(row + kLanes, acc1[r]);
    std::memcpy(out + r * ldo, row, sizeof(float) * width);
  }
}

// R (<= kOuterRows) rows of A (float32, row stride K) against a float32 (K, N) weight whose
// rows are contiguous (row stride ldb), read in memory order: for each k, row k of the
// weight updates all R x N sums, held in `out` (R x N, row-major; at most kOuterColumns
// columns at a time, so that they stay in the L1 cache). Each output is still the in-order
// sum ((0 + a0*b0) + a1*b1) + ... of the panel kernel (`block`): only the loop order over
// outputs differs. A panel of a row-major weight is K rows each in another part of it (4 KiB
// apart for 1,024 float32 columns: another page, where the hardware prefetchers stop), so
// with few rows to amortise it the panel kernel waits on memory; this order streams the
// weight (1-4 rows against uncached 256 x 1,024 weights: 1.1-1.6x faster than packed panels;
// at 8 rows no faster, docs/performance.md).
template <int R, typename TB = float>
void outer_rows(const float* a, const TB* b, long N, long K, long ldb, float* out) {
  for (long c0 = 0; c0 < N; c0 += kOuterColumns) {
    const long c1 = std::min(N, c0 + kOuterColumns);
    for (int r = 0; r < R; ++r) std::fill(out + r * N + c0, out + r * N + c1, 0.0f);
    for (long k = 0; k < K; ++k) {
      const TB* row = b + k * ldb;
      vf x[R];
      for (int r = 0; r < R; ++r) x[r] = broadcast(a[r * K + k]);
      long n = c0;
      for (; n + kLanes <= c1; n += kLanes) {
        const vf w = load_widened(row + n);
        for (int r = 0; r < R; ++r) {
          const vf p = x[r] * w;
          store(out + r * N + n, load(out + r * N + n) + p);
        }
      }
      for (; n < c1; ++n) {
        for (int r = 0; r < R; ++r) {
          const float p = a[r * K + k] * widen(row[n]);
          out[r * N + n] = out[r * N + n] + p;
        }
      }
    }
  }
}

// Per-thread scratch space, grown as needed and reused: a kernel call must not pay for
// malloc (large blocks come from mmap with fresh, faulting pages).
enum Scratch { kPanelScratch, kRowsScratch, kResultScratch, kDepthwiseWeights, kDepthwiseRow, kScratchCount };

inline float* scratch(Scratch slot, size_t count) {
  thread_local std::vector<float> buffers[kScratchCount];
  std::vector<float>& buffer = buffers[slot];
  if (buffer.size() < count) buffer.resize(count);
  return buffer.data();
}

// A panel of `width` (<= kPanel) columns of a row-major (K, N) weight (row stride ldb; a
// bfloat16 one widened), the rest of each panel row zero: its rows are far apart and each
// row block would wait on memory again, so the rows ahead are prefetched.
template <typename T>
void pack_rows(const T* b, long ldb, long K, int width, float* panel) {
  for (long k = 0; k < K; ++k) {
    const T* src = b + k * ldb;
    float* dst = panel + k * kPanel;
    if (k + kPrefetchRows < K) prefetch_row(src + kPrefetchRows * ldb, sizeof(T) * width);
    if constexpr (std::is_same_v<T, mx::bfloat16_t>) {
      widen_bf16(src, dst, width);
    } else {
      for (int t = 0; t < width; ++t) dst[t] = widen(src[t]);
    }
    for (int t = width; t < kPanel; ++t) dst[t] = 0.0f;
  }
}

// The panel kernel's sums (`block`) for R rows of A (float32, row stride K) against a
// row-major (K, N) weight read in place (row stride ldb; a bfloat16 weight widened as it
// is read): with a single block of rows every panel is read once, so packing it would only
// add a copy. The rows a panel spans are far apart (4 KiB for 1,024 float32 columns), so
// each k step prefetches the panel's part of row k + kPrefetchRows. The last, partial
// panel is packed.
template <int R, typename TB>
void in_place(const float* a, const TB* b, long N, long K, long ldb, float* out) {
  long j = 0;
  const long ahead = std::max<long>(0, K - kPrefetchRows);
  for (; j + kPanel <= N; j += kPanel) {
    vf acc0[R], acc1[R];
    for (int r = 0; r < R; ++r) {
      acc0[r] = vf{};
      acc1[r] = vf{};
    }
    const TB* column = b + j;
    auto step = [&](long k) {
      const vf b0 = load_widened(column + k * ldb);
      const vf b1 = load_widened(column + k * ldb + kLanes);
      for (int r = 0; r < R; ++r) {
        const vf x = broadcast(a[r * K + k]);  // as in `block`: the same sums
        const vf p0 = x * b0;
        const vf p1 = x * b1;
        acc0[r] = acc0[r] + p0;
        acc1[r] = acc1[r] + p1;
      }
    };
    long k = 0;
    for (; k < ahead; ++k) {
      prefetch_row(column + (k + kPrefetchRows) * ldb, sizeof(TB) * kPanel);
      step(k);
    }
    for (; k < K; ++k) step(k);
    for (int r = 0; r < R; ++r) {
      store(out + r * N + j, acc0[r]);
      store(out + r * N + j + kLanes, acc1[r]);
    }
  }
  if (j < N) {
    const int width = static_cast<int>(N - j);
    float* const panel = scratch(kPanelScratch, static_cast<size_t>(K) * kPanel);
    pack_rows(b + j, ldb, K, width, panel);
    block<R>(a, K, panel, out + j, N, width);
  }
}

#if defined(__AVX512F__) || defined(__AVX2__)
// A kLanes x kLanes tile transposed in registers: rows[i][k] -> rows[k][i] (data moves only).
inline void transpose_tile(vf rows[kLanes]) {
#if defined(__AVX512F__)
  __m512 t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps((__m512)rows[2 * i], (__m512)rows[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps((__m512)rows[2 * i], (__m512)rows[2 * i + 1]);
  }
  // u[4i + c], 128-bit lane L: column 4L + c of rows 4i .. 4i + 3
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 1]);
    const __m512d c = _mm512_castps_pd(t[4 * i + 2]), d = _mm512_castps_pd(t[4 * i + 3]);
    u[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
    u[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    u[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
    u[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
  }
  for (int c = 0; c < 4; ++c) {
    const __m512 low02 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0x88);    // lanes 0, 2 of rows 0-3, 4-7
    const __m512 low13 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0xdd);    // lanes 1, 3
    const __m512 high02 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0x88);
    const __m512 high13 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0xdd);
    rows[c] = (vf)_mm512_shuffle_f32x4(low02, high02, 0x88);
    rows[8 + c] = (vf)_mm512_shuffle_f32x4(low02, high02, 0xdd);
    rows[4 + c] = (vf)_mm512_shuffle_f32x4(low13, high13, 0x88);
    rows[12 + c] = (vf)_mm512_shuffle_f32x4(low13, high13, 0xdd);
  }
#else
  __m256 t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps((__m256)rows[2 * i], (__m256)rows[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps((__m256)rows[2 * i], (__m256)rows[2 * i + 1]);
  }
  // u[4i + c], 128-bit lane L: column 4L + c of rows 4i .. 4i + 3
  for (int i = 0; i < 2; ++i) {
    u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int c = 0; c < 4; ++c) {
    rows[c] = (vf)_mm256_permute2f128_ps(u[c], u[4 + c], 0x20);
    rows[4 + c] = (vf)_mm256_permute2f128_ps(u[c], u[4 + c], 0x31);
  }
#endif
}

// A panel (kPanel columns, k in [0, K), K a multiple of kLanes) of a matrix whose columns
// lie in memory (column t at b + t * ldn, contiguous over k), as the panel kernel packs it:
// kLanes x kLanes tiles read a column vector at a time (a bfloat16 one widened), transposed
// in registers and stored a panel row vector at a time.
template <typename TB>
void pack_tiles(const TB* b, long ldn, long K, float* panel) {
  // the next panel's columns, into L2 while this one is packed (a prefetch never faults)
  for (int t = 0; t < kPanel; ++t) prefetch_row(b + (kPanel + t) * ldn, sizeof(TB) * K);
  for (long k0 = 0; k0 < K; k0 += kLanes) {
    for (int t0 = 0; t0 < kPanel; t0 += kLanes) {
      vf rows[kLanes];
      for (int i = 0; i < kLanes; ++i) rows[i] = load_widened(b + (t0 + i) * ldn + k0);
      transpose_tile(rows);
      for (int k = 0; k < kLanes; ++k) store(panel + (k0 + k) * kPanel + t0, rows[k]);
    }
  }
}
#endif

// A row-contiguous copy of any strided array (row-major logical order), in per-thread
// scratch; the array itself when it is already row-contiguous.
template <typename T>
const T* row_contiguous(const mx::array& x, int slot = 0) {
  if (x.flags().row_contiguous) return x.data<T>();
  thread_local std::vector<char> buffers[4];
  std::vector<char>& bytes = buffers[slot];
  const size_t n = x.size();
  if (bytes.size() < n * sizeof(T)) bytes.resize(n * sizeof(T));
  T* dst = reinterpret_cast<T*>(bytes.data());
  const T* src = x.data<T>();
  const int ndim = x.ndim();
  std::vector<int64_t> index(ndim, 0);
  int64_t offset = 0;
  for (size_t i = 0; i < n; ++i) {
    dst[i] = src[offset];
    for (int d = ndim - 1; d >= 0; --d) {
      offset += x.strides()[d];
      if (++index[d] < x.shape(d)) break;
      offset -= x.strides()[d] * x.shape(d);
      index[d] = 0;
    }
  }
  return dst;
}

// out (M x N, float32, row-major) = a (M x K, row-contiguous) . b, with b(k, n) at
// b[k * sbk + n * sbn]. Every output is the in-order float32 sum over k.
// TA / TB: the element types of a and b (equal, or a float32 with b a 16-bit float: MLX
// promotes that product to float32, widening b exactly, and sums as for float32).
template <typename TA, typename TB = TA>
void product(const TA* a, const TB* b, long M, long N, long K, long sbk, long sbn, float* out) {
  using T = TB;
  const float* a32 = nullptr;
  if constexpr (std::is_same_v<TA, float>) {
    a32 = a;
  } else {
    float* rows = scratch(kRowsScratch, static_cast<size_t>(M) * K);
    if constexpr (std::is_same_v<TA, mx::bfloat16_t>) {
      widen_bf16(a, rows, M * K);
    } else {
      for (long i = 0; i < M * K; ++i) rows[i] = widen(a[i]);
    }
    a32 = rows;
  }
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, mx::bfloat16_t>) {
    // Against a row-major (K, N) weight (a bfloat16 one widened as read): 3 to kInPlaceRows
    // rows read it in place, the sums in registers; up to kOuterRows rows otherwise stream
    // it in memory order, when it is at least a vector wide (narrower ones would run only
    // the scalar tail, slower than the panels).
    if constexpr (kInPlaceRows > 0) {
      if (sbn == 1 && M >= 3 && M <= kInPlaceRows && N >= kPanel) {
        switch (M) {
          case 3: return in_place<3>(a32, b, N, K, sbk, out);
          case 4: return in_place<4>(a32, b, N, K, sbk, out);
          case 5: return in_place<5>(a32, b, N, K, sbk, out);
          case 6: return in_place<6>(a32, b, N, K, sbk, out);
          case 7: return in_place<7>(a32, b, N, K, sbk, out);
          case 8: return in_place<8>(a32, b, N, K, sbk, out);
          default: break;
        }
      }
    }
    if (sbn == 1 && M <= kOuterRows && N >= kLanes) {
      switch (M) {
        case 1: return outer_rows<1>(a32, b, N, K, sbk, out);
        case 2: return outer_rows<2>(a32, b, N, K, sbk, out);
        case 3: return outer_rows<3>(a32, b, N, K, sbk, out);
        case 4: return outer_rows<4>(a32, b, N, K, sbk, out);
        default: break;
      }
    }
  }
  float* const panel = scratch(kPanelScratch, static_cast<size_t>(std::max<long>(K, 1)) * kPanel);
  for (long j = 0; j < N; j += kPanel) {
    const int width = static_cast<int>(std::min<long>(kPanel, N - j));
    // Pack the panel (also a row-major float32 weight's: read in place, its rows are far
    // apart and each row block would wait on memory again; packed, it stays in L1).
    if (sbk == 1 && sbn != 1) {
      // the columns lie in memory (a transposed (N, K) matrix, e.g. attention's keys): whole
      // panels by tiles transposed in registers; otherwise (and the last k) each column read
      // in order, kPackSpan of its elements at a time so that the panel rows written stay in
      // the L1 cache (2x faster than gathering a panel row at a time, the tiles 1.5x more)
      long tiled = 0;  // leading k packed by whole kLanes x kLanes tiles
#if defined(__AVX512F__) || defined(__AVX2__)
      if constexpr (std::is_same_v<T, float> || std::is_same_v<T, mx::bfloat16_t>) {
        if (width == kPanel) {
          tiled = K - K % kLanes;
          pack_tiles(b + j * sbn, sbn, tiled, panel);
        }
      }
#endif
      for (long k0 = tiled; k0 < K; k0 += kPackSpan) {
        const long k1 = std::min(K, k0 + kPackSpan);
        for (int t = 0; t < width; ++t) {
          const T* src = b + (j + t) * sbn;
          for (long k = k0; k < k1; ++k) panel[k * kPanel + t] = widen(src[k]);
        }
        for (long k = k0; k < k1; ++k) {
          for (int t = width; t < kPanel; ++t) panel[k * kPanel + t] = 0.0f;
        }
      }
    } else if (sbn == 1) {
      pack_rows(b + j, sbk, K, width, panel);
    } else {
      for (long k = 0; k < K; ++k) {
        const T* src = b + k * sbk + j * sbn;
        float* dst = panel + k * kPanel;
        for (int t = 0; t < width; ++t) dst[t] = widen(src[t * sbn]);
        for (int t = width; t < kPanel; ++t) dst[t] = 0.0f;
      }
    }
    long i = 0;
    for (; i + kRows <= M; i += kRows) {
      block<kRows>(a32 + i * K, K, panel, out + i * N + j, N, width);
    }
    switch (M - i) {
      case 3:
        block<3>(a32 + i * K, K, panel, out + i * N + j, N, width);
        break;
      case 2:
        block<2>(a32 + i * K, K, panel, out + i * N + j, N, width);
        break;
      case 1:
        block<1>(a32 + i * K, K, panel, out + i * N + j, N, width);
        break;
      default:
        break;
    }
  }
}

// b (K x N) is inputs[1], or its transpose when `transposed` (inputs[1] is then N x K).
template <typename T>
void run(const mx::array& a, const mx::array& b, bool transposed, const mx::array* bias,
         mx::array& out, long M, long N, long K) {
  const T* pa = row_contiguous<T>(a);
  const T* pb = b.data<T>();
  const long sbk = transposed ? b.strides()[1] : b.strides()[0];
  const long sbn = transposed ? b.strides()[0] : b.strides()[1];
  T* po = out.data<T>();
  if (M == 0 || N == 0) return;
  float* result = nullptr;
  if constexpr (std::is_same_v<T, float>) {
    result = po;
  } else {
    result = scratch(kResultScratch, static_cast<size_t>(M) * N);
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

// a float32 (M x K) times a 16-bit float b, no bias: out float32, as mx.matmul promotes it.
template <typename TB>
void run_mixed(const mx::array& a, const mx::array& b, bool transposed, mx::array& out, long M, long N,
               long K) {
  const float* pa = row_contiguous<float>(a);
  const TB* pb = b.data<TB>();
  const long sbk = transposed ? b.strides()[1] : b.strides()[0];
  const long sbn = transposed ? b.strides()[0] : b.strides()[1];
  float* result = out.data<float>();
  if (M == 0 || N == 0) return;
  if (K == 0) {
    std::fill(result, result + M * N, 0.0f);
    return;
  }
  product<float, TB>(pa, pb, M, N, K, sbk, sbn, result);
}

// Derivatives: every kernel differentiates as the MLX computation it replaces.
using Reference = std::function<std::vector<mx::array>(const std::vector<mx::array>&)>;

std::vector<mx::array> reference_vjp(const Reference& reference, const std::vector<mx::array>& primals,
                                     const std::vector<mx::array>& cotangents, const std::vector<int>& argnums) {
  auto grads = mx::vjp(reference, primals, cotangents).second;
  std::vector<mx::array> selected;
  for (int arg : argnums) selected.push_back(grads[arg]);
  return selected;
}

std::vector<mx::array> reference_jvp(const Reference& reference, const std::vector<mx::array>& primals,
                                     const std::vector<mx::array>& tangents, const std::vector<int>& argnums) {
  std::vector<mx::array> all;
  for (size_t i = 0, j = 0; i < primals.size(); ++i) {
    if (j < argnums.size() && argnums[j] == static_cast<int>(i)) {
      all.push_back(tangents[j++]);
    } else {
      all.push_back(mx::zeros_like(primals[i]));
    }
  }
  return mx::jvp(reference, primals, all).second;
}

// Calls f(T{}) with T the C++ type of a float32 / bfloat16 / float16 dtype.
template <typename F>
void dispatch_float(mx::Dtype dtype, const char* op, F&& f) {
  switch (dtype) {
    case mx::float32:
      return f(float{});
    case mx::bfloat16:
      return f(mx::bfloat16_t{});
    case mx::float16:
      return f(mx::float16_t{});
    default:
      throw std::runtime_error(std::string(op) + ": unsupported dtype");
  }
}

// The default stream, which must be a CPU stream (every kernel here is CPU-only).
mx::Stream cpu_stream(const char* op) {
  mx::Stream stream = mx::default_stream(mx::default_device());
  if (stream.device.type != mx::Device::DeviceType::cpu) {
    throw std::invalid_argument(std::string(op) + " runs on the CPU stream only");
  }
  return stream;
}

// A CPU-only kernel: `op` names it in errors.
class CpuKernel : public mx::UnaryPrimitive {
 public:
  CpuKernel(mx::Stream stream, const char* op) : mx::UnaryPrimitive(stream), op_(op) {}

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error(std::string(op_) + " has no GPU implementation");
  }

 protected:
  // Registers every input and `out` (already allocated: `task` captures weak copies of the
  // arrays it reads and writes, taken after the allocation) with this stream's command
  // encoder and queues `task` on it.
  template <typename Task>
  void encode(const std::vector<mx::array>& inputs, mx::array& out, Task&& task) {
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (const auto& input : inputs) encoder.set_input_array(input);
    encoder.set_output_array(out);
    encoder.dispatch(std::forward<Task>(task));
  }

  const char* op_;
};

// A CPU kernel that differentiates as `reference()`, the MLX computation it replaces.
class ReferenceKernel : public CpuKernel {
 public:
  using CpuKernel::CpuKernel;

  std::vector<mx::array> vjp(const std::vector<mx::array>& primals, const std::vector<mx::array>& cotangents,
                             const std::vector<int>& argnums, const std::vector<mx::array>&) override {
    return reference_vjp(reference(), primals, cotangents, argnums);
  }

  std::vector<mx::array> jvp(const std::vector<mx::array>& primals, const std::vector<mx::array>& tangents,
                             const std::vector<int>& argnums) override {
    return reference_jvp(reference(), primals, tangents, argnums);
  }

 protected:
  virtual Reference reference() = 0;
};

// A CPU kernel whose output carries no derivative (indices like mx.argmin's, a mask): zero
// cotangents for every input, and a zero tangent of the output's shape in `dtype`.
class NoDerivativeKernel : public CpuKernel {
 public:
  NoDerivativeKernel(mx::Stream stream, const char* op, mx::Dtype dtype) : CpuKernel(stream, op), dtype_(dtype) {}

  std::vector<mx::array> vjp(const std::vector<mx::array>& primals, const std::vector<mx::array>&,
                             const std::vector<int>& argnums, const std::vector<mx::array>&) override {
    std::vector<mx::array> grads;
    for (int arg : argnums) grads.push_back(mx::zeros_like(primals[arg], stream()));
    return grads;
  }

  std::vector<mx::array> jvp(const std::vector<mx::array>& primals, const std::vector<mx::array>&,
                             const std::vector<int>&) override {
    return {mx::zeros(output_shapes(primals)[0], dtype_, stream())};
  }

 private:
  mx::Dtype dtype_;
};

// Batched: a (*batch, M, K), b (*batch, K, N) (or (*batch, N, K) when transposed), same
// batch shape (broadcast views allowed), out (*batch, M, N) row-major. Each matrix pair is
// one product with the per-element order above (MLX runs one BLAS/simd_gemm call per batch).
template <typename T>
void run_batched(const mx::array& a, const mx::array& b, bool transposed, mx::array& out) {
  const int batch_dims = a.ndim() - 2;
  const long M = a.shape(-2), K = a.shape(-1);
  const long N = out.shape(-1);
  long batches = 1;
  for (int d = 0; d < batch_dims; ++d) batches *= a.shape(d);
  if (M == 0 || N == 0 || batches == 0) return;
  const long sam = a.strides()[a.ndim() - 2], sak = a.strides()[a.ndim() - 1];
  const long sbk = transposed ? b.strides()[b.ndim() - 1] : b.strides()[b.ndim() - 2];
  const long sbn = transposed ? b.strides()[b.ndim() - 2] : b.strides()[b.ndim() - 1];
  const bool a_rows = sak == 1 && (sam == K || M == 1);
  thread_local std::vector<char> a_copy;
  if (!a_rows && a_copy.size() < static_cast<size_t>(M * K) * sizeof(T)) a_copy.resize(M * K * sizeof(T));
  T* po = out.data<T>();
  std::vector<long> index(batch_dims, 0);
  long offset_a = 0, offset_b = 0;
  for (long batch = 0; batch < batches; ++batch) {
    const T* pa = a.data<T>() + offset_a;
    if (!a_rows) {
      T* dst = reinterpret_cast<T*>(a_copy.data());
      for (long i = 0; i < M; ++i) {
        for (long k = 0; k < K; ++k) dst[i * K + k] = pa[i * sam + k * sak];
      }
      pa = dst;
    }
    const T* pb = b.data<T>() + offset_b;
    T* pout = po + batch * M * N;
    float* result = nullptr;
    if constexpr (std::is_same_v<T, float>) {
      result = pout;
    } else {
      result = scratch(kResultScratch, static_cast<size_t>(M) * N);
    }
    if (K == 0) {
      std::fill(result, result + M * N, 0.0f);
    } else {
      product<T>(pa, pb, M, N, K, sbk, sbn, result);
    }
    if constexpr (!std::is_same_v<T, float>) {
      for (long i = 0; i < M * N; ++i) pout[i] = T(result[i]);
    }
    for (int d = batch_dims - 1; d >= 0; --d) {
      offset_a += a.strides()[d];
      offset_b += b.strides()[d];
      if (++index[d] < a.shape(d)) break;
      offset_a -= a.strides()[d] * a.shape(d);
      offset_b -= b.strides()[d] * b.shape(d);
      index[d] = 0;
    }
  }
}

class ExactMatmul : public CpuKernel {
 public:
  ExactMatmul(mx::Stream stream, bool transposed) : CpuKernel(stream, "exact_matmul"), transposed_(transposed) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const mx::array& a = inputs[0];
    const mx::array& b = inputs[1];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    const bool batched = b.ndim() > 2;
    const long K = transposed_ ? b.shape(-1) : b.shape(-2);
    const long N = transposed_ ? b.shape(-2) : b.shape(-1);
    const long M = K == 0 ? static_cast<long>(out.size() / std::max<long>(N, 1))
                          : static_cast<long>(a.size() / K);
    const bool has_bias = inputs.size() == 3;
    encode(inputs, out, [a = mx::array::unsafe_weak_copy(a), b = mx::array::unsafe_weak_copy(b),
                         c = mx::array::unsafe_weak_copy(has_bias ? inputs[2] : b), has_bias,
                         transposed = transposed_, out = mx::array::unsafe_weak_copy(out), M, N,
                         K, batched]() mutable {
      const mx::array* bias = has_bias ? &c : nullptr;
      if (a.dtype() != b.dtype()) {  // float32 a, 16-bit b (exact_matmul checked it)
        dispatch_float(b.dtype(), "exact_matmul", [&](auto tag) {
          using TB = decltype(tag);
          if constexpr (!std::is_same_v<TB, float>) run_mixed<TB>(a, b, transposed, out, M, N, K);
        });
        return;
      }
      dispatch_float(out.dtype(), "exact_matmul", [&](auto tag) {
        using T = decltype(tag);
        if (batched) {
          run_batched<T>(a, b, transposed, out);
        } else {
          run<T>(a, b, transposed, bias, out, M, N, K);
        }
      });
    });
  }

  std::vector<mx::array> vjp(
      const std::vector<mx::array>& primals,
      const std::vector<mx::array>& cotangents,
      const std::vector<int>& argnums,
      const std::vector<mx::array>&) override {
    const mx::array& a = primals[0];
    const mx::array& cotangent = cotangents[0];
    std::vector<mx::array> grads;
    if (primals[1].ndim() > 2) {
      const mx::array b = transposed_ ? mx::swapaxes(primals[1], -1, -2, stream()) : primals[1];
      for (int arg : argnums) {
        if (arg == 0) {
          grads.push_back(mx::matmul(cotangent, mx::swapaxes(b, -1, -2, stream()), stream()));
        } else {
          auto grad = mx::matmul(mx::swapaxes(a, -1, -2, stream()), cotangent, stream());
          grads.push_back(transposed_ ? mx::swapaxes(grad, -1, -2, stream()) : grad);
        }
      }
      return grads;
    }
    const mx::array b = transposed_ ? mx::transpose(primals[1], stream()) : primals[1];
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
        auto grad = mx::matmul(mx::transpose(rows, stream()), cot, stream());
        grads.push_back(transposed_ ? mx::transpose(grad, stream()) : grad);
      }
    }
    return grads;
  }

  std::vector<mx::array> jvp(const std::vector<mx::array>& primals, const std::vector<mx::array>& tangents,
                             const std::vector<int>& argnums) override {
    const bool transposed = transposed_;
    const auto s = stream();
    Reference reference = [transposed, s](const std::vector<mx::array>& in) {
      const mx::array b = transposed ? mx::swapaxes(in[1], -1, -2, s) : in[1];
      mx::array y = mx::matmul(in[0], b, s);
      if (in.size() == 3) y = mx::add(y, in[2], s);
      return std::vector<mx::array>{y};
    };
    return reference_jvp(reference, primals, tangents, argnums);
  }

  const char* name() const override {
    return "ExactMatmul";
  }

  bool is_equivalent(const mx::Primitive& other) const override {
    return static_cast<const ExactMatmul&>(other).transposed_ == transposed_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    mx::Shape shape = inputs[0].shape();
    shape.back() = transposed_ ? inputs[1].shape(-2) : inputs[1].shape(-1);
    return {shape};
  }

 private:
  bool transposed_;
};

mx::array exact_matmul(const mx::array& a, const mx::array& b, std::optional<mx::array> bias,
                       bool transpose) {
  const bool batched = b.ndim() > 2;
  if (a.ndim() < 1 || b.ndim() < 2 || (batched && (a.ndim() < 2 || bias.has_value()))) {
    throw std::invalid_argument(
        "exact_matmul: a (..., K) with b (K, N) [+ bias], or a (..., M, K) with b (..., K, N) "
        "and no bias; got " + std::to_string(a.ndim()) + "-D and " + std::to_string(b.ndim()) + "-D");
  }
  const int inner = transpose ? b.shape(-1) : b.shape(-2);
  const int width = transpose ? b.shape(-2) : b.shape(-1);
  if (a.shape(-1) != inner) {
    throw std::invalid_argument(
        "exact_matmul: inner dimensions differ (" + std::to_string(a.shape(-1)) + " vs " +
        std::to_string(inner) + ")");
  }
  const bool mixed = a.dtype() == mx::float32 && (b.dtype() == mx::bfloat16 || b.dtype() == mx::float16);
  if ((a.dtype() != b.dtype() && !mixed) ||
      (a.dtype() != mx::float32 && a.dtype() != mx::bfloat16 && a.dtype() != mx::float16)) {
    throw std::invalid_argument(
        "exact_matmul: a and b must share one of float32, bfloat16, float16 (or a float32 "
        "with b bfloat16/float16)");
  }
  if (mixed && (batched || bias.has_value())) {
    throw std::invalid_argument("exact_matmul: a float32 a with a 16-bit b takes a 2-D b and no bias");
  }
  mx::Stream stream = cpu_stream("exact_matmul");
  std::vector<mx::array> inputs = {a, b};
  if (batched) {
    mx::Shape a_batch(a.shape().begin(), a.shape().end() - 2);
    mx::Shape b_batch(b.shape().begin(), b.shape().end() - 2);
    mx::Shape batch = mx::broadcast_shapes(a_batch, b_batch);
    mx::Shape a_shape = batch, b_shape = batch;
    a_shape.insert(a_shape.end(), a.shape().end() - 2, a.shape().end());
    b_shape.insert(b_shape.end(), b.shape().end() - 2, b.shape().end());
    inputs = {a.shape() == a_shape ? a : mx::broadcast_to(a, a_shape, stream),
              b.shape() == b_shape ? b : mx::broadcast_to(b, b_shape, stream)};
  }
  if (bias.has_value()) {
    if (bias->ndim() != 1 || bias->shape(0) != width || bias->dtype() != a.dtype()) {
      throw std::invalid_argument(
          "exact_matmul: bias must be a vector of the output width with the same dtype");
    }
    inputs.push_back(*bias);
  }
  mx::Shape shape = inputs[0].shape();
  shape.back() = width;
  return mx::array(std::move(shape), a.dtype(), std::make_shared<ExactMatmul>(stream, transpose),
                   std::move(inputs));
}


// ---------------------------------------------------------------------------------------
// lookup16

class Lookup16 : public CpuKernel {
 public:
  explicit Lookup16(mx::Stream stream) : CpuKernel(stream, "lookup16") {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const mx::array& x = inputs[0];
    const mx::array& table = inputs[1];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    encode(inputs, out, [x = mx::array::unsafe_weak_copy(x), table = mx::array::unsafe_weak_copy(table),
                         out = mx::array::unsafe_weak_copy(out)]() mutable {
      const uint16_t* in = row_contiguous<uint16_t>(x, 0);
      const uint16_t* values = row_contiguous<uint16_t>(table, 1);
      uint16_t* result = out.data<uint16_t>();
      const size_t n = out.size();
      for (size_t i = 0; i < n; ++i) result[i] = values[in[i]];
    });
  }

  const char* name() const override {
    return "Lookup16";
  }

  bool is_equivalent(const mx::Primitive&) const override {
    return true;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }
};

mx::array lookup16(const mx::array& x, const mx::array& table) {
  if ((x.dtype() != mx::bfloat16 && x.dtype() != mx::float16) || table.dtype() != x.dtype() ||
      table.ndim() != 1 || table.shape(0) != 65536) {
    throw std::invalid_argument(
        "lookup16: x must be bfloat16/float16 and table a (65536,) array of the same dtype");
  }
  mx::Stream stream = cpu_stream("lookup16");
  return mx::array(x.shape(), x.dtype(), std::make_shared<Lookup16>(stream), {x, table});
}

// ---------------------------------------------------------------------------------------
// depthwise_conv1d

template <typename T>
void depthwise(const T* x, const T* w, T* y, long batch, long steps_in, long channels, long taps,
               long padding) {
  // Output t sums taps k = 0..taps-1 over input t + k - padding; taps over the padding add
  // the product of a zero input (as MLX's zero-padded convolution does: 0 * inf is NaN).
  const long steps = steps_in + 2 * padding - taps + 1;
  float* const weights = scratch(kDepthwiseWeights, static_cast<size_t>(taps) * channels);
  for (long c = 0; c < channels; ++c) {
    for (long k = 0; k < taps; ++k) weights[k * channels + c] = widen(w[c * taps + k]);
  }
  float* const row = scratch(kDepthwiseRow, static_cast<size_t>(channels));
  for (long b = 0; b < batch; ++b) {
    const T* xb = x + b * steps_in * channels;
    T* yb = y + b * steps * channels;
    for (long t = 0; t < steps; ++t) {
      std::fill(row, row + channels, 0.0f);
      for (long k = 0; k < taps; ++k) {
        const long source = t + k - padding;
        const float* wr = weights + k * channels;
        if (source < 0 || source >= steps_in) {
          for (long c = 0; c < channels; ++c) {
            const float product = 0.0f * wr[c];
            row[c] = row[c] + product;
          }
          continue;
        }
        const T* xr = xb + source * channels;
        for (long c = 0; c < channels; ++c) {
          const float product = widen(xr[c]) * wr[c];
          row[c] = row[c] + product;
        }
      }
      for (long c = 0; c < channels; ++c) yb[t * channels + c] = T(row[c]);
    }
  }
}

class DepthwiseConv1d : public ReferenceKernel {
 public:
  DepthwiseConv1d(mx::Stream stream, int padding) : ReferenceKernel(stream, "depthwise_conv1d"), padding_(padding) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const mx::array& x = inputs[0];
    const mx::array& w = inputs[1];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    encode(inputs, out, [x = mx::array::unsafe_weak_copy(x), w = mx::array::unsafe_weak_copy(w),
                         out = mx::array::unsafe_weak_copy(out), padding = long(padding_)]() mutable {
      const long batch = x.shape(0), steps_in = x.shape(1), channels = x.shape(2), taps = w.shape(1);
      if (out.size() == 0) return;
      dispatch_float(out.dtype(), "depthwise_conv1d", [&](auto tag) {
        using T = decltype(tag);
        depthwise<T>(row_contiguous<T>(x, 0), row_contiguous<T>(w, 1), out.data<T>(), batch, steps_in, channels,
                     taps, padding);
      });
    });
  }

  Reference reference() override {
    const int padding = padding_;
    const auto s = stream();
    return [padding, s](const std::vector<mx::array>& in) {
      return std::vector<mx::array>{mx::conv1d(in[0], in[1], 1, padding, 1, in[0].shape(-1), s)};
    };
  }

  const char* name() const override {
    return "DepthwiseConv1d";
  }

  bool is_equivalent(const mx::Primitive& other) const override {
    return static_cast<const DepthwiseConv1d&>(other).padding_ == padding_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {{inputs[0].shape(0), inputs[0].shape(1) + 2 * padding_ - inputs[1].shape(1) + 1,
             inputs[0].shape(2)}};
  }

 private:
  int padding_;
};

mx::array depthwise_conv1d(const mx::array& x, const mx::array& w, int padding) {
  if (x.ndim() != 3 || w.ndim() != 3 || w.shape(2) != 1 || w.shape(0) != x.shape(2) ||
      w.shape(1) < 1 || padding < 0 || x.shape(1) + 2 * padding < w.shape(1)) {
    throw std::invalid_argument(
        "depthwise_conv1d: x must be (B, T, C) and w (C, K, 1) with 1 <= K <= T + 2 * padding");
  }
  if (x.dtype() != w.dtype() ||
      (x.dtype() != mx::float32 && x.dtype() != mx::bfloat16 && x.dtype() != mx::float16)) {
    throw std::invalid_argument("depthwise_conv1d: x and w must share one floating dtype");
  }
  mx::Stream stream = cpu_stream("depthwise_conv1d");
  mx::Shape shape = {x.shape(0), x.shape(1) + 2 * padding - w.shape(1) + 1, x.shape(2)};
  return mx::array(std::move(shape), x.dtype(), std::make_shared<DepthwiseConv1d>(stream, padding),
                   {x, w});
}

// ---------------------------------------------------------------------------------------
// rms_norm

// mx.fast.rms_norm on the CPU (its fallback graph): x32 = float32(x);
// y = T(x32 * rsqrt(sum(x32 * x32) * (1 / n) + eps)) * weight, the sum in order.
template <typename T>
void rms_rows(const T* x, const T* w, T* y, long rows, long n, float eps) {
  const float inverse = 1.0f / static_cast<float>(n);
  for (long r = 0; r < rows; ++r) {
    const T* xr = x + r * n;
    float sum = 0.0f;
    for (long i = 0; i < n; ++i) {
      const float v = widen(xr[i]);
      const float square = v * v;
      sum = sum + square;
    }
    const float mean = sum * inverse;
    const float scale = 1.0f / std::sqrt(mean + eps);
    T* yr = y + r * n;
    for (long i = 0; i < n; ++i) {
      const T normed = T(widen(xr[i]) * scale);
      yr[i] = T(widen(normed) * widen(w[i]));
    }
  }
}

template <>
void rms_rows<float>(const float* x, const float* w, float* y, long rows, long n, float eps) {
  const float inverse = 1.0f / static_cast<float>(n);
  for (long r = 0; r < rows; ++r) {
    const float* xr = x + r * n;
    float sum = 0.0f;
    for (long i = 0; i < n; ++i) {
      const float square = xr[i] * xr[i];
      sum = sum + square;
    }
    const float mean = sum * inverse;
    const float scale = 1.0f / std::sqrt(mean + eps);
    float* yr = y + r * n;
    for (long i = 0; i < n; ++i) {
      const float normed = xr[i] * scale;
      yr[i] = normed * w[i];
    }
  }
}

class RMSNormKernel : public ReferenceKernel {
 public:
  RMSNormKernel(mx::Stream stream, float eps) : ReferenceKernel(stream, "rms_norm"), eps_(eps) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const mx::array& x = inputs[0];
    const mx::array& w = inputs[1];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    encode(inputs, out, [x = mx::array::unsafe_weak_copy(x), w = mx::array::unsafe_weak_copy(w),
                         out = mx::array::unsafe_weak_copy(out), eps = eps_]() mutable {
      const long n = x.shape(-1);
      if (out.size() == 0 || n == 0) return;
      const long rows = static_cast<long>(out.size()) / n;
      dispatch_float(out.dtype(), "rms_norm", [&](auto tag) {
        using T = decltype(tag);
        rms_rows<T>(row_contiguous<T>(x, 0), row_contiguous<T>(w, 1), out.data<T>(), rows, n, eps);
      });
    });
  }

  const char* name() const override {
    return "RMSNormKernel";
  }

  bool is_equivalent(const mx::Primitive& other) const override {
    return static_cast<const RMSNormKernel&>(other).eps_ == eps_;
  }

  Reference reference() override {
    const float eps = eps_;
    const auto s = stream();
    return [eps, s](const std::vector<mx::array>& in) {
      return std::vector<mx::array>{mx::fast::rms_norm(in[0], in[1], eps, s)};
    };
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

 private:
  float eps_;
};

mx::array rms_norm(const mx::array& x, const mx::array& weight, float eps) {
  if (x.ndim() < 1 || weight.ndim() != 1 || weight.shape(0) != x.shape(-1)) {
    throw std::invalid_argument("rms_norm: weight must be a vector of x's last dimension");
  }
  if (x.dtype() != weight.dtype() ||
      (x.dtype() != mx::float32 && x.dtype() != mx::bfloat16 && x.dtype() != mx::float16)) {
    throw std::invalid_argument("rms_norm: x and weight must share one floating dtype");
  }
  mx::Stream stream = cpu_stream("rms_norm");
  return mx::array(x.shape(), x.dtype(), std::make_shared<RMSNormKernel>(stream, eps), {x, weight});
}

// ---------------------------------------------------------------------------------------
// softmax

// Per lane, MLX's CPU exp (mlx/backend/cpu/simd/math.h: exp(x) = 2^y, y = x * log2(e) split
// into an integer part, shifted into the exponent, and a fraction, the Cephes polynomial of
// six fused multiply-adds; NaN kept, above 88 infinity, below -88 zero), a vector at a time.
// MLX adds 0.5 in double before the floor; for the arguments whose result is kept
// (|x| <= 88, so |x * log2(e)| < 127) the float sum is exact, so the floor is the same.
inline vf floor_lanes(vf x) {
#if defined(__AVX512F__)
  return (vf)_mm512_roundscale_ps((__m512)x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
#elif defined(__AVX2__)
  return (vf)_mm256_floor_ps((__m256)x);
#else
  vf r;
  for (int lane = 0; lane < kLanes; ++lane) r[lane] = std::floor(x[lane]);
  return r;
#endif
}

inline vf fma_lanes(vf a, vf b, float c) {
#if defined(__AVX512F__)
  return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, _mm512_set1_ps(c));
#elif defined(__AVX2__)
  return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, _mm256_set1_ps(c));
#else
  vf r;
  for (int lane = 0; lane < kLanes; ++lane) r[lane] = std::fma(a[lane], b[lane], c);
  return r;
#endif
}

inline vf mlx_exp(vf x_init) {
  const vf x0 = x_init * 1.442695f;
  const vf ipart = floor_lanes(x0 + 0.5f);
  const vf fpart = x0 - ipart;
  vf x = broadcast(1.535336188319500e-4f);
  x = fma_lanes(x, fpart, 1.339887440266574e-3f);
  x = fma_lanes(x, fpart, 9.618437357674640e-3f);
  x = fma_lanes(x, fpart, 5.550332471162809e-2f);
  x = fma_lanes(x, fpart, 2.402264791363012e-1f);
  x = fma_lanes(x, fpart, 6.931472028550421e-1f);
  x = fma_lanes(x, fpart, 1.000000000000000f);
  const vi epart = (__builtin_convertvector(ipart, vi) + 127) << 23;
  vf result = (vf)epart * x;
  result = x_init != x_init ? x_init : result;
  result = x_init > 88.0f ? broadcast(std::numeric_limits<float>::infinity()) : result;
  result = x_init < -88.0f ? vf{} : result;
  return result;
}

inline float mlx_exp(float x) {
  vf v = vf{};
  v[0] = x;
  return mlx_exp(v)[0];
}

// mx.softmax(x, axis=-1, precise=True) on the CPU (MLX's Softmax with a float32
// accumulator; float32 rows the same with precise=False): per row the maximum taken in order
// as MLX's scalar `maximum(value, running)` takes it (a NaN value becomes the maximum), the
// exponentials e = exp(x - maximum) (computed a vector at a time, each lane as MLX's), their
// sum in order in float32, normalizer = 1 / sum, and T(e * normalizer). `exps`: row scratch.
template <typename T>
void softmax_rows(const T* x, T* y, long rows, long n, float* exps) {
  for (long r = 0; r < rows; ++r) {
    const T* xr = x + r * n;
    float maximum = -std::numeric_limits<float>::infinity();
    for (long i = 0; i < n; ++i) {
      const float value = widen(xr[i]);
      maximum = std::isnan(value) ? value : (value > maximum ? value : maximum);
    }
    long i = 0;
    for (; i + kLanes <= n; i += kLanes) {
      vf v;
      for (int lane = 0; lane < kLanes; ++lane) v[lane] = widen(xr[i + lane]);
      store(exps + i, mlx_exp(v - maximum));
    }
    for (; i < n; ++i) exps[i] = mlx_exp(widen(xr[i]) - maximum);
    float sum = 0.0f;
    for (long k = 0; k < n; ++k) sum = sum + exps[k];
    const float normalizer = 1.0f / sum;
    T* yr = y + r * n;
    for (long k = 0; k < n; ++k) yr[k] = T(exps[k] * normalizer);
  }
}

class SoftmaxKernel : public ReferenceKernel {
 public:
  explicit SoftmaxKernel(mx::Stream stream) : ReferenceKernel(stream, "softmax") {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const mx::array& x = inputs[0];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    encode(inputs, out, [x = mx::array::unsafe_weak_copy(x), out = mx::array::unsafe_weak_copy(out)]() mutable {
      const long n = x.shape(-1);
      if (out.size() == 0 || n == 0) return;
      const long rows = static_cast<long>(out.size()) / n;
      float* exps = scratch(kRowsScratch, static_cast<size_t>(n));
      dispatch_float(out.dtype(), "softmax", [&](auto tag) {
        using T = decltype(tag);
        softmax_rows<T>(row_contiguous<T>(x, 0), out.data<T>(), rows, n, exps);
      });
    });
  }

  const char* name() const override {
    return "SoftmaxKernel";
  }

  bool is_equivalent(const mx::Primitive&) const override {
    return true;
  }

  Reference reference() override {
    const auto s = stream();
    return [s](const std::vector<mx::array>& in) {
      return std::vector<mx::array>{mx::softmax(in[0], std::vector<int>{-1}, true, s)};
    };
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }
};

mx::array softmax(const mx::array& x) {
  if (x.ndim() < 1 || (x.dtype() != mx::float32 && x.dtype() != mx::bfloat16 && x.dtype() != mx::float16)) {
    throw std::invalid_argument("softmax: x must be a floating array of at least one dimension");
  }
  mx::Stream stream = cpu_stream("softmax");
  return mx::array(x.shape(), x.dtype(), std::make_shared<SoftmaxKernel>(stream), {x});
}

// ---------------------------------------------------------------------------------------
// rvq_encode

// Upstream RVQEARTTSModel._rvq_encode_step for codebooks [start, start + count): for each,
// distances = float(norms[q]) - 2 * (residual . books[q]) (the product summed in order over
// the latent axis, as mx.matmul sums it), the first minimum (or first NaN, as mx.argmin
// picks it), then residual -= float(embeddings[q][index]).
//
// Rows are independent, codebooks sequential within a row: the rows run in blocks of
// kRvqRows, and each codebook (latent x codes float32, 512 KB at the model's size) is read
// once per block, each of its latent rows applied to every row of the block while it is in
// cache (rather than streaming all codebooks once per row). Every row's sums keep their
// order (from zero, in order over the latent axis), so its indices are the same as alone.
constexpr long kRvqRows = 8;

typedef int32_t vlane __attribute__((vector_size(kLanes * sizeof(int32_t)), aligned(4)));

// The index mx.argmin picks among distance[c] = float(norm[c]) - 2 * sums[c], c < codes:
// the first NaN if there is one, else the first minimum (-0 and +0 equal). Each vector lane
// scans its own columns c = lane (mod kLanes) with that rule, then the lanes are merged
// (a NaN lane's index, else the least value's, the smallest index among equals), and the
// tail continues the scan in order: the same index as one in-order scan.
template <typename N>
uint32_t first_minimum(const N* norm, const float* sums, long codes) {
  long c = 0;
  float best = 0.0f;
  uint32_t index = 0;
  if (codes >= 2 * kLanes) {
    float widened[kLanes];
    auto distances = [&](long at) {
      for (int t = 0; t < kLanes; ++t) widened[t] = widen(norm[at + t]);
      return load(widened) - (vf{} + 2.0f) * load(sums + at);
    };
    vf lane_best = distances(0);
    vlane lane_index;
    for (int t = 0; t < kLanes; ++t) lane_index[t] = t;
    vlane here = lane_index;
    for (c = kLanes; c + kLanes <= codes; c += kLanes) {
      here = here + kLanes;
      const vf distance = distances(c);
      const vlane take = (distance < lane_best) | ((distance != distance) & (lane_best == lane_best));
      lane_best = take ? distance : lane_best;
      lane_index = take ? here : lane_index;
    }
    bool found_nan = false;
    for (int t = 0; t < kLanes; ++t) {
      const float value = lane_best[t];
      const uint32_t at = static_cast<uint32_t>(lane_index[t]);
      if (std::isnan(value)) {
        if (!found_nan || at < index) index = at;
        if (!found_nan) best = value;
        found_nan = true;
      } else if (!found_nan && (t == 0 || value < best || (value == best && at < index))) {
        best = value;
        index = at;
      }
    }
  } else {
    best = widen(norm[0]) - 2.0f * sums[0];
    c = 1;
  }
  for (; c < codes; ++c) {
    const float distance = widen(norm[c]) - 2.0f * sums[c];
    if (distance < best || (std::isnan(distance) && !std::isnan(best))) {
      best = distance;
      index = static_cast<uint32_t>(c);
    }
  }
  return index;
}

template <typename N, typename E>
void rvq_rows(const float* residual, long rows, long latent, const N* norms, const float* books,
              const E* embeddings, long codes, int start, int count, uint32_t* out) {
  const long block = std::min(rows, kRvqRows);
  float* r = scratch(kRowsScratch, static_cast<size_t>(block * latent));
  float* dot = scratch(kResultScratch, static_cast<size_t>(block * codes));
  for (long first = 0; first < rows; first += kRvqRows) {
    const long live = std::min(kRvqRows, rows - first);
    std::memcpy(r, residual + first * latent, sizeof(float) * live * latent);
    for (int q = start; q < start + count; ++q) {
      const float* book = books + static_cast<long>(q) * latent * codes;
      std::fill(dot, dot + live * codes, 0.0f);
      for (long k = 0; k < latent; ++k) {
        const float* column = book + k * codes;
        for (long row = 0; row < live; ++row) {
          const float rk = r[row * latent + k];
          float* sums = dot + row * codes;
          for (long c = 0; c < codes; ++c) {
            const float product = rk * column[c];
            sums[c] = sums[c] + product;
          }
        }
      }
      const N* norm = norms + static_cast<long>(q) * codes;
      for (long row = 0; row < live; ++row) {
        const uint32_t index = first_minimum(norm, dot + row * codes, codes);
        out[(first + row) * count + (q - start)] = index;
        const E* chosen = embeddings + (static_cast<long>(q) * codes + index) * latent;
        float* own = r + row * latent;
        for (long k = 0; k < latent; ++k) own[k] = own[k] - widen(chosen[k]);
      }
    }
  }
}

class RVQEncode : public NoDerivativeKernel {
 public:
  RVQEncode(mx::Stream stream, int start, int count)
      : NoDerivativeKernel(stream, "rvq_encode", mx::uint32), start_(start), count_(count) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    encode(inputs, out, [residual = mx::array::unsafe_weak_copy(inputs[0]),
                         norms = mx::array::unsafe_weak_copy(inputs[1]),
                         books = mx::array::unsafe_weak_copy(inputs[2]),
                         embeddings = mx::array::unsafe_weak_copy(inputs[3]),
                         out = mx::array::unsafe_weak_copy(out), start = start_, count = count_]() mutable {
      const long latent = residual.shape(-1);
      const long rows = latent == 0 ? 0 : static_cast<long>(residual.size()) / latent;
      const long codes = norms.shape(1);
      if (rows == 0 || count == 0) return;
      const float* r = row_contiguous<float>(residual, 0);
      const float* b = row_contiguous<float>(books, 1);
      uint32_t* o = out.data<uint32_t>();
      const bool norms16 = norms.dtype() == mx::bfloat16;
      const bool embs16 = embeddings.dtype() == mx::bfloat16;
      using bf = mx::bfloat16_t;
      if (norms16 && embs16) {
        rvq_rows(r, rows, latent, row_contiguous<bf>(norms, 2), b, row_contiguous<bf>(embeddings, 3), codes, start, count, o);
      } else if (norms16) {
        rvq_rows(r, rows, latent, row_contiguous<bf>(norms, 2), b, row_contiguous<float>(embeddings, 3), codes, start, count, o);
      } else if (embs16) {
        rvq_rows(r, rows, latent, row_contiguous<float>(norms, 2), b, row_contiguous<bf>(embeddings, 3), codes, start, count, o);
      } else {
        rvq_rows(r, rows, latent, row_contiguous<float>(norms, 2), b, row_contiguous<float>(embeddings, 3), codes, start, count, o);
      }
    });
  }

  const char* name() const override {
    return "RVQEncode";
  }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& that = static_cast<const RVQEncode&>(other);
    return that.start_ == start_ && that.count_ == count_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    mx::Shape shape = inputs[0].shape();
    shape.back() = count_;
    return {shape};
  }

 private:
  int start_;
  int count_;
};

mx::array rvq_encode(const mx::array& residual, const mx::array& norms, const mx::array& books,
                     const mx::array& embeddings, int start, int count) {
  if (residual.ndim() < 1 || residual.dtype() != mx::float32) {
    throw std::invalid_argument("rvq_encode: residual must be float32 (..., latent)");
  }
  if (norms.ndim() != 2 || books.ndim() != 3 || embeddings.ndim() != 3 || books.dtype() != mx::float32) {
    throw std::invalid_argument(
        "rvq_encode: norms (Q, C), books float32 (Q, latent, C), embeddings (Q, C, latent)");
  }
  const int Q = norms.shape(0), C = norms.shape(1), L = residual.shape(-1);
  if (books.shape(0) != Q || books.shape(1) != L || books.shape(2) != C || embeddings.shape(0) != Q ||
      embeddings.shape(1) != C || embeddings.shape(2) != L || C < 1) {
    throw std::invalid_argument("rvq_encode: table shapes do not match");
  }
  for (const auto* table : {&norms, &embeddings}) {
    if (table->dtype() != mx::float32 && table->dtype() != mx::bfloat16) {
      throw std::invalid_argument("rvq_encode: norms and embeddings must be float32 or bfloat16");
    }
  }
  if (start < 0 || count < 0 || start + count > Q) {
    throw std::invalid_argument("rvq_encode: codebooks [start, start + count) out of range");
  }
  mx::Stream stream = cpu_stream("rvq_encode");
  mx::Shape shape = residual.shape();
  shape.back() = count;
  return mx::array(std::move(shape), mx::uint32, std::make_shared<RVQEncode>(stream, start, count),
                   {residual, norms, books, embeddings});
}

// ---------------------------------------------------------------------------------------
// top_p_keep

// The mask of upstream nemotron_voicechat.tts._top_p_logits for probabilities p (a row of
// n): indices = argsort(p) (MLX's CPU argsort: ascending and stable, -0 equal to +0, NaNs
// last), mass_above[i] = the sum of p[indices[j]] for j > i, accumulated in float32 from
// the last j down (mx.cumsum(reverse=True, inclusive=False)), keep[indices[i]] =
// mass_above[i] < top_p. Here the sort is a stable radix sort of order-preserving 32-bit
// keys (so equal values keep their index order, as MLX's), then the same running sum.
void top_p_rows(const float* probs, long rows, long n, float top_p, bool* keep) {
  thread_local std::vector<uint32_t> keys, spare_keys, order, spare_order;
  keys.resize(n);
  spare_keys.resize(n);
  order.resize(n);
  spare_order.resize(n);
  for (long row = 0; row < rows; ++row) {
    const float* p = probs + row * n;
    for (long i = 0; i < n; ++i) {
      uint32_t bits;
      std::memcpy(&bits, p + i, sizeof(bits));
      if (std::isnan(p[i])) {
        bits = 0xFFFFFFFFu;
      } else {
        if (bits == 0x80000000u) bits = 0;  // -0 sorts with +0
        bits = (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
      }
      keys[i] = bits;
      order[i] = static_cast<uint32_t>(i);
    }
    uint32_t* key = keys.data();
    uint32_t* index = order.data();
    uint32_t* other_key = spare_keys.data();
    uint32_t* other_index = spare_order.data();
    for (int shift = 0; shift < 32; shift += 8) {  // least significant byte first: stable
      long count[257] = {0};
      for (long i = 0; i < n; ++i) ++count[((key[i] >> shift) & 0xFF) + 1];
      if (count[((key[0] >> shift) & 0xFF) + 1] == n) continue;  // one bucket: order unchanged
      for (int b = 0; b < 256; ++b) count[b + 1] += count[b];
      for (long i = 0; i < n; ++i) {
        const long at = count[(key[i] >> shift) & 0xFF]++;
        other_key[at] = key[i];
        other_index[at] = index[i];
      }
      std::swap(key, other_key);
      std::swap(index, other_index);
    }
    bool* out = keep + row * n;
    float above = 0.0f;
    for (long i = n - 1; i >= 0; --i) {
      out[index[i]] = above < top_p;
      above = above + p[index[i]];
    }
  }
}

class TopPKeep : public NoDerivativeKernel {
 public:
  TopPKeep(mx::Stream stream, float top_p) : NoDerivativeKernel(stream, "top_p_keep", mx::bool_), top_p_(top_p) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    encode(inputs, out, [probs = mx::array::unsafe_weak_copy(inputs[0]), out = mx::array::unsafe_weak_copy(out),
                         top_p = top_p_]() mutable {
      const long n = probs.ndim() == 0 ? 1 : probs.shape(-1);
      const long rows = n == 0 ? 0 : static_cast<long>(probs.size()) / n;
      if (rows == 0) return;
      top_p_rows(row_contiguous<float>(probs, 0), rows, n, top_p, out.data<bool>());
    });
  }

  const char* name() const override {
    return "TopPKeep";
  }

  bool is_equivalent(const mx::Primitive& other) const override {
    return static_cast<const TopPKeep&>(other).top_p_ == top_p_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

 private:
  float top_p_;
};

mx::array top_p_keep(const mx::array& probs, float top_p) {
  if (probs.ndim() < 1 || probs.dtype() != mx::float32) {
    throw std::invalid_argument("top_p_keep: probabilities must be float32 (..., n)");
  }
  mx::Stream stream = cpu_stream("top_p_keep");
  return mx::array(probs.shape(), mx::bool_, std::make_shared<TopPKeep>(stream, top_p), {probs});
}

// ---------------------------------------------------------------------------------------
// quantized_matmul

// MLX's CPU QuantizedMatmul (affine mode, transposed weight) runs the scalar loop _qmm_t
// (mlx/backend/cpu/quantized.cpp; its SIMD variant needs simd::max_size<T> > 1, which is 1
// off Apple silicon): for every row and output n, in the type T of x and the scales,
//
//   T sum = 0;
//   for k in 0..K-1:  sum += x[k] * (scale[n][k / g] * T(q[n][k]) + bias[n][k / g]);
//
// where every operation is one MLX scalar operation: float32 arithmetic for T = float32,
// and for bfloat16 / float16 (MLX's software half types off Apple silicon) the float32
// result of each multiply and each add rounded to T at once. q[n][k] is bits-wide, packed
// little-endian into the row's 32-bit words, lowest bits first. This kernel computes the
// same values in the same order, vectorised across output columns: a panel of kPanel
// outputs is dequantised once (rounded to T as MLX rounds it) and then every row of x runs
// against it, the products and sums rounded to T after each operation.

typedef uint32_t vu __attribute__((vector_size(kLanes * sizeof(float)), aligned(4)));
typedef int32_t vi __attribute__((vector_size(kLanes * sizeof(float)), aligned(4)));

// Bit reinterpretation between same-size vectors (GCC's vector casts).
template <typename V>
inline vu as_vu(V v) {
  return (vu)v;
}

template <typename V>
inline vf as_vf(V v) {
  return (vf)v;
}

inline vu select_bits(vu mask, vu yes, vu no) {
  return (yes & mask) | (no & ~mask);
}

inline vu splat(uint32_t v) {
  return vu{} + v;
}

inline vf splat_f(float v) {
  return vf{} + v;
}

// float -> T -> float on each lane, exactly as MLX's scalar conversions do it.
template <typename T>
struct RoundTo {
  static inline vf apply(vf x) {
    return x;
  }
};

// _MLX_BFloat16(float): NaN -> 0x7FC0; otherwise round to nearest even on the top 16 bits.
template <>
struct RoundTo<mx::bfloat16_t> {
  static inline vf apply(vf x) {
    const vu u = as_vu(x);
    vu r = (u + (((u >> 16) & 1u) + 0x7FFFu)) & 0xFFFF0000u;
    const vu nan = as_vu(x != x);
    r = select_bits(nan, splat(0x7FC00000u), r);
    return as_vf(r);
  }

  // The same rounding without the NaN case, for the sums' inner loop: there every operand
  // is a bfloat16 value (low 16 bits zero), so a NaN result carries such a payload too and
  // the rounding keeps it a NaN (only its sign/payload may differ from 0x7FC0); the final
  // conversion of the sum to bfloat16 (MLX's constructor) makes every NaN 0x7FC0, as MLX's
  // bfloat16 sum is.
  static inline vf finite(vf x) {
    const vu u = as_vu(x);
    const vu r = (u + (((u >> 16) & 1u) + 0x7FFFu)) & 0xFFFF0000u;
    return as_vf(r);
  }
};

// scale * q + bias in float32 with one rounding where that is what MLX's two give: a
// 16-bit scale (at most 11 significant bits) times a q of at most 8 bits is exact in
// float32 unless it overflows (the caller checks the group's scales), so only the
// addition rounds, and a fused multiply-add rounds exactly there.
template <typename S>
inline vf scale_q_plus_bias(vf scale, vf q, vf bias) {
#if defined(__AVX512F__)
  if constexpr (!std::is_same_v<S, float>) return (vf)_mm512_fmadd_ps((__m512)scale, (__m512)q, (__m512)bias);
#elif defined(__AVX2__)
  if constexpr (!std::is_same_v<S, float>) return (vf)_mm256_fmadd_ps((__m256)scale, (__m256)q, (__m256)bias);
#endif
  return scale * q + bias;
}

// The rounding inside qblock's sums (bfloat16: RoundTo::finite, see there).
template <typename T>
inline vf round_in_sum(vf x) {
  if constexpr (std::is_same_v<T, mx::bfloat16_t>) {
    return RoundTo<T>::finite(x);
  } else {
    return RoundTo<T>::apply(x);
  }
}

// _MLX_Float16(float) and its operator float() (the FP16 library's magic-number
// conversions, NaN -> sign | 0x7D00), lane by lane.
template <>
struct RoundTo<mx::float16_t> {
  static inline vf apply(vf x) {
    const vu u = as_vu(x);
    const vu sign16 = (u & 0x80000000u) >> 16;
    vu expo = u & 0x7f800000u;
    const vu low = as_vu(expo < 0x38800000u);
    expo = select_bits(low, splat(0x38800000u), expo) + (15u << 23);
    const vu absolute_bits = u & 0x7fffffffu;
    const vf absolute = as_vf(absolute_bits);
    const vf inf_scale = as_vf(splat(0x77800000u));
    const vf zero_scale = as_vf(splat(0x08800000u));
    vf magic = as_vf(expo);
    const vf scaled = absolute * inf_scale;
    magic = magic + scaled * zero_scale;
    const vu m = as_vu(magic);
    vu bits = sign16 | ((((m >> 13) & 0x7c00u) + (m & 0x0fffu)) & 0xFFFFu);
    const vu nan = as_vu(x != x);
    bits = select_bits(nan, sign16 | 0x7D00u, bits);
    // back to float
    const vu base = bits << 16;
    const vu two_base = base + base;
    const vu sign32 = base & 0x80000000u;
    vu small_bits = (126u << 23) | (two_base >> 17);
    vf small = as_vf(small_bits);
    small = small - 0.5f;
    vu large_bits = (0xE0u << 23) + (two_base >> 4);
    vf large = as_vf(large_bits);
    large = large * as_vf(splat(0x7800000u));
    const vu denormal = as_vu(two_base < (1u << 27));
    vu out = select_bits(denormal, as_vu(small), as_vu(large)) | sign32;
    return as_vf(out);
  }
};

// R rows of x (float32 values of T, row stride K) against one dequantised K x kPanel panel:
// acc = T(acc + T(x * w)) in order over k.
template <typename T, int R>
inline void qblock(const float* a, long K, const float* panel, float* out, long ldo, int width) {
  vf acc0[R], acc1[R];
  for (int r = 0; r < R; ++r) {
    acc0[r] = vf{};
    acc1[r] = vf{};
  }
  for (long k = 0; k < K; ++k) {
    const vf b0 = load(panel + k * kPanel);
    const vf b1 = load(panel + k * kPanel + kLanes);
    for (int r = 0; r < R; ++r) {
      const vf x = broadcast(a[r * K + k]);
      const vf p0 = round_in_sum<T>(x * b0);
      const vf p1 = round_in_sum<T>(x * b1);
      acc0[r] = round_in_sum<T>(acc0[r] + p0);
      acc1[r] = round_in_sum<T>(acc1[r] + p1);
    }
  }
  for (int r = 0; r < R; ++r) {
    float row[kPanel];
    store(row, acc0[r]);
    store(row + kLanes, acc1[r]);
    std::memcpy(out + r * ldo, row, sizeof(float) * width);
  }
}

// The packed words w[(n0 + j) * words + column] of lanes j in [0, live) (0 beyond), one
// vector: a hardware gather where there is one (a lane-by-lane copy through memory stalls
// on store forwarding).
inline vu gather_words(const uint32_t* w, long words, long n0, long column, int live) {
  if (live <= 0) return vu{};
#if defined(__AVX512F__)
  const __m512i index = _mm512_mullo_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), _mm512_set1_epi32(static_cast<int>(words)));
  const int* base = reinterpret_cast<const int*>(w + n0 * words + column);
  if (live >= kLanes) return (vu)_mm512_i32gather_epi32(index, base, 4);
  const __mmask16 mask = static_cast<__mmask16>((1u << live) - 1u);
  return (vu)_mm512_mask_i32gather_epi32(_mm512_setzero_si512(), mask, index, base, 4);
#elif defined(__AVX2__)
  const __m256i index =
      _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(static_cast<int>(words)));
  const int* base = reinterpret_cast<const int*>(w + n0 * words + column);
  if (live >= kLanes) return (vu)_mm256_i32gather_epi32(base, index, 4);
  const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(live), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  return (vu)_mm256_mask_i32gather_epi32(_mm256_setzero_si256(), base, index, mask, 4);
#else
  alignas(64) uint32_t lanes[kLanes];
  for (int j = 0; j < kLanes; ++j) lanes[j] = j < live ? w[(n0 + j) * words + column] : 0u;
  return *reinterpret_cast<const vu*>(lanes);
#endif
}

// Dequantise outputs [n0, n0 + width) of the packed weight into panel (K x kPanel, float32
// values of T): T(T(scale * q) + bias), as MLX computes it inside its sum.
// ``sink(k, d0, d1)`` receives the panel's row k (two vectors) in order of k.
template <typename T, typename S, int bits, int group, typename Sink>
inline void dequantize(const uint32_t* w, const S* scales, const S* biases, long n0, int width, long K,
                       Sink& sink) {
  constexpr int per_word = 32 / bits;
  constexpr uint32_t mask = (1u << bits) - 1u;
  constexpr int words_per_group = group / per_word;
  const long words = K / per_word;
  const long groups = K / group;
  alignas(64) float scale_lanes[kPanel];
  alignas(64) float bias_lanes[kPanel];
  for (long gi = 0; gi < groups; ++gi) {
    for (int j = 0; j < kPanel; ++j) {
      const bool live = j < width;
      scale_lanes[j] = live ? widen(scales[(n0 + j) * groups + gi]) : 0.0f;
      bias_lanes[j] = live ? widen(biases[(n0 + j) * groups + gi]) : 0.0f;
    }
    const vf s0 = load(scale_lanes), s1 = load(scale_lanes + kLanes);
    const vf c0 = load(bias_lanes), c1 = load(bias_lanes + kLanes);
    // fused only where scale * q cannot overflow (also false for NaN / infinite scales)
    bool fused = !std::is_same_v<S, float>;
    for (int j = 0; fused && j < kPanel; ++j) fused = std::fabs(scale_lanes[j]) <= 1e36f;
    for (int word = 0; word < words_per_group; ++word) {
      const long column = gi * words_per_group + word;
      const vu w0 = gather_words(w, words, n0, column, width);
      const vu w1 = gather_words(w, words, n0 + kLanes, column, width - kLanes);
      for (int p = 0; p < per_word; ++p) {
        // signed conversion (AVX2 has no unsigned one): the values fit in 8 bits
        const vf q0 = __builtin_convertvector((vi)((w0 >> (bits * p)) & mask), vf);
        const vf q1 = __builtin_convertvector((vi)((w1 >> (bits * p)) & mask), vf);
        vf d0, d1;
        if (std::is_same_v<T, float> && fused) {
          d0 = scale_q_plus_bias<S>(s0, q0, c0);
          d1 = scale_q_plus_bias<S>(s1, q1, c1);
        } else {
          d0 = RoundTo<T>::apply(RoundTo<T>::apply(s0 * q0) + c0);
          d1 = RoundTo<T>::apply(RoundTo<T>::apply(s1 * q1) + c1);
        }
        sink(column * per_word + p, d0, d1);
      }
    }
  }
}

// Stores the dequantised rows into a K x kPanel panel.
struct PanelSink {
  float* panel;
  inline void operator()(long k, vf d0, vf d1) {
    store(panel + k * kPanel, d0);
    store(panel + k * kPanel + kLanes, d1);
  }
};

// Few rows: each dequantised row goes straight into R rows' sums (qblock's operations, no
// panel in memory).
template <typename T, int R>
struct RowsSink {
  const float* a;
  long K;
  vf acc0[R], acc1[R];
  inline void operator()(long k, vf d0, vf d1) {
    for (int r = 0; r < R; ++r) {
      const vf x = broadcast(a[r * K + k]);
      const vf p0 = round_in_sum<T>(x * d0);
      const vf p1 = round_in_sum<T>(x * d1);
      acc0[r] = round_in_sum<T>(acc0[r] + p0);
      acc1[r] = round_in_sum<T>(acc1[r] + p1);
    }
  }
};

template <typename T, typename S, int bits, int group, int R>
void fused_rows(const float* x, const uint32_t* w, const S* scales, const S* biases, long n0, int width, long K,
                float* out, long ldo) {
  RowsSink<T, R> sink{x, K, {}, {}};
  for (int r = 0; r < R; ++r) {
    sink.acc0[r] = vf{};
    sink.acc1[r] = vf{};
  }
  dequantize<T, S, bits, group>(w, scales, biases, n0, width, K, sink);
  for (int r = 0; r < R; ++r) {
    float row[kPanel];
    store(row, sink.acc0[r]);
    store(row + kLanes, sink.acc1[r]);
    std::memcpy(out + r * ldo, row, sizeof(float) * width);
  }
}

// out (M x N, float32 values of T) for x (M x K float32 values of T).
template <typename T, typename S, int bits, int group>
void quantized_product(const float* x, const uint32_t* w, const S* scales, const S* biases, long M, long N,
                       long K, float* out) {
  if (M <= 2) {  // a streamed frame's one or two rows: no panel
    for (long j = 0; j < N; j += kPanel) {
      const int width = static_cast<int>(std::min<long>(kPanel, N - j));
      if (M == 2) {
        fused_rows<T, S, bits, group, 2>(x, w, scales, biases, j, width, K, out + j, N);
      } else {
        fused_rows<T, S, bits, group, 1>(x, w, scales, biases, j, width, K, out + j, N);
      }
    }
    return;
  }
  float* const panel = scratch(kPanelScratch, static_cast<size_t>(std::max<long>(K, 1)) * kPanel);
  for (long j = 0; j < N; j += kPanel) {
    const int width = static_cast<int>(std::min<long>(kPanel, N - j));
    PanelSink sink{panel};
    dequantize<T, S, bits, group>(w, scales, biases, j, width, K, sink);
    long i = 0;
    for (; i + kRows <= M; i += kRows) qblock<T, kRows>(x + i * K, K, panel, out + i * N + j, N, width);
    switch (M - i) {
      case 3:
        qblock<T, 3>(x + i * K, K, panel, out + i * N + j, N, width);
        break;
      case 2:
        qblock<T, 2>(x + i * K, K, panel, out + i * N + j, N, width);
        break;
      case 1:
        qblock<T, 1>(x + i * K, K, panel, out + i * N + j, N, width);
        break;
      default:
        break;
    }
  }
}

template <typename T, typename S>
void run_quantized(const mx::array& x, const mx::array& w, const mx::array& scales, const mx::array& biases,
                   mx::array& out, int group, int bits) {
  const long K = x.shape(-1);
  const long N = out.shape(-1);
  const long M = K == 0 ? static_cast<long>(out.size() / std::max<long>(N, 1)) : static_cast<long>(x.size() / K);
  if (M == 0 || N == 0) return;
  T* po = out.data<T>();
  float* result = nullptr;
  if constexpr (std::is_same_v<T, float>) {
    result = po;
  } else {
    result = scratch(kResultScratch, static_cast<size_t>(M) * N);
  }
  if (K == 0) {
    std::fill(result, result + M * N, 0.0f);
  } else {
    const T* px = row_contiguous<T>(x, 0);
    const float* x32 = nullptr;
    if constexpr (std::is_same_v<T, float>) {
      x32 = px;
    } else {
      float* rows = scratch(kRowsScratch, static_cast<size_t>(M) * K);
      for (long i = 0; i < M * K; ++i) rows[i] = widen(px[i]);
      x32 = rows;
    }
    const uint32_t* pw = row_contiguous<uint32_t>(w, 1);
    const S* ps = row_contiguous<S>(scales, 2);
    const S* pb = row_contiguous<S>(biases, 3);
    auto with = [&](auto bits_tag, auto group_tag) {
      quantized_product<T, S, decltype(bits_tag)::value, decltype(group_tag)::value>(x32, pw, ps, pb, M, N, K,
                                                                                     result);
    };
    auto with_group = [&](auto bits_tag) {
      switch (group) {
        case 32:
          return with(bits_tag, std::integral_constant<int, 32>{});
        case 64:
          return with(bits_tag, std::integral_constant<int, 64>{});
        default:
          return with(bits_tag, std::integral_constant<int, 128>{});
      }
    };
    switch (bits) {
      case 2:
        with_group(std::integral_constant<int, 2>{});
        break;
      case 4:
        with_group(std::integral_constant<int, 4>{});
        break;
      default:
        with_group(std::integral_constant<int, 8>{});
        break;
    }
  }
  if constexpr (!std::is_same_v<T, float>) {
    for (long i = 0; i < M * N; ++i) po[i] = T(result[i]);
  }
}

class QuantizedMatmulKernel : public CpuKernel {
 public:
  QuantizedMatmulKernel(mx::Stream stream, int group, int bits)
      : CpuKernel(stream, "quantized_matmul"), group_(group), bits_(bits) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    encode(inputs, out, [x = mx::array::unsafe_weak_copy(inputs[0]), w = mx::array::unsafe_weak_copy(inputs[1]),
                         scales = mx::array::unsafe_weak_copy(inputs[2]),
                         biases = mx::array::unsafe_weak_copy(inputs[3]), out = mx::array::unsafe_weak_copy(out),
                         group = group_, bits = bits_]() mutable {
      dispatch_float(out.dtype(), "quantized_matmul", [&](auto tag) {
        using T = decltype(tag);
        if (scales.dtype() == out.dtype()) {
          run_quantized<T, T>(x, w, scales, biases, out, group, bits);
        } else if constexpr (std::is_same_v<T, float>) {  // 16-bit scales widened exactly
          if (scales.dtype() == mx::bfloat16) {
            run_quantized<float, mx::bfloat16_t>(x, w, scales, biases, out, group, bits);
          } else {
            run_quantized<float, mx::float16_t>(x, w, scales, biases, out, group, bits);
          }
        }
      });
    });
  }

  // Differentiates as mx.quantized_matmul (with respect to x, scales and biases; MLX
  // refuses the packed weight).
  std::vector<mx::array> vjp(const std::vector<mx::array>& primals, const std::vector<mx::array>& cotangents,
                             const std::vector<int>& argnums, const std::vector<mx::array>&) override {
    std::vector<mx::array> grads;
    for (int arg : argnums) grads.push_back(mx::vjp(reference(primals, arg), {primals[arg]}, cotangents).second[0]);
    return grads;
  }

  std::vector<mx::array> jvp(const std::vector<mx::array>& primals, const std::vector<mx::array>& tangents,
                             const std::vector<int>& argnums) override {
    std::optional<mx::array> total;
    for (size_t i = 0; i < argnums.size(); ++i) {
      auto part = mx::jvp(reference(primals, argnums[i]), {primals[argnums[i]]}, {tangents[i]}).second[0];
      total = total.has_value() ? mx::add(*total, part, stream()) : part;
    }
    return {*total};
  }

  const char* name() const override {
    return "QuantizedMatmulKernel";
  }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& that = static_cast<const QuantizedMatmulKernel&>(other);
    return that.group_ == group_ && that.bits_ == bits_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    mx::Shape shape = inputs[0].shape();
    shape.back() = inputs[1].shape(0);
    return {shape};
  }

 private:
  Reference reference(const std::vector<mx::array>& primals, int arg) {
    const int group = group_, bits = bits_;
    const auto s = stream();
    return [primals, arg, group, bits, s](const std::vector<mx::array>& in) {
      std::vector<mx::array> all = primals;
      all[arg] = in[0];
      return std::vector<mx::array>{
          mx::quantized_matmul(all[0], all[1], all[2], all[3], true, group, bits, "affine", s)};
    };
  }

  int group_;
  int bits_;
};

mx::array quantized_matmul(const mx::array& x, const mx::array& w, const mx::array& scales,
                           const mx::array& biases, int group_size, int bits) {
  if (bits != 2 && bits != 4 && bits != 8) {
    throw std::invalid_argument("quantized_matmul: bits must be 2, 4 or 8, got " + std::to_string(bits));
  }
  if (group_size != 32 && group_size != 64 && group_size != 128) {
    throw std::invalid_argument("quantized_matmul: group_size must be 32, 64 or 128, got " +
                                std::to_string(group_size));
  }
  if (x.ndim() < 1 || w.ndim() != 2 || w.dtype() != mx::uint32 || scales.ndim() != 2 ||
      biases.shape() != scales.shape() || biases.dtype() != scales.dtype()) {
    throw std::invalid_argument(
        "quantized_matmul: x (..., K), w uint32 (N, K * bits / 32), scales and biases (N, K / group_size) "
        "of one dtype");
  }
  const long K = static_cast<long>(w.shape(1)) * (32 / bits);
  if (x.shape(-1) != K || scales.shape(0) != w.shape(0) || scales.shape(1) * group_size != K) {
    throw std::invalid_argument("quantized_matmul: shapes do not match (x " + std::to_string(x.shape(-1)) +
                                " wide, weight unpacks to " + std::to_string(K) + ")");
  }
  const auto floating = [](mx::Dtype d) { return d == mx::float32 || d == mx::bfloat16 || d == mx::float16; };
  if (!floating(x.dtype()) || !(scales.dtype() == x.dtype() || (x.dtype() == mx::float32 && floating(scales.dtype())))) {
    throw std::invalid_argument(
        "quantized_matmul: x float32/bfloat16/float16 with scales of its dtype (or float32 x with 16-bit scales)");
  }
  mx::Stream stream = cpu_stream("quantized_matmul");
  mx::Shape shape = x.shape();
  shape.back() = w.shape(0);
  return mx::array(std::move(shape), x.dtype(), std::make_shared<QuantizedMatmulKernel>(stream, group_size, bits),
                   {x, w, scales, biases});
}

}  // namespace

NB_MODULE(_kernels, m) {
  m.doc() = "Exact CPU kernels for MLX (bit-identical to the MLX operations they replace).";
  m.attr("isa") = VOICECHAT_ISA;
  m.attr("lanes") = kLanes;
  m.def("exact_matmul", &exact_matmul, nb::arg("a"), nb::arg("b"), nb::arg("bias") = nb::none(),
        nb::arg("transpose") = false,
        "a (..., K) @ b (K, N) [+ bias (N,)] -> (..., N), one dtype (b given as (N, K) when\n"
        "transpose); bit-identical to\n"
        "mx.matmul(a, b) (float32: (a @ b) + bias; bfloat16/float16: mx.addmm(bias, a, b))\n"
        "on the CPU.");
  m.def("softmax", &softmax, nb::arg("x"),
        "mx.softmax(x, axis=-1, precise=True) on the CPU (float32, bfloat16, float16).");
  m.def("rms_norm", &rms_norm, nb::arg("x"), nb::arg("weight"), nb::arg("eps"),
        "mx.fast.rms_norm(x, weight, eps) on the CPU, x and weight of one dtype.");
  m.def("rvq_encode", &rvq_encode, nb::arg("residual"), nb::arg("norms"), nb::arg("books"),
        nb::arg("embeddings"), nb::arg("start"), nb::arg("count"),
        "Nearest-codeword residual quantisation over codebooks [start, start + count).");
  m.def("top_p_keep", &top_p_keep, nb::arg("probs"), nb::arg("top_p"),
        "The keep mask of nemotron_voicechat's _top_p_logits for float32 probabilities (..., n).");
  m.def("lookup16", &lookup16, nb::arg("x"), nb::arg("table"),
        "table[bits(x)] for bfloat16/float16 x and a (65536,) table of the same dtype.");
  m.def("quantized_matmul", &quantized_matmul, nb::arg("x"), nb::arg("w"), nb::arg("scales"),
        nb::arg("biases"), nb::arg("group_size"), nb::arg("bits"),
        "mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size, bits, mode='affine')\n"
        "on the CPU, bits 2/4/8, group sizes 32/64/128, bit for bit.");
  m.def("depthwise_conv1d", &depthwise_conv1d, nb::arg("x"), nb::arg("w"), nb::arg("padding") = 0,
        "mx.conv1d(x, w, padding=padding, groups=C) for x (B, T, C), w (C, K, 1), stride 1.");
}
