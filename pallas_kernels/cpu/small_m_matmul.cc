// A small-M matmul for CPUs, an XLA FFI custom call: y [M, N] = x [M, K] @ w [K, N], float32 or bfloat16 (one
// dtype for all three; float32 accumulation). pallas_kernels/cpu_matmul.py loads it; setup.py builds it.
//
// Why: XLA:CPU hands a dot to YNNPACK, which packs the right operand (here the weight) into its own tile layout
// on every call. A decode step's layer matmuls have M = 1-32 rows, so that copy costs as much as the product.
// This kernel reads w where it lies, once per call (each panel of 64 columns is streamed from memory by the
// first block of rows and served from L2 to the others), with no packing.
//
// Work: a panel of 64 columns with AVX-512, 16 with AVX2 (the last one narrower), for all M rows, is one unit;
// units are handed out from an atomic counter to the calling thread and XLA's intra-op thread pool. Inside a
// panel, blocks of up to 6 rows keep their float32 accumulators in registers over the whole K loop, each
// weight vector loaded once per k and used by every row of the block. Rows of w are a panel's width apart in memory, so the next
// rows are prefetched by software. Each output element is one in-order sum over k (fused multiply-adds).

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// One vector register of float32: 16 lanes with AVX-512 (32 registers), else 8 (AVX2: 16 registers). A row
// block keeps 6 x kPanelVectors accumulators, plus the panel's weight vectors and a broadcast, in registers.
#ifdef __AVX512F__
constexpr int kLanes = 16;
constexpr int kPanelVectors = 4;  // 24 accumulators + 4 weight vectors of 32 registers
#else
constexpr int kLanes = 8;
constexpr int kPanelVectors = 2;  // 12 accumulators + 2 weight vectors + 1 broadcast of 16 registers
#endif
typedef float vf __attribute__((vector_size(4 * kLanes)));
constexpr int kPanel = kLanes * kPanelVectors;
constexpr int kRowBlock = 6;
constexpr int64_t kMaxUnitCols = 256;

