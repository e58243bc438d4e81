// Ragged paged attention for CPUs, an XLA FFI custom call: the engine's attention on a CPU when this file is
// built (pallas_kernels/ragged_paged_attention_cpu.py loads it; setup.py builds it at install time).
//
// Arguments, shapes and semantics are those of the Pallas kernel's docstring
// (pallas_kernels/ragged_paged_attention.py), float32 or bfloat16 q / k_pages / v_pages of one dtype:
//
//   q            [T, Hq, D]              out [T, Hq, D] (q's dtype); rows past cu_q_lens[num_seqs] are zeros
//   k_pages      [num_blocks, block_size, Hkv, D]   v_pages the same
//   kv_lens      int32[S]   block_tables int32[S, max_blocks]   cu_q_lens int32[S + 1]   num_seqs int32[1]
//   attribute    sm_scale (float)
//
// Query row j of sequence i sits at position kv_lens[i] - q_len_i + j and sees positions 0 .. that one.
//
// How the work is split. A *unit* is (sequence, KV head, a block of consecutive query rows of that
// sequence): its G = Hq / Hkv query heads times its rows form the rows of one matrix, so every KV token it
// reads is used by all of them (a decode row is one unit per KV head, G matrix rows). A unit walks the
// sequence's KV in chunks of 16 tokens, up to the position its last row may see, with an online softmax
// (running max, running sum and accumulator, float32). Each chunk is first copied from its pages into two
// small float32 buffers, K transposed ([D][16], so a score row is one 16-wide FMA per d) and V as is
// ([16][D]); slots past the chunk's last valid token are zero-filled, never read, so stale or non-finite
// cache contents cannot leak. Units are sorted longest first and handed out from an atomic counter to the
// calling thread and XLA's intra-op thread pool.
//
// Metadata is clamped before use (block-table entries into the cache, kv_lens to the table's capacity,
// cu_q_lens into [0, T]): garbage metadata gives garbage rows, never an out-of-bounds read.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kChunk = 16;           // KV tokens per chunk: one vector of scores
constexpr int kMaxMatrixRows = 64;   // query rows x G per unit (bounds the per-thread buffers)
typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

constexpr float kMaskValue = -0.7f * std::numeric_limits<float>::max();

inline v16f splat(float x) { return v16f{} + x; }

// exp(x) for x <= 0 (scores minus their running max), branch-free so that it vectorises: Cephes' expf range
// reduction and polynomial (about 1 ulp); exp(x) is 0 below -87.
inline v16f exp_v(v16f x) {
  const v16f lo = splat(-87.3f);
  v16f below = x < lo ? splat(0.0f) : splat(1.0f);
  x = x < lo ? lo : x;
  // n = round(x / ln 2) via the 1.5 * 2^23 trick (|x / ln 2| < 2^22).
  v16f t = x * 1.44269504088896341f + 12582912.0f;
  v16f n = t - 12582912.0f;
  v16f r = x - n * 0.693359375f + n * 2.12194440e-4f;
  v16f r2 = r * r;
  v16f p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r2 + r + 1.0f;
  v16i e = (__builtin_convertvector(n, v16i) + 127) << 23;
  return p * (v16f)e * below;
}

inline float hmax(v16f x) {
  float m = x[0];
  for (int i = 1; i < kChunk; ++i) m = std::max(m, x[i]);
  return m;
}

inline float hsum(v16f x) {
  float s = 0.0f;
  for (int i = 0; i < kChunk; ++i) s += x[i];
  return s;
}

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

struct Shapes {
  int64_t num_tokens, num_q_heads, num_kv_heads, head_dim, group;
  int64_t num_blocks, block_size, max_blocks;
};

struct Unit {
  int32_t seq, kv_head, row0, num_rows;  // rows row0 .. row0 + num_rows - 1 of the sequence
  int32_t kv_start;                      // position of the sequence's first query row
  int32_t kv_len;
  int64_t cost;
};

// Per-thread scratch, sized for the largest unit.
struct Scratch {
  std::vector<v16f> kt, vt, q, o, s;
  std::vector<float> m, l;
  void reserve(int64_t dv, int64_t rows) {
    kt.resize(dv * kChunk);   // [D/16 vectors][16 lanes] per d: kt[d] is a vector over tokens
    vt.resize(kChunk * dv);   // [16 tokens][D/16 vectors]
    q.resize(rows * dv);      // [rows][D/16]
    o.resize(rows * dv);
    s.resize(rows);
    m.resize(rows);
    l.resize(rows);
  }
};

