// A matmul for few rows on CPUs, an XLA FFI custom call: the layers' projections of decode steps on a CPU
// (pallas_kernels/skinny_matmul_cpu.py loads it; setup.py builds it at install time).
//
//   x    float32 [M, K]      the step's rows (M small: a decode step's token bucket)
//   w    float32 [N, K]      an out-major weight (HF's layout; sarathi_jax/models/out_major.py)
//   out  float32 [M, N]      out[m, n] = sum_k x[m, k] * w[n, k]
//
// Why: XLA:CPU's dot (YNNPACK) packs an operand into its tile layout on every call; with a few rows the step
// is bound by reading the weights, and the packing pass and per-call overheads cost as much again. This
// kernel reads each weight row once, in place, in address order:
//   * the work is split into units of kUnitCols weight rows (output columns), handed out to the calling
//     thread and XLA's intra-op thread pool (work_sharing.h);
//   * inside a unit, blocks of kCols weight rows (kCols x K floats, L1-resident) meet every block of kRows
//     rows of x in turn: kRows x kCols accumulators of 16 floats (lane-wise partial dot products over K in
//     steps of 16), reduced across lanes once per block (sum4); K's tail (K % 16) is added in scalar code.
// Sums run in another order than XLA's dot (float32 rounding apart, the same products).

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "work_sharing.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

#if defined(__AVX512F__)
constexpr int kRows = 4;  // rows of x per register block: kRows x kCols accumulators of 16 floats (16 zmm)
constexpr int kVectorBits = 512;
#else
constexpr int kRows = 2;  // AVX2 and others: a 16-float vector takes two of 16 registers
constexpr int kVectorBits = 256;
#endif
constexpr int kCols = 4;        // weight rows per register block (sum4 reduces four at a time)
constexpr int kUnitCols = 64;   // weight rows per unit of work

inline v16f load(const float* p) {
  v16f v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// out[j] = the sum of a[j]'s 16 lanes, j < 4: halves, quarters, then pairs, four vectors at a time.
inline void sum4(const v16f a[kCols], float out[kCols]) {
  const v16i lo{0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
  const v16i hi{8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
  const v16f s01 = __builtin_shuffle(a[0], a[1], lo) + __builtin_shuffle(a[0], a[1], hi);  // 8 lanes of a0, a1
  const v16f s23 = __builtin_shuffle(a[2], a[3], lo) + __builtin_shuffle(a[2], a[3], hi);
  const v16i lo2{0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
  const v16i hi2{4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
  const v16f u = __builtin_shuffle(s01, s23, lo2) + __builtin_shuffle(s01, s23, hi2);  // 4 lanes of each
  const v16f v = u + __builtin_shuffle(u, v16i{2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
  const v16f s = v + __builtin_shuffle(v, v16i{1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14});
  out[0] = s[0], out[1] = s[4], out[2] = s[8], out[3] = s[12];
}

// out[i, j] for R rows of x (from x) and C weight rows (from w), R <= kRows, C <= kCols.
template <int R, int C>
inline void block(const float* x, const float* w, float* out, int64_t K, int64_t N) {
  v16f acc[R][kCols] = {};  // columns past C stay zero (sum4 reads kCols)
  const int64_t k_vec = K / 16 * 16;
  for (int64_t k = 0; k < k_vec; k += 16) {
    v16f wv[C];
    for (int j = 0; j < C; ++j) wv[j] = load(w + j * K + k);
    for (int i = 0; i < R; ++i) {
      const v16f xv = load(x + i * K + k);
      for (int j = 0; j < C; ++j) acc[i][j] += xv * wv[j];
    }
  }
  for (int i = 0; i < R; ++i) {
    float sums[kCols];
    sum4(acc[i], sums);
    for (int j = 0; j < C; ++j) {
      float t = sums[j];
      for (int64_t k = k_vec; k < K; ++k) t += x[i * K + k] * w[j * K + k];
      out[i * N + j] = t;
    }
  }
}

// C weight rows against every row of x.
template <int C>
void weight_rows(const float* x, const float* w, float* out, int64_t M, int64_t K, int64_t N) {
  int64_t m = 0;
  for (; m + kRows <= M; m += kRows) block<kRows, C>(x + m * K, w, out + m * N, K, N);
  const int64_t left = M - m;
  if (left == 1) block<1, C>(x + m * K, w, out + m * N, K, N);
#if defined(__AVX512F__)
  if (left == 2) block<2, C>(x + m * K, w, out + m * N, K, N);
  if (left == 3) block<3, C>(x + m * K, w, out + m * N, K, N);
#endif
}

// Output columns n0 .. n1 - 1.
void unit(const float* x, const float* w, float* out, int64_t M, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + kCols <= n1; n += kCols) weight_rows<kCols>(x, w + n * K, out + n, M, K, N);
  const int64_t left = n1 - n;
  if (left == 1) weight_rows<1>(x, w + n * K, out + n, M, K, N);
  if (left == 2) weight_rows<2>(x, w + n * K, out + n, M, K, N);
  if (left == 3) weight_rows<3>(x, w + n * K, out + n, M, K, N);
}

ffi::Error SkinnyMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                            ffi::ResultBuffer<ffi::F32> out) {
  auto xd = x.dimensions(), wd = w.dimensions(), od = out->dimensions();
  if (xd.size() != 2 || wd.size() != 2 || od.size() != 2 || xd[1] != wd[1] || od[0] != xd[0] || od[1] != wd[0])
    return ffi::Error::InvalidArgument("skinny_matmul_cpu: x must be [M, K], w [N, K] and out [M, N]");
  const int64_t M = xd[0], K = xd[1], N = wd[0];
  if (M == 0 || N == 0) return ffi::Error::Success();
  if (K == 0) {
    std::memset(out->untyped_data(), 0, out->size_bytes());
    return ffi::Error::Success();
  }
  const float* xp = x.typed_data();
  const float* wp = w.typed_data();
  float* op = out->typed_data();
  sarathi_cpu::share_work(pool, (N + kUnitCols - 1) / kUnitCols, [=](int64_t u) {
    unit(xp, wp, op, M, K, N, u * kUnitCols, std::min(N, (u + 1) * kUnitCols));
  });
  return ffi::Error::Success();
}

}  // namespace

// The exported symbols (the library is built with -fvisibility=hidden).
extern "C" __attribute__((visibility("default"))) XLA_FFI_Error* SarathiSkinnyMatmul(XLA_FFI_CallFrame*);

// The vector width the library was built for (512 with AVX-512, else 256): the engine uses the kernel only
// where it was measured to help (skinny_matmul_cpu.py).
extern "C" __attribute__((visibility("default"))) int SarathiSkinnyMatmulVectorBits() { return kVectorBits; }

XLA_FFI_DEFINE_HANDLER_SYMBOL(SarathiSkinnyMatmul, SkinnyMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()    // x [M, K]
                                  .Arg<ffi::Buffer<ffi::F32>>()    // w [N, K]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // out [M, N]