// Element types: float, or bfloat16 stored as uint16_t.
inline float to_f32(float x) { return x; }
inline float to_f32(uint16_t x) {
  uint32_t bits = uint32_t(x) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
inline void from_f32(float x, float* out) { *out = x; }
inline void from_f32(float x, uint16_t* out) {  // round to nearest even
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) {
    *out = uint16_t((bits >> 16) | 0x40);  // quiet NaN
    return;
  }
  *out = uint16_t((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

// One vector of elements of type T as float32 (bfloat16: the bits shifted into place), and back.
inline vf load_vec(const float* p) {
  vf x;
  std::memcpy(&x, p, sizeof(x));
  return x;
}
inline vf load_vec(const uint16_t* p) {
  typedef uint16_t vh __attribute__((vector_size(2 * kLanes)));
  typedef uint32_t vu __attribute__((vector_size(4 * kLanes)));
  vh h;
  std::memcpy(&h, p, sizeof(h));
  return (vf)(__builtin_convertvector(h, vu) << 16);
}
inline void store_vec(float* p, vf x) { std::memcpy(p, &x, sizeof(x)); }
inline void store_vec(uint16_t* p, vf x) {
  for (int l = 0; l < kLanes; ++l) from_f32(x[l], p + l);
}

struct Dims {
  int64_t m, k, n;
  int64_t unit_cols;  // columns of y per unit of work (a multiple of kPanel)
};

constexpr int64_t kBlockRows = 32;  // rows of w per block: a block of a unit stays in L1 for all row blocks

// acc[MB rows][kPanel columns] (a float32 scratch of `ld` columns) += x rows m0.. x w[k0:k1, n0 : n0 + kPanel].
template <typename T, int MB>
inline void tile(const Dims& d, const T* x, const T* w, float* acc, int64_t ld, int64_t m0, int64_t n0, int64_t k0,
                 int64_t k1, int64_t acc_col) {
  vf a[MB][kPanelVectors];
  for (int r = 0; r < MB; ++r)
    for (int j = 0; j < kPanelVectors; ++j) a[r][j] = load_vec(acc + (m0 + r) * ld + acc_col + j * kLanes);
  const T* xr = x + m0 * d.k;
  const T* wk = w + k0 * d.n + n0;
  for (int64_t k = k0; k < k1; ++k, wk += d.n) {
    vf wv[kPanelVectors];
    for (int j = 0; j < kPanelVectors; ++j) wv[j] = load_vec(wk + j * kLanes);
    for (int r = 0; r < MB; ++r) {
      const float s = to_f32(xr[r * d.k + k]);
      for (int j = 0; j < kPanelVectors; ++j) a[r][j] += wv[j] * s;
    }
  }
  for (int r = 0; r < MB; ++r)
    for (int j = 0; j < kPanelVectors; ++j) store_vec(acc + (m0 + r) * ld + acc_col + j * kLanes, a[r][j]);
}

// Columns c0 .. c1 - 1 of y (c1 - c0 a multiple of kPanel), all rows: blocks of kBlockRows rows of w, each
// read from memory in whole rows of the unit (contiguous runs of c1 - c0 elements, the next block prefetched)
// and then used from L1 by every row block of x; float32 accumulators in `acc` between blocks.
template <typename T>
void unit_panels(const Dims& d, const T* x, const T* w, T* y, int64_t c0, int64_t c1) {
  thread_local std::vector<float> scratch;
  const int64_t ld = c1 - c0;
  scratch.assign(size_t(d.m * ld), 0.0f);
  float* acc = scratch.data();
  const int64_t row_bytes = ld * int64_t(sizeof(T));
  for (int64_t k0 = 0; k0 < d.k; k0 += kBlockRows) {
    const int64_t k1 = std::min(d.k, k0 + kBlockRows);
    for (int64_t k = k1; k < std::min(d.k, k1 + kBlockRows); ++k) {
      const char* row = reinterpret_cast<const char*>(w + k * d.n + c0);
      for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(row + b, 0, 3);
    }
    for (int64_t n0 = c0; n0 < c1; n0 += kPanel)
      for (int64_t m0 = 0; m0 < d.m; m0 += kRowBlock) {
        switch (std::min<int64_t>(kRowBlock, d.m - m0)) {
          case 1: tile<T, 1>(d, x, w, acc, ld, m0, n0, k0, k1, n0 - c0); break;
          case 2: tile<T, 2>(d, x, w, acc, ld, m0, n0, k0, k1, n0 - c0); break;
          case 3: tile<T, 3>(d, x, w, acc, ld, m0, n0, k0, k1, n0 - c0); break;
          case 4: tile<T, 4>(d, x, w, acc, ld, m0, n0, k0, k1, n0 - c0); break;
          case 5: tile<T, 5>(d, x, w, acc, ld, m0, n0, k0, k1, n0 - c0); break;
          default: tile<T, 6>(d, x, w, acc, ld, m0, n0, k0, k1, n0 - c0); break;
        }
      }
  }
  for (int64_t i = 0; i < d.m; ++i)
    for (int64_t c = 0; c < ld; ++c) from_f32(acc[i * ld + c], y + i * d.n + c0 + c);
}

// Columns past the last whole panel (n % kPanel of them): one scalar sum each.
template <typename T>
void tail_columns(const Dims& d, const T* x, const T* w, T* y, int64_t n0) {
  for (int64_t i = 0; i < d.m; ++i)
    for (int64_t c = n0; c < d.n; ++c) {
      float acc = 0.0f;
      for (int64_t k = 0; k < d.k; ++k) acc += to_f32(x[i * d.k + k]) * to_f32(w[k * d.n + c]);
      from_f32(acc, y + i * d.n + c);
    }
}

template <typename T>
void run_unit(const Dims& d, const T* x, const T* w, T* y, int64_t u) {
  const int64_t whole = d.n / kPanel * kPanel;
  const int64_t c0 = u * d.unit_cols;
  const int64_t c1 = std::min(whole, c0 + d.unit_cols);
  if (c0 < c1) unit_panels(d, x, w, y, c0, c1);
  if (c0 + d.unit_cols >= d.n && whole < d.n) tail_columns(d, x, w, y, whole);
}

template <typename T>
ffi::Error Matmul(ffi::ThreadPool pool, const Dims& d, const T* x, const T* w, T* y) {
  const int64_t num_threads = std::max<int64_t>(pool.num_threads(), 1);
  const int64_t num_units = (d.n + d.unit_cols - 1) / d.unit_cols;
  // Work sharing as in the attention kernel: the caller and up to num_threads - 1 pool tasks take panels from
  // one counter; the caller waits for panels to be done, never for a task to start.
  struct Shared {
    std::atomic<int64_t> next{0}, done{0};
  };
  auto shared = std::make_shared<Shared>();
  const Dims dims = d;
  auto work = [=]() {
    for (int64_t i; (i = shared->next.fetch_add(1, std::memory_order_relaxed)) < num_units;) {
      run_unit<T>(dims, x, w, y, i);
      shared->done.fetch_add(1, std::memory_order_release);
    }
  };
  const int64_t helpers = std::min<int64_t>(num_threads, num_units) - 1;
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule(std::function<void()>(work));
  work();
  while (shared->done.load(std::memory_order_acquire) < num_units) std::this_thread::yield();
  return ffi::Error::Success();
}

ffi::Error SmallMMatmulImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w,
                            ffi::Result<ffi::AnyBuffer> y) {
  auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 2 || yd.size() != 2 || xd[1] != wd[0] || yd[0] != xd[0] || yd[1] != wd[1])
    return ffi::Error::InvalidArgument("small_m_matmul: x must be [M, K], w [K, N] and y [M, N]");
  if (w.element_type() != x.element_type() || y->element_type() != x.element_type())
    return ffi::Error::InvalidArgument("small_m_matmul: x, w and y differ in dtype");
  if (xd[0] == 0 || wd[1] == 0) return ffi::Error::Success();
  // Units of at most kMaxUnitCols columns, at least four per thread where there are enough panels (so that
  // a narrow matmul still spreads over every thread), whole panels each.
  const int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  const int64_t panels = std::max<int64_t>(wd[1] / kPanel, 1);
  const int64_t per_unit = std::clamp<int64_t>(panels / (4 * threads), 1, kMaxUnitCols / kPanel);
  const Dims d{xd[0], xd[1], wd[1], per_unit * kPanel};
  switch (x.element_type()) {
    case ffi::DataType::F32:
      return Matmul<float>(pool, d, x.typed_data<float>(), w.typed_data<float>(), y->typed_data<float>());
    case ffi::DataType::BF16:
      return Matmul<uint16_t>(pool, d, x.reinterpret_data<uint16_t>(), w.reinterpret_data<uint16_t>(),
                              y->reinterpret_data<uint16_t>());
    default:
      return ffi::Error::InvalidArgument("small_m_matmul: dtype must be float32 or bfloat16");
  }
}

}  // namespace

// The one exported symbol (the library is built with -fvisibility=hidden).
extern "C" __attribute__((visibility("default"))) XLA_FFI_Error* SarathiSmallMMatmul(XLA_FFI_CallFrame*);

XLA_FFI_DEFINE_HANDLER_SYMBOL(SarathiSmallMMatmul, SmallMMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()   // x [M, K]
                                  .Arg<ffi::AnyBuffer>()   // w [K, N]
                                  .Ret<ffi::AnyBuffer>());  // y [M, N]