template <typename T, int DV>  // DV: head_dim / 16 rounded up, or 0 for "given at run time"
void run_unit(const Unit& u, const Shapes& sh, int dv_runtime, const T* q, const T* k_pages, const T* v_pages,
              const int32_t* block_tables, float sm_scale, int32_t q_start, T* out, Scratch& scr) {
  const int dv = DV > 0 ? DV : dv_runtime;
  const int64_t D = sh.head_dim, G = sh.group, Hkv = sh.num_kv_heads, Hq = sh.num_q_heads;
  const int64_t rows = int64_t(u.num_rows) * G;  // matrix row r = (query row r / G, head r % G)
  float* kt = reinterpret_cast<float*>(scr.kt.data());
  float* vt = reinterpret_cast<float*>(scr.vt.data());
  float* qb = reinterpret_cast<float*>(scr.q.data());
  v16f* o = scr.o.data();
  v16f* s = scr.s.data();
  float* m = scr.m.data();
  float* l = scr.l.data();

  for (int64_t r = 0; r < rows; ++r) {
    const T* src = q + ((q_start + u.row0 + r / G) * Hq + u.kv_head * G + r % G) * D;
    float* dst = qb + r * dv * kChunk;
    for (int64_t d = 0; d < D; ++d) dst[d] = to_f32(src[d]) * sm_scale;
    for (int64_t d = D; d < dv * kChunk; ++d) dst[d] = 0.0f;
    for (int c = 0; c < dv; ++c) o[r * dv + c] = splat(0.0f);
    m[r] = kMaskValue;
    l[r] = 0.0f;
  }
  const int32_t first_pos = u.kv_start + u.row0;            // position of the unit's first query row
  const int32_t extent = first_pos + u.num_rows;            // its last row sees positions < extent
  const int64_t page_stride = sh.block_size * Hkv * D, token_stride = Hkv * D;
  const int32_t* table = block_tables + int64_t(u.seq) * sh.max_blocks;
  const v16i lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};

  for (int32_t c0 = 0; c0 < extent; c0 += kChunk) {
    const int n_valid = std::min<int32_t>(kChunk, extent - c0);
    // Copy the chunk: K transposed into kt[d][t], V into vt[t][d]; zeros elsewhere.
    int64_t page_idx = c0 / sh.block_size, slot = c0 % sh.block_size;
    for (int t = 0; t < n_valid; ++t) {
      int64_t page = std::clamp<int64_t>(table[page_idx], 0, sh.num_blocks - 1);
      const int64_t off = page * page_stride + slot * token_stride + u.kv_head * D;
      const T* ks = k_pages + off;
      const T* vs = v_pages + off;
      float* vd = vt + t * dv * kChunk;
      for (int64_t d = 0; d < D; ++d) kt[d * kChunk + t] = to_f32(ks[d]);
      for (int64_t d = 0; d < D; ++d) vd[d] = to_f32(vs[d]);
      for (int64_t d = D; d < dv * kChunk; ++d) vd[d] = 0.0f;
      if (++slot == sh.block_size) slot = 0, ++page_idx;
    }
    for (int t = n_valid; t < kChunk; ++t) {
      for (int64_t d = 0; d < D; ++d) kt[d * kChunk + t] = 0.0f;
      for (int64_t d = 0; d < dv * kChunk; ++d) vt[t * dv * kChunk + d] = 0.0f;
    }
    for (int64_t d = D; d < dv * kChunk; ++d)
      for (int t = 0; t < kChunk; ++t) kt[d * kChunk + t] = 0.0f;
    const v16f* ktv = reinterpret_cast<const v16f*>(kt);

    // Scores, four matrix rows at a time: s[r] = sum_d q[r][d] * kt[d].
    int64_t r = 0;
    for (; r + 4 <= rows; r += 4) {
      const float* q0 = qb + r * dv * kChunk;
      const int64_t qs = dv * kChunk;
      v16f a0 = {}, a1 = {}, a2 = {}, a3 = {};
      for (int64_t d = 0; d < dv * kChunk; ++d) {
        const v16f kd = ktv[d];
        a0 += q0[d] * kd;
        a1 += q0[qs + d] * kd;
        a2 += q0[2 * qs + d] * kd;
        a3 += q0[3 * qs + d] * kd;
      }
      s[r] = a0, s[r + 1] = a1, s[r + 2] = a2, s[r + 3] = a3;
    }
    for (; r < rows; ++r) {
      const float* q0 = qb + r * dv * kChunk;
      v16f a0 = {};
      for (int64_t d = 0; d < dv * kChunk; ++d) a0 += q0[d] * ktv[d];
      s[r] = a0;
    }

    // Online softmax and the value product, row by row.
    const v16f* vtv = reinterpret_cast<const v16f*>(vt);
    for (int64_t r = 0; r < rows; ++r) {
      // Row r sees chunk slots t with c0 + t <= its position, and t < n_valid.
      const int32_t visible = std::min<int32_t>(n_valid, first_pos + int32_t(r / G) - c0 + 1);
      if (visible <= 0) continue;
      v16f sr = lane < visible ? s[r] : splat(kMaskValue);
      const float m_new = std::max(m[r], hmax(sr));
      v16f p = exp_v(sr - m_new);
      p = lane < visible ? p : splat(0.0f);
      const float alpha = exp_v(splat(m[r] - m_new))[0];
      l[r] = l[r] * alpha + hsum(p);
      m[r] = m_new;
      v16f* orow = o + r * dv;
      for (int c = 0; c < dv; ++c) orow[c] *= alpha;
      for (int t = 0; t < visible; ++t) {
        const float pt = p[t];
        const v16f* vrow = vtv + t * dv;
        for (int c = 0; c < dv; ++c) orow[c] += pt * vrow[c];
      }
    }
  }

  for (int64_t r = 0; r < rows; ++r) {
    T* dst = out + ((q_start + u.row0 + r / G) * Hq + u.kv_head * G + r % G) * D;
    const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
    const float* orow = reinterpret_cast<const float*>(o + r * dv);
    for (int64_t d = 0; d < D; ++d) from_f32(orow[d] * inv, dst + d);
  }
}

template <typename T>
ffi::Error Attention(ffi::ThreadPool pool, const Shapes& sh, const T* q, const T* k_pages, const T* v_pages,
                     const int32_t* kv_lens, const int32_t* block_tables, const int32_t* cu_q_lens,
                     int64_t max_num_seqs, int32_t num_seqs, float sm_scale, T* out) {
  std::memset(out, 0, sizeof(T) * sh.num_tokens * sh.num_q_heads * sh.head_dim);
  num_seqs = std::clamp<int32_t>(num_seqs, 0, int32_t(max_num_seqs));
  const int32_t capacity = int32_t(std::min<int64_t>(sh.max_blocks * sh.block_size, INT32_MAX));
  const int32_t rows_per_unit = int32_t(std::max<int64_t>(1, kMaxMatrixRows / sh.group));

  auto units = std::make_shared<std::vector<Unit>>();
  auto q_starts = std::make_shared<std::vector<int32_t>>(num_seqs);
  int32_t prev_end = 0;
  for (int32_t i = 0; i < num_seqs; ++i) {
    const int32_t start = std::clamp<int32_t>(cu_q_lens[i], prev_end, int32_t(sh.num_tokens));
    const int32_t end = std::clamp<int32_t>(cu_q_lens[i + 1], start, int32_t(sh.num_tokens));
    prev_end = end;
    (*q_starts)[i] = start;
    const int32_t q_len = end - start;
    const int32_t kv_len = std::clamp<int32_t>(kv_lens[i], 0, capacity);
    const int32_t kv_start = kv_len - q_len;  // position of the first query row
    for (int32_t row0 = 0; row0 < q_len; row0 += rows_per_unit) {
      int32_t n = std::min(rows_per_unit, q_len - row0);
      // Rows at negative positions (kv_len < q_len: inconsistent metadata) see nothing and stay zero.
      const int32_t skip = std::clamp<int32_t>(-(kv_start + row0), 0, n);
      if (skip == n) continue;
      const int32_t extent = kv_start + row0 + n;
      for (int32_t h = 0; h < sh.num_kv_heads; ++h)
        units->push_back({i, h, row0 + skip, n - skip, kv_start, kv_len, int64_t(extent) * (n - skip)});
    }
  }
  // Longest first, so the last units handed out are short ones.
  std::stable_sort(units->begin(), units->end(), [](const Unit& a, const Unit& b) { return a.cost > b.cost; });

  const int64_t dv = (sh.head_dim + kChunk - 1) / kChunk;
  const int64_t max_rows = int64_t(rows_per_unit) * sh.group;
  auto run_range = [=](const Unit& u) {
    thread_local Scratch scratch;
    scratch.reserve(dv, max_rows);
    const int32_t q_start = (*q_starts)[u.seq];
    if (dv == 4)
      run_unit<T, 4>(u, sh, dv, q, k_pages, v_pages, block_tables, sm_scale, q_start, out, scratch);
    else if (dv == 8)
      run_unit<T, 8>(u, sh, dv, q, k_pages, v_pages, block_tables, sm_scale, q_start, out, scratch);
    else
      run_unit<T, 0>(u, sh, dv, q, k_pages, v_pages, block_tables, sm_scale, q_start, out, scratch);
  };

  // Work sharing: the caller and up to num_threads - 1 pool tasks take units from one counter. The caller
  // waits only for units to be done (not for tasks to start), so it never depends on a free pool thread;
  // a task that starts late finds no work and touches nothing but the shared counters it co-owns.
  struct Shared {
    std::atomic<int64_t> next{0}, done{0};
  };
  auto shared = std::make_shared<Shared>();
  const int64_t num_units = int64_t(units->size());
  auto work = [=]() {
    for (int64_t i; (i = shared->next.fetch_add(1, std::memory_order_relaxed)) < num_units;) {
      run_range((*units)[i]);
      shared->done.fetch_add(1, std::memory_order_release);
    }
  };
  const int64_t helpers = std::min<int64_t>(std::max<int64_t>(pool.num_threads(), 1), num_units) - 1;
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule(std::function<void()>(work));
  work();
  while (shared->done.load(std::memory_order_acquire) < num_units) std::this_thread::yield();
  return ffi::Error::Success();
}

ffi::Error RaggedPagedAttentionImpl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k_pages,
                                    ffi::AnyBuffer v_pages, ffi::Buffer<ffi::S32> kv_lens,
                                    ffi::Buffer<ffi::S32> block_tables, ffi::Buffer<ffi::S32> cu_q_lens,
                                    ffi::Buffer<ffi::S32> num_seqs, ffi::Result<ffi::AnyBuffer> out,
                                    float sm_scale) {
  auto qd = q.dimensions(), kd = k_pages.dimensions(), bt = block_tables.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || bt.size() != 2)
    return ffi::Error::InvalidArgument("ragged_paged_attention_cpu: q must be [T, Hq, D], k_pages "
                                       "[num_blocks, block_size, Hkv, D], block_tables [S, max_blocks]");
  if (k_pages.element_type() != q.element_type() || v_pages.element_type() != q.element_type() ||
      out->element_type() != q.element_type())
    return ffi::Error::InvalidArgument("ragged_paged_attention_cpu: q, k_pages, v_pages and out differ in dtype");
  auto vd = v_pages.dimensions();
  if (!std::equal(kd.begin(), kd.end(), vd.begin(), vd.end()))
    return ffi::Error::InvalidArgument("ragged_paged_attention_cpu: k_pages and v_pages differ in shape");
  Shapes sh{qd[0], qd[1], kd[2], qd[2], 0, kd[0], kd[1], bt[1]};
  if (kd[3] != sh.head_dim || sh.num_kv_heads <= 0 || sh.num_q_heads % sh.num_kv_heads != 0)
    return ffi::Error::InvalidArgument("ragged_paged_attention_cpu: head_dim differs between q and the cache, "
                                       "or num_q_heads is not a multiple of num_kv_heads");
  sh.group = sh.num_q_heads / sh.num_kv_heads;
  const int64_t max_num_seqs = bt[0];
  if (kv_lens.element_count() != size_t(max_num_seqs) || cu_q_lens.element_count() != size_t(max_num_seqs) + 1 ||
      num_seqs.element_count() != 1)
    return ffi::Error::InvalidArgument("ragged_paged_attention_cpu: kv_lens must be [S], cu_q_lens [S + 1] and "
                                       "num_seqs [1] for block_tables [S, max_blocks]");
  if (sh.num_tokens == 0 || sh.head_dim == 0 || sh.num_q_heads == 0) return ffi::Error::Success();
  if (sh.num_blocks == 0 || sh.block_size == 0 || sh.max_blocks == 0) {
    std::memset(out->untyped_data(), 0, out->size_bytes());
    return ffi::Error::Success();
  }
  const int32_t n = num_seqs.typed_data()[0];
  switch (q.element_type()) {
    case ffi::DataType::F32:
      return Attention<float>(pool, sh, q.typed_data<float>(), k_pages.typed_data<float>(),
                              v_pages.typed_data<float>(), kv_lens.typed_data(), block_tables.typed_data(),
                              cu_q_lens.typed_data(), max_num_seqs, n, sm_scale, out->typed_data<float>());
    case ffi::DataType::BF16:
      return Attention<uint16_t>(pool, sh, q.reinterpret_data<uint16_t>(), k_pages.reinterpret_data<uint16_t>(),
                                 v_pages.reinterpret_data<uint16_t>(), kv_lens.typed_data(),
                                 block_tables.typed_data(), cu_q_lens.typed_data(), max_num_seqs, n, sm_scale,
                                 out->reinterpret_data<uint16_t>());
    default:
      return ffi::Error::InvalidArgument("ragged_paged_attention_cpu: dtype must be float32 or bfloat16");
  }
}

}  // namespace

// The one exported symbol (the library is built with -fvisibility=hidden).
extern "C" __attribute__((visibility("default"))) XLA_FFI_Error* SarathiRaggedPagedAttention(XLA_FFI_CallFrame*);

XLA_FFI_DEFINE_HANDLER_SYMBOL(SarathiRaggedPagedAttention, RaggedPagedAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()    // q
                                  .Arg<ffi::AnyBuffer>()    // k_pages
                                  .Arg<ffi::AnyBuffer>()    // v_pages
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // block_tables
                                  .Arg<ffi::Buffer<ffi::S32>>()  // cu_q_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // num_seqs
                                  .Ret<ffi::AnyBuffer>()    // out
                                  .Attr<float>("sm_scale"));
