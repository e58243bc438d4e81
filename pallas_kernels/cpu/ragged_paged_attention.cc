// Ragged paged attention for CPUs, an XLA FFI custom call: the engine's attention on a CPU when this file is
// built (pallas_kernels/ragged_paged_attention_cpu.py loads it; setup.py builds it at install time).
//
// Arguments, shapes and semantics are those of the Pallas kernel's docstring
// (pallas_kernels/ragged_paged_attention.py), float32 or bfloat16 q / k_pages / v_pages of one dtype:
//
//   q            [T, Hq, D]              out [T, Hq, D] (q's dtype); rows past cu_q_lens[num_seqs] are zeros
//   k_pages      [num_blocks, block_size, Hkv, D]   v_pages the same
//   kv_lens      int32[S]   block_tables int32[S, max_blocks]   cu_q_lens int32[S + 1]   num_seqs int32[1]
//   attributes   sm_scale (float); unit_rows, min_part_tokens (int32: the static split sizes below)
//
// Query row j of sequence i sits at position kv_lens[i] - q_len_i + j and sees positions 0 .. that one.
//
// How the work is split. A *unit* is a block of consecutive query rows of one sequence (unit_rows / G of
// them), all KV heads: per KV head, its rows times the G query heads sharing that head form the rows of one
// matrix, so every K/V token it reads serves all of them. Softmax is online (running max, running sum and
// accumulator, float32). Two ways through a unit's KV range:
//   * direct (fewer than kCopyRows matrix rows per head, head_dim a multiple of 16: decodes and short
//     chunks): chunks of 16 tokens, K and V read straight from the cache, every head of a token row in turn
//     (address order), a lane-wise partial dot product per token and row reduced across lanes once per chunk
//     (reduce_tokens), the next chunk's pages prefetched (a block table defeats hardware prefetchers);
//   * copying (more rows, or another head_dim: prefills): head by head, tiles of 64 tokens; each tile's K is
//     transposed ([D][64], 16 x 16 blocks in registers; 8 x 8 on AVX2) and its V copied into float32 buffers
//     once, then shared by all rows of the head: a score row is one FMA per d and 16 tokens, and blocks of rows keep
//     their accumulators in registers. Blocks of rows on the causal diagonal stop at the last token their
//     furthest row sees, and rows that see none of a tile skip it.
// Arithmetic runs on native vectors (vnat: 16 floats with AVX-512, 8 with AVX2) with register blocks sized
// for the ISA; the layout (chunks, tiles, score vectors) stays in units of 16 floats.
// Either way only slots before the range's last valid token are read, so stale or non-finite cache contents
// cannot leak.
// Units are sorted longest first and handed out from an atomic counter to the calling thread and XLA's
// intra-op thread pool. When a batch has fewer units than twice the threads (one long decode, say), each
// unit's KV range is split into parts of at least min_part_tokens, computed as separate units and merged
// afterwards (merge_parts; flash-decoding).
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

#include "work_sharing.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kChunk = 16;           // KV tokens per chunk of the direct path: one vector of scores
constexpr int kTile = 64;            // KV tokens per tile of the copying path
constexpr int kTileVectors = kTile / kChunk;
typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

// The inner products and the softmax run on the machine's own vectors (`vnat`), not on v16f: without AVX-512,
// GCC keeps 64-byte generic vectors in memory and moves their halves through general registers (an
// accumulator loop of v16f ran several times slower than the same loop on pairs of 8-wide vectors). A v16f
// in memory is kSplit native vectors. kNativeRegisters sizes the register blocks: AVX-512 has 32 registers of
// 16 floats, AVX2 16 of 8.
#if defined(__AVX512F__)
typedef float vnat __attribute__((vector_size(64)));
typedef int32_t vnat_i __attribute__((vector_size(64)));
constexpr int kNativeRegisters = 32;
#else
typedef float vnat __attribute__((vector_size(32)));
typedef int32_t vnat_i __attribute__((vector_size(32)));
constexpr int kNativeRegisters = 16;
#endif
constexpr int kSplit = int(sizeof(v16f) / sizeof(vnat));
constexpr int kNativeLanes = int(sizeof(vnat) / sizeof(float));


constexpr float kMaskValue = -0.7f * std::numeric_limits<float>::max();

inline v16f splat(float x) { return v16f{} + x; }

// exp(x) for x <= 0 (scores minus their running max), branch-free so that it vectorises: Cephes' expf range
// reduction and polynomial (about 1 ulp); exp(x) is 0 below -87.
template <typename V, typename VI>
inline V exp_v(V x) {
  const V lo = V{} - 87.3f;
  V below = x < lo ? V{} : V{} + 1.0f;
  x = x < lo ? lo : x;
  // n = round(x / ln 2) via the 1.5 * 2^23 trick (|x / ln 2| < 2^22).
  V t = x * 1.44269504088896341f + 12582912.0f;
  V n = t - 12582912.0f;
  V r = x - n * 0.693359375f + n * 2.12194440e-4f;
  V r2 = r * r;
  V p = V{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r2 + r + 1.0f;
  VI e = (__builtin_convertvector(n, VI) + 127) << 23;
  return p * (V)e * below;
}

// Horizontal max and sum of a native vector: shuffle trees (lane 0 of the last step holds the result).
#if defined(__AVX512F__)
constexpr vnat_i kShuffleSteps[4] = {{8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7},
                                     {4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11},
                                     {2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13},
                                     {1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14}};
#else
constexpr vnat_i kShuffleSteps[3] = {{4, 5, 6, 7, 0, 1, 2, 3}, {2, 3, 0, 1, 6, 7, 4, 5}, {1, 0, 3, 2, 5, 4, 7, 6}};
#endif

inline float hmax(vnat x) {
  for (const vnat_i& k : kShuffleSteps) {
    const vnat y = __builtin_shuffle(x, k);
    x = x > y ? x : y;
  }
  return x[0];
}

inline float hsum(vnat x) {
  for (const vnat_i& k : kShuffleSteps) x += __builtin_shuffle(x, k);
  return x[0];
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

// Query rows row0 .. row0 + num_rows - 1 of sequence `seq`, all KV heads, KV positions kv_lo .. kv_hi - 1.
struct Unit {
  int32_t seq, row0, num_rows;
  int32_t q_start;       // the sequence's first row in q
  int32_t kv_start;      // position of the sequence's first query row
  int32_t kv_lo, kv_hi;  // kv_hi: at most one past the last row's position
  int32_t part;          // -1: writes normalised rows to out; else its slot of unnormalised partial results
  int64_t cost;
};

// A 16-wide load of elements of type T as float32 (bfloat16: the bits shifted into place).
inline v16f load16(const float* p) {
  v16f x;
  std::memcpy(&x, p, sizeof(x));
  return x;
}
inline v16f load16(const uint16_t* p) {
  typedef uint16_t v16h __attribute__((vector_size(32)));
  typedef uint32_t v16u __attribute__((vector_size(64)));
  v16h h;
  std::memcpy(&h, p, sizeof(h));
  return (v16f)(__builtin_convertvector(h, v16u) << 16);
}

// out[t] = sum of the 16 lanes of x[t]: a transposing reduction in four shuffle levels (lane l of the result
// holds vector l's sum).
inline v16f reduce16(const v16f* x) {
  v16f a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i) {
    const v16f u = x[2 * i], v = x[2 * i + 1];
    a[i] = __builtin_shuffle(u, v, v16i{0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30}) +
           __builtin_shuffle(u, v, v16i{1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31});
  }
  for (int i = 0; i < 4; ++i) {
    const v16f u = a[2 * i], v = a[2 * i + 1];
    b[i] = __builtin_shuffle(u, v, v16i{0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29}) +
           __builtin_shuffle(u, v, v16i{2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31});
  }
  for (int i = 0; i < 2; ++i) {
    const v16f u = b[2 * i], v = b[2 * i + 1];
    c[i] = __builtin_shuffle(u, v, v16i{0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27}) +
           __builtin_shuffle(u, v, v16i{4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31});
  }
  return __builtin_shuffle(c[0], c[1], v16i{0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23}) +
         __builtin_shuffle(c[0], c[1], v16i{8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31});
}

// A native vector of elements of type T as float32 (bfloat16: the bits shifted into place).
inline vnat load_nat(const float* p) {
  vnat x;
  std::memcpy(&x, p, sizeof(x));
  return x;
}
inline vnat load_nat(const uint16_t* p) {
  typedef uint16_t vh __attribute__((vector_size(sizeof(vnat) / 2)));
  typedef uint32_t vu __attribute__((vector_size(sizeof(vnat))));
  vh h;
  std::memcpy(&h, p, sizeof(h));
  return (vnat)(__builtin_convertvector(h, vu) << 16);
}

// out[t] = sum of the lanes of x[t] for 16 native vectors x[0..15] (lane t of the v16f result).
inline void reduce_tokens(const vnat* x, v16f* out) {
#if defined(__AVX512F__)
  *out = reduce16(x);
#else
  vnat* on = reinterpret_cast<vnat*>(out);
  for (int half = 0; half < 2; ++half) {  // tokens 8 half .. 8 half + 7: three shuffle levels
    const vnat* y = x + 8 * half;
    vnat a[4], b[2];
    for (int i = 0; i < 4; ++i)
      a[i] = __builtin_shuffle(y[2 * i], y[2 * i + 1], vnat_i{0, 8, 2, 10, 4, 12, 6, 14}) +
             __builtin_shuffle(y[2 * i], y[2 * i + 1], vnat_i{1, 9, 3, 11, 5, 13, 7, 15});
    for (int i = 0; i < 2; ++i)
      b[i] = __builtin_shuffle(a[2 * i], a[2 * i + 1], vnat_i{0, 1, 8, 9, 4, 5, 12, 13}) +
             __builtin_shuffle(a[2 * i], a[2 * i + 1], vnat_i{2, 3, 10, 11, 6, 7, 14, 15});
    on[half] = __builtin_shuffle(b[0], b[1], vnat_i{0, 1, 2, 3, 8, 9, 10, 11}) +
               __builtin_shuffle(b[0], b[1], vnat_i{4, 5, 6, 7, 12, 13, 14, 15});
  }
#endif
}

// Per-thread scratch, grown to the largest unit seen. Matrix row r of a unit is (KV head r / hr, query row
// (r % hr) / G, query head (r % hr) % G), hr = num_rows * G rows per head.
struct Scratch {
  std::vector<v16f> q, o, s, tile, kt, vt;
  std::vector<float> m, l;
  void reserve(int64_t dv, int64_t rows) {
    if (int64_t(m.size()) >= rows && int64_t(kt.size()) >= dv * kTile) return;
    q.resize(rows * dv);              // [rows][D/16] scaled queries, zero-padded to whole vectors
    o.resize(rows * dv);              // [rows][D/16] unnormalised accumulators
    s.resize(rows * kTileVectors);    // [rows][tile tokens / 16] scores, then probabilities
    tile.resize(rows * kChunk);       // [rows][16 tokens] per-token partial dot products (direct path, native)
    kt.resize(dv * kTile);            // [D][64 tokens]: one head's K tile transposed (copying path)
    vt.resize(kTile * dv);            // [64 tokens][D/16]: one head's V tile, zero-padded (copying path)
    m.resize(rows);
    l.resize(rows);
  }
};

// Query rows per head from which the copying path (K transposed once per tile, then one FMA per d, row and
// 16 tokens) beats the direct one (per-token dot products, then a transposing reduction per row).
constexpr int64_t kCopyRows = 16;
constexpr int kDirectMaxVectors = 16;  // the direct path holds a head's K row in at most 16 vectors (D <= 256)

// What a unit's walk over its KV range shares between the direct and the copying paths.
template <typename T>
struct UnitWalk {
  const Unit& u;
  const Shapes& sh;
  int dv;
  int64_t hr, rows;
  const T *k_pages, *v_pages;
  const int32_t* table;  // the sequence's block-table row
  Scratch& scr;
  int32_t first_pos() const { return u.kv_start + u.row0; }  // position of the unit's first query row

  // Element offsets in the cache (head 0) of the tokens c0 .. c0 + n - 1, n = min(n_max, kv_hi - c0).
  int offsets(int32_t c0, int n_max, int64_t* dst) const {
    const int n = std::min<int32_t>(n_max, u.kv_hi - c0);
    const int64_t page_stride = sh.block_size * sh.num_kv_heads * sh.head_dim;
    const int64_t token_stride = sh.num_kv_heads * sh.head_dim;
    int64_t page_idx = c0 / sh.block_size, slot = c0 % sh.block_size;
    for (int t = 0; t < n; ++t) {
      const int64_t page = std::clamp<int64_t>(table[page_idx], 0, sh.num_blocks - 1);
      dst[t] = page * page_stride + slot * token_stride;
      if (++slot == sh.block_size) slot = 0, ++page_idx;
    }
    return n;
  }
  // Prefetch whole token rows (every head) of K and V: pages lie anywhere, so no hardware prefetcher guesses
  // them. Into L1 for the direct path's 16 tokens; into L2 for the copying path's larger tiles.
  template <int Locality>
  void prefetch(const int64_t* tok, int n) const {
    const int64_t line_elems = 64 / sizeof(T), row_elems = sh.num_kv_heads * sh.head_dim;
    for (int t = 0; t < n; ++t)
      for (int64_t e = 0; e < row_elems; e += line_elems) {
        __builtin_prefetch(k_pages + tok[t] + e, 0, Locality);
        __builtin_prefetch(v_pages + tok[t] + e, 0, Locality);
      }
  }
  // Matrix rows of one head before this one see none of the tokens from c0 on (causal): a tile's leading
  // rows, rounded down to a multiple of `block`, are skipped.
  int64_t first_row_seeing(int32_t c0, int64_t block) const {
    const int64_t r = std::clamp<int64_t>(int64_t(c0 - first_pos()) * sh.group, 0, hr);
    return r - r % block;
  }
};

// Online softmax over a chunk of NV x 16 tokens from c0 (n_valid of them real), rows r_begin .. r_end - 1:
// s[r * NV + j] become the probabilities (0 where row r may not look; slots past n_valid may hold anything
// before), o[r] is rescaled and m[r], l[r] move on.
template <int NV>
void softmax_step(int64_t r_begin, int64_t r_end, int64_t hr, int64_t G, int32_t first_pos, int32_t c0, int n_valid,
                  int dv, v16f* s, v16f* o, float* m, float* l) {
  constexpr int N = NV * kSplit;  // native vectors per row
  vnat_i lane;
  for (int i = 0; i < kNativeLanes; ++i) lane[i] = i;
  for (int64_t r = r_begin; r < r_end; ++r) {
    vnat* sr = reinterpret_cast<vnat*>(s + r * NV);
    // Row r sees chunk slots t with c0 + t <= its position, and t < n_valid.
    const int32_t visible = std::min<int32_t>(n_valid, first_pos + int32_t((r % hr) / G) - c0 + 1);
    if (visible <= 0) {
      for (int j = 0; j < N; ++j) sr[j] = vnat{};
      continue;
    }
    if (visible < NV * kChunk)  // slots past `visible` (which may hold anything) count as masked
      for (int j = 0; j < N; ++j) sr[j] = lane + kNativeLanes * j < visible ? sr[j] : vnat{} + kMaskValue;
    vnat mx = sr[0];
    for (int j = 1; j < N; ++j) mx = mx > sr[j] ? mx : sr[j];
    const float m_new = std::max(m[r], hmax(mx));
    vnat sum = {};
    for (int j = 0; j < N; ++j) {  // exp_v is exactly 0 at masked slots (far below -87)
      sr[j] = exp_v<vnat, vnat_i>(sr[j] - m_new);
      sum += sr[j];
    }
    const float alpha = m_new > m[r] ? exp_v<vnat, vnat_i>(vnat{} + (m[r] - m_new))[0] : 1.0f;
    l[r] = l[r] * alpha + hsum(sum);
    m[r] = m_new;
    if (alpha != 1.0f) {
      vnat* orow = reinterpret_cast<vnat*>(o + r * dv);
      for (int c = 0; c < dv * kSplit; ++c) orow[c] *= alpha;
    }
  }
}

// The direct path: 16-token chunks, K and V read straight from the cache, on native vectors (a head's row of D
// floats is dv * kSplit of them).
template <typename T, int DV>
void walk_direct(const UnitWalk<T>& w) {
  constexpr int NMAX = (DV > 0 ? DV : kDirectMaxVectors) * kSplit;
  // Heads with fewer rows than kTokenMajor (decodes of small groups) go token by token, every head of a token
  // row in turn (the cache is read in address order). Otherwise per head and block of RB rows, their queries in
  // registers: RB x DV x kSplit query vectors plus a few operands fit the registers.
  constexpr int kTokenMajor = DV == 4 ? 4 : DV == 8 ? 2 : 1;
  constexpr int RB = kNativeRegisters >= 32 ? kTokenMajor : 1;
  const int dv = DV > 0 ? DV : w.dv;
  const int nn = dv * kSplit;  // native vectors per head row
  const int64_t D = w.sh.head_dim, hr = w.hr, rows = w.rows, heads = w.sh.num_kv_heads;
  Scratch& scr = w.scr;
  const vnat* qv = reinterpret_cast<const vnat*>(scr.q.data());
  vnat* o = reinterpret_cast<vnat*>(scr.o.data());
  vnat* tile = reinterpret_cast<vnat*>(scr.tile.data());
  v16f* s = scr.s.data();
  const T *k_pages = w.k_pages, *v_pages = w.v_pages;
  const bool token_major = hr < kTokenMajor;
  int64_t tok[kChunk], next_tok[kChunk];
  int n_valid = w.u.kv_hi > w.u.kv_lo ? w.offsets(w.u.kv_lo, kChunk, tok) : 0;
  for (int32_t c0 = w.u.kv_lo; c0 < w.u.kv_hi; c0 += kChunk) {
    int n_next = 0;
    if (c0 + kChunk < w.u.kv_hi) {
      n_next = w.offsets(c0 + kChunk, kChunk, next_tok);
      w.template prefetch<3>(next_tok, n_next);
    }
    // Scores s[r]: a lane-wise partial dot product per token, reduced across lanes once per chunk.
    if (token_major) {
      for (int t = 0; t < n_valid; ++t)
        for (int64_t h = 0; h < heads; ++h) {
          const T* kp = k_pages + tok[t] + h * D;
          vnat kv[NMAX];
          for (int c = 0; c < nn; ++c) kv[c] = load_nat(kp + c * kNativeLanes);
          for (int64_t r = h * hr; r < (h + 1) * hr; ++r) {
            vnat acc = qv[r * nn] * kv[0];
            for (int c = 1; c < nn; ++c) acc += qv[r * nn + c] * kv[c];
            tile[r * kChunk + t] = acc;
          }
        }
    }
    for (int64_t h = 0; h < heads && !token_major; ++h) {
      for (int64_t r = h * hr; r + RB <= (h + 1) * hr; r += RB) {
        vnat qr[RB][NMAX];
        for (int i = 0; i < RB; ++i)
          for (int c = 0; c < nn; ++c) qr[i][c] = qv[(r + i) * nn + c];
        for (int t = 0; t < n_valid; ++t) {
          const T* kp = k_pages + tok[t] + h * D;
          for (int i = 0; i < RB; ++i) {
            vnat acc = qr[i][0] * load_nat(kp);
            for (int c = 1; c < nn; ++c) acc += qr[i][c] * load_nat(kp + c * kNativeLanes);
            tile[(r + i) * kChunk + t] = acc;
          }
        }
      }
      for (int64_t r = (h + 1) * hr - hr % RB; r < (h + 1) * hr; ++r)  // rows past the last whole block
        for (int t = 0; t < n_valid; ++t) {
          const T* kp = k_pages + tok[t] + h * D;
          vnat acc = qv[r * nn] * load_nat(kp);
          for (int c = 1; c < nn; ++c) acc += qv[r * nn + c] * load_nat(kp + c * kNativeLanes);
          tile[r * kChunk + t] = acc;
        }
    }
    for (int64_t r = 0; r < rows; ++r) {
      for (int t = n_valid; t < kChunk; ++t) tile[r * kChunk + t] = vnat{};
      reduce_tokens(tile + r * kChunk, s + r);
    }

    softmax_step<1>(0, rows, hr, w.sh.group, w.first_pos(), c0, n_valid, dv, s, scr.o.data(), scr.m.data(),
                    scr.l.data());

    // o[r] += sum_t p[r][t] * v[t], in the same order as the scores.
    const float* sf = reinterpret_cast<const float*>(s);
    if (token_major) {
      for (int t = 0; t < n_valid; ++t)
        for (int64_t h = 0; h < heads; ++h) {
          const T* vp = v_pages + tok[t] + h * D;
          vnat vv[NMAX];
          for (int c = 0; c < nn; ++c) vv[c] = load_nat(vp + c * kNativeLanes);
          for (int64_t r = h * hr; r < (h + 1) * hr; ++r) {
            const float pt = sf[r * kChunk + t];
            for (int c = 0; c < nn; ++c) o[r * nn + c] += pt * vv[c];
          }
        }
    }
    for (int64_t h = 0; h < heads && !token_major; ++h) {
      for (int64_t r = h * hr; r + RB <= (h + 1) * hr; r += RB) {
        vnat acc[RB][NMAX];
        for (int i = 0; i < RB; ++i)
          for (int c = 0; c < nn; ++c) acc[i][c] = o[(r + i) * nn + c];
        for (int t = 0; t < n_valid; ++t) {
          const T* vp = v_pages + tok[t] + h * D;
          for (int i = 0; i < RB; ++i) {
            const float pt = sf[(r + i) * kChunk + t];
            for (int c = 0; c < nn; ++c) acc[i][c] += pt * load_nat(vp + c * kNativeLanes);
          }
        }
        for (int i = 0; i < RB; ++i)
          for (int c = 0; c < nn; ++c) o[(r + i) * nn + c] = acc[i][c];
      }
      for (int64_t r = (h + 1) * hr - hr % RB; r < (h + 1) * hr; ++r)
        for (int t = 0; t < n_valid; ++t) {
          const T* vp = v_pages + tok[t] + h * D;
          const float pt = sf[r * kChunk + t];
          for (int c = 0; c < nn; ++c) o[r * nn + c] += pt * load_nat(vp + c * kNativeLanes);
        }
    }
    std::memcpy(tok, next_tok, sizeof(tok));
    n_valid = n_next;
  }
}


// x[i] (16 rows of 16) becomes its transpose, in place: four stages, stage k swapping bit k of the row index
// with bit k of the lane index.
inline void transpose16(v16f* x) {
  static const v16i kLo[4] = {
      {0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30},
      {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29},
      {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27},
      {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23}};
  static const v16i kHi[4] = {
      {1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31},
      {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31},
      {4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31},
      {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31}};
#pragma GCC unroll 4
  for (int stage = 0; stage < 4; ++stage) {
    const int k = 1 << stage;
#pragma GCC unroll 16
    for (int i = 0; i < kChunk; ++i) {
      if (i & k) continue;
      const v16f a = x[i], b = x[i + k];
      x[i] = __builtin_shuffle(a, b, kLo[stage]);
      x[i + k] = __builtin_shuffle(a, b, kHi[stage]);
    }
  }
}


// x[i] (8 rows of 8 lanes, AVX2's native vectors) becomes its transpose, in place: three stages, stage k
// swapping bit k of the row index with bit k of the lane index.
inline void transpose8(vnat* x) {
#if !defined(__AVX512F__)
  static const vnat_i kLo[3] = {{0, 8, 2, 10, 4, 12, 6, 14}, {0, 1, 8, 9, 4, 5, 12, 13}, {0, 1, 2, 3, 8, 9, 10, 11}};
  static const vnat_i kHi[3] = {{1, 9, 3, 11, 5, 13, 7, 15}, {2, 3, 10, 11, 6, 7, 14, 15},
                                {4, 5, 6, 7, 12, 13, 14, 15}};
#pragma GCC unroll 3
  for (int stage = 0; stage < 3; ++stage) {
    const int k = 1 << stage;
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) {
      if (i & k) continue;
      const vnat a = x[i], b = x[i + k];
      x[i] = __builtin_shuffle(a, b, kLo[stage]);
      x[i + k] = __builtin_shuffle(a, b, kHi[stage]);
    }
  }
#else
  (void)x;
#endif
}

// Scores by blocks of kScoreRows rows x kScoreVectors vectors of 16 tokens: the accumulators, the K vectors
// and a broadcast query fit the registers (AVX-512: 4 x 4 + 4 + 1; AVX2: 2 x 2 x 2 + 2 x 2 + 1).
constexpr int kScoreRows = kNativeRegisters >= 32 ? 4 : 2;
constexpr int kScoreVectors = kNativeRegisters >= 32 ? kTileVectors : 2;

// s[r * kTileVectors + j] = q[r] . K[16 j .. 16 j + 15] for ROWS rows from r and vectors j0 .. j0 + NV - 1, from
// the transposed tile kt ([dpad][kTileVectors] vectors); qb holds the scaled queries, qs floats apart.
template <int ROWS, int NV>
void block_scores(const float* qb, int64_t qs, const v16f* kt, int64_t dpad, int64_t r, int j0, v16f* s) {
  constexpr int N = NV * kSplit;
  vnat a[ROWS][N] = {};
  const vnat* ktn = reinterpret_cast<const vnat*>(kt);
  const float* q0 = qb + r * qs;
  for (int64_t d = 0; d < dpad; ++d) {
    vnat k[N];
    for (int j = 0; j < N; ++j) k[j] = ktn[(d * kTileVectors + j0) * kSplit + j];
    for (int i = 0; i < ROWS; ++i) {
      const float qd = q0[i * qs + d];
      for (int j = 0; j < N; ++j) a[i][j] += qd * k[j];
    }
  }
  vnat* sn = reinterpret_cast<vnat*>(s);
  for (int i = 0; i < ROWS; ++i)
    for (int j = 0; j < N; ++j) sn[((r + i) * kTileVectors + j0) * kSplit + j] = a[i][j];
}

// The first nv score vectors of ROWS rows from r, kScoreVectors at a time.
template <int ROWS>
void block_scores(int nv, const float* qb, int64_t qs, const v16f* kt, int64_t dpad, int64_t r, v16f* s) {
  for (int j0 = 0; j0 < nv; j0 += kScoreVectors) {
    switch (std::min(nv - j0, kScoreVectors)) {
      case 1: block_scores<ROWS, 1>(qb, qs, kt, dpad, r, j0, s); break;
      case 2: block_scores<ROWS, 2>(qb, qs, kt, dpad, r, j0, s); break;
      case 3: block_scores<ROWS, 3>(qb, qs, kt, dpad, r, j0, s); break;
      default: block_scores<ROWS, 4>(qb, qs, kt, dpad, r, j0, s); break;
    }
  }
}

// o[r + i][c0 .. c0 + CB - 1] += sum over the first n_seen tokens t of p[r + i][t] v[t][c0 ..] (vectors of 16), for
// RB rows from r: the accumulators stay in registers across the tokens.
template <int RB, int CB>
inline void block_pv(int n_seen, const float* sf, const v16f* vt, int dv, int64_t r, int c0, v16f* o) {
  constexpr int N = CB * kSplit;
  vnat* on = reinterpret_cast<vnat*>(o);
  const vnat* vtn = reinterpret_cast<const vnat*>(vt);
  vnat acc[RB][N];
  for (int i = 0; i < RB; ++i)
    for (int c = 0; c < N; ++c) acc[i][c] = on[((r + i) * dv + c0) * kSplit + c];
  for (int t = 0; t < n_seen; ++t) {
    vnat vv[N];
    for (int c = 0; c < N; ++c) vv[c] = vtn[(t * dv + c0) * kSplit + c];
    for (int i = 0; i < RB; ++i) {
      const float pt = sf[(r + i) * kTile + t];
      for (int c = 0; c < N; ++c) acc[i][c] += pt * vv[c];
    }
  }
  for (int i = 0; i < RB; ++i)
    for (int c = 0; c < N; ++c) on[((r + i) * dv + c0) * kSplit + c] = acc[i][c];
}

// The copying path, head by head: tiles of kTile tokens, each one's K transposed and V copied once (float32),
// then shared by all the unit's rows of the head: scores, online softmax, then o += p v.
template <typename T, int DV>
void walk_copying(const UnitWalk<T>& w) {
  // Register blocks of o += p v: RB rows x CB vectors of 16 accumulators, plus CB V vectors (AVX-512: 4 x 4 + 4
  // or 2 x 8 + 8; AVX2: 2 x 2 x 2 + 2 x 2, over dv / 2 column blocks).
  constexpr int CB = kNativeRegisters >= 32 ? (DV > 0 ? DV : 1) : 2;
  constexpr int RB = kNativeRegisters >= 32 ? (DV == 4 ? 4 : DV == 8 ? 2 : 1) : 2;
  constexpr int kRowBlock = RB > kScoreRows ? RB : kScoreRows;
  const int dv = DV > 0 ? DV : w.dv;
  const int64_t D = w.sh.head_dim, hr = w.hr, heads = w.sh.num_kv_heads, dpad = dv * kChunk;
  Scratch& scr = w.scr;
  const float* qb = reinterpret_cast<const float*>(scr.q.data());
  v16f *o = scr.o.data(), *s = scr.s.data(), *kt = scr.kt.data(), *vt = scr.vt.data();
  float *ktf = reinterpret_cast<float*>(kt), *vtf = reinterpret_cast<float*>(vt);
  const float* sf = reinterpret_cast<const float*>(s);
  const bool whole_vectors = D % kChunk == 0;
  const int64_t line_elems = 64 / sizeof(T);
  int64_t tok[kTile], next_tok[kTile];
  for (int64_t h = 0; h < heads; ++h) {
    const T *k_head = w.k_pages + h * D, *v_head = w.v_pages + h * D;
    int n_valid = w.u.kv_hi > w.u.kv_lo ? w.offsets(w.u.kv_lo, kTile, tok) : 0;
    for (int32_t c0 = w.u.kv_lo; c0 < w.u.kv_hi; c0 += kTile) {
      // The next tile of this head (or the first of the next head) into L2 while this one is computed.
      int n_next = 0;
      const T *k_next = k_head, *v_next = v_head;
      if (c0 + kTile < w.u.kv_hi) {
        n_next = w.offsets(c0 + kTile, kTile, next_tok);
      } else if (h + 1 < heads) {
        n_next = w.offsets(w.u.kv_lo, kTile, next_tok);
        k_next += D, v_next += D;
      }
      for (int t = 0; t < n_next; ++t)
        for (int64_t e = 0; e < D; e += line_elems) {
          __builtin_prefetch(k_next + next_tok[t] + e, 0, 2);
          __builtin_prefetch(v_next + next_tok[t] + e, 0, 2);
        }
      // Rows before r0 see none of this tile (causal): their state stays as it is.
      const int64_t r0 = h * hr + w.first_row_seeing(c0, kRowBlock), r1 = (h + 1) * hr;
      const int nv = (n_valid + kChunk - 1) / kChunk;  // score vectors that hold real tokens
      // Tokens of this tile that matrix row r sees (causal), and the score vectors that hold them.
      auto tokens_seen = [&](int64_t r) {
        return std::clamp<int32_t>(w.first_pos() + int32_t((r % hr) / w.sh.group) - c0 + 1, 0, n_valid);
      };
      auto vectors_seen = [&](int64_t r) { return (tokens_seen(r) + kChunk - 1) / kChunk; };
      if (r0 < r1) {
        // K transposed 16 x 16 at a time; tokens past n_valid and dims past D are zeros.
        for (int tb = 0; tb < nv; ++tb) {
          const int nt = std::min(kChunk, n_valid - tb * kChunk);
          const int64_t* tb_tok = tok + tb * kChunk;
          if (whole_vectors) {
#if defined(__AVX512F__)
            for (int64_t db = 0; db < dv; ++db) {
              v16f x[kChunk];
#pragma GCC unroll 16
              for (int t = 0; t < kChunk; ++t)
                x[t] = t < nt ? load16(k_head + tb_tok[t] + db * kChunk) : splat(0.0f);
              transpose16(x);
#pragma GCC unroll 16
              for (int j = 0; j < kChunk; ++j) kt[(db * kChunk + j) * kTileVectors + tb] = x[j];
            }
#else
            // 8 x 8 blocks of native vectors: tokens t0 .. t0 + 7 by dims d0 .. d0 + 7, each dim's 8 tokens
            // landing in half t0 / 8 of its score vector.
            vnat* ktn = reinterpret_cast<vnat*>(kt);
            for (int t0 = 0; t0 < kChunk; t0 += kNativeLanes)
              for (int64_t d0 = 0; d0 < dpad; d0 += kNativeLanes) {
                vnat x[kNativeLanes];
#pragma GCC unroll 8
                for (int t = 0; t < kNativeLanes; ++t)
                  x[t] = t0 + t < nt ? load_nat(k_head + tb_tok[t0 + t] + d0) : vnat{};
                transpose8(x);
#pragma GCC unroll 8
                for (int j = 0; j < kNativeLanes; ++j)
                  ktn[((d0 + j) * kTileVectors + tb) * kSplit + t0 / kNativeLanes] = x[j];
              }
#endif
          } else {
            for (int t = 0; t < kChunk; ++t) {
              const T* ks = k_head + tb_tok[std::min(t, nt - 1)];
              for (int64_t d = 0; d < dpad; ++d)
                ktf[(d * kTileVectors + tb) * kChunk + t] = t < nt && d < D ? to_f32(ks[d]) : 0.0f;
            }
          }
        }
        // V as float32 rows of dv vectors (zero-padded past D).
        for (int t = 0; t < n_valid; ++t) {
          const T* vs = v_head + tok[t];
          if (whole_vectors)
            for (int c = 0; c < dv * kSplit; ++c)
              reinterpret_cast<vnat*>(vt)[t * dv * kSplit + c] = load_nat(vs + c * kNativeLanes);
          else
            for (int64_t d = 0; d < dpad; ++d) vtf[t * dpad + d] = d < D ? to_f32(vs[d]) : 0.0f;
        }
        // Scores by blocks of rows, each only over the vectors its last (furthest) row may see.
        int64_t r = r0;
        for (; r + kScoreRows <= r1; r += kScoreRows)
          block_scores<kScoreRows>(vectors_seen(r + kScoreRows - 1), qb, dpad, kt, dpad, r, s);
        for (; r < r1; ++r) block_scores<1>(vectors_seen(r), qb, dpad, kt, dpad, r, s);
        softmax_step<kTileVectors>(r0, r1, hr, w.sh.group, w.first_pos(), c0, n_valid, dv, s, o, scr.m.data(),
                                   scr.l.data());
        // o[r] += sum_t p[r][t] v[t]: blocks of RB rows keep their accumulators in registers across the tokens
        // their last row sees; the rest, and heads wider than the register budget, row by row.
        r = r0;
        for (; DV > 0 && DV % CB == 0 && r + RB <= r1; r += RB) {
          const int n_seen = tokens_seen(r + RB - 1);
          for (int c0 = 0; c0 < dv; c0 += CB) block_pv<RB, CB>(n_seen, sf, vt, dv, r, c0, o);
        }
        for (; r < r1; ++r) {
          v16f* orow = o + r * dv;
          for (int t = 0, n_seen = tokens_seen(r); t < n_seen; ++t) {
            const float pt = sf[r * kTile + t];
            const v16f* vrow = vt + t * dv;
            for (int c = 0; c < dv; ++c) orow[c] += pt * vrow[c];
          }
        }
      }
      if (c0 + kTile < w.u.kv_hi) {
        std::memcpy(tok, next_tok, sizeof(tok));
        n_valid = n_next;
      }
    }
  }
}

template <typename T, int DV>  // DV: head_dim / 16 rounded up, or 0 for "given at run time"
void run_unit(const Unit& u, const Shapes& sh, int dv_runtime, const T* q, const T* k_pages, const T* v_pages,
              const int32_t* block_tables, float sm_scale, T* out, float* parts, Scratch& scr) {
  const int dv = DV > 0 ? DV : dv_runtime;
  const int64_t D = sh.head_dim, G = sh.group, Hq = sh.num_q_heads;
  const int64_t hr = int64_t(u.num_rows) * G, rows = hr * sh.num_kv_heads;
  float* qb = reinterpret_cast<float*>(scr.q.data());
  v16f* o = scr.o.data();
  auto q_row = [&](int64_t r) {  // element offset of matrix row r in q and out
    const int64_t h = r / hr, i = (r % hr) / G, g = (r % hr) % G;
    return ((u.q_start + u.row0 + i) * Hq + h * G + g) * D;
  };
  for (int64_t r = 0; r < rows; ++r) {
    const T* src = q + q_row(r);
    float* dst = qb + r * dv * kChunk;
    for (int64_t d = 0; d < D; ++d) dst[d] = to_f32(src[d]) * sm_scale;
    for (int64_t d = D; d < dv * kChunk; ++d) dst[d] = 0.0f;
    for (int c = 0; c < dv; ++c) o[r * dv + c] = splat(0.0f);
    scr.m[r] = kMaskValue;
    scr.l[r] = 0.0f;
  }
  const UnitWalk<T> walk{u, sh, dv, hr, rows, k_pages, v_pages, block_tables + int64_t(u.seq) * sh.max_blocks, scr};
  // Reading K and V straight from the cache needs whole vectors per head; otherwise tiles are copied.
  if (D % kChunk == 0 && dv <= kDirectMaxVectors && hr < kCopyRows)
    walk_direct<T, DV>(walk);
  else
    walk_copying<T, DV>(walk);

  if (u.part >= 0) {  // the merge (merge_parts) normalises
    float* dst = parts;  // this unit's slot
    for (int64_t r = 0; r < rows; ++r, dst += dv * kChunk + 2) {
      dst[0] = scr.m[r], dst[1] = scr.l[r];
      std::memcpy(dst + 2, o + r * dv, sizeof(float) * dv * kChunk);
    }
    return;
  }
  for (int64_t r = 0; r < rows; ++r) {
    T* dst = out + q_row(r);
    const float inv = scr.l[r] > 0.0f ? 1.0f / scr.l[r] : 0.0f;
    const float* orow = reinterpret_cast<const float*>(o + r * dv);
    for (int64_t d = 0; d < D; ++d) from_f32(orow[d] * inv, dst + d);
  }
}

// Combines the unnormalised results of block b's `count` parts (slots first .. first + count - 1 of `parts`,
// `slot_floats` apart, written by run_unit) into its rows of out.
template <typename T>
void merge_parts(const Unit& b, int32_t first, int32_t count, const Shapes& sh, int64_t dv, const float* parts,
                 int64_t slot_floats, T* out) {
  const int64_t G = sh.group, D = sh.head_dim, hr = int64_t(b.num_rows) * G, rows = hr * sh.num_kv_heads;
  const int64_t stride = dv * kChunk + 2;
  std::vector<float> acc(D);
  for (int64_t r = 0; r < rows; ++r) {
    float m = kMaskValue;
    for (int32_t j = 0; j < count; ++j) m = std::max(m, parts[(first + j) * slot_floats + r * stride]);
    float l = 0.0f;
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int32_t j = 0; j < count; ++j) {
      const float* part = parts + (first + j) * slot_floats + r * stride;
      const float w = part[1] > 0.0f ? std::exp(part[0] - m) : 0.0f;  // an empty part has l = 0
      l += w * part[1];
      for (int64_t d = 0; d < D; ++d) acc[d] += w * part[2 + d];
    }
    const int64_t h = r / hr, i = (r % hr) / G, g = (r % hr) % G;
    T* dst = out + ((b.q_start + b.row0 + i) * sh.num_q_heads + h * G + g) * D;
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    for (int64_t d = 0; d < D; ++d) from_f32(acc[d] * inv, dst + d);
  }
}

template <typename T>
ffi::Error Attention(ffi::ThreadPool pool, const Shapes& sh, const T* q, const T* k_pages, const T* v_pages,
                     const int32_t* kv_lens, const int32_t* block_tables, const int32_t* cu_q_lens,
                     int64_t max_num_seqs, int32_t num_seqs, float sm_scale, int32_t unit_rows,
                     int32_t min_part_tokens, T* out) {
  std::memset(out, 0, sizeof(T) * sh.num_tokens * sh.num_q_heads * sh.head_dim);
  num_seqs = std::clamp<int32_t>(num_seqs, 0, int32_t(max_num_seqs));
  const int32_t capacity = int32_t(std::min<int64_t>(sh.max_blocks * sh.block_size, INT32_MAX));
  const int32_t rows_per_unit = int32_t(std::max<int64_t>(1, unit_rows / sh.group));
  const int64_t num_threads = std::max<int64_t>(pool.num_threads(), 1);

  // A unit per block of rows_per_unit query rows of a sequence, all KV heads: each unit then reads whole
  // token rows (every head) of its pages, in order.
  std::vector<Unit> blocks;
  int32_t prev_end = 0;
  for (int32_t i = 0; i < num_seqs; ++i) {
    const int32_t start = std::clamp<int32_t>(cu_q_lens[i], prev_end, int32_t(sh.num_tokens));
    const int32_t end = std::clamp<int32_t>(cu_q_lens[i + 1], start, int32_t(sh.num_tokens));
    prev_end = end;
    const int32_t q_len = end - start;
    const int32_t kv_len = std::clamp<int32_t>(kv_lens[i], 0, capacity);
    const int32_t kv_start = kv_len - q_len;  // position of the first query row
    for (int32_t row0 = 0; row0 < q_len; row0 += rows_per_unit) {
      const int32_t n = std::min(rows_per_unit, q_len - row0);
      // Rows at negative positions (kv_len < q_len: inconsistent metadata) see nothing and stay zero.
      const int32_t skip = std::clamp<int32_t>(-(kv_start + row0), 0, n);
      if (skip == n) continue;
      const int32_t extent = kv_start + row0 + n;
      blocks.push_back({i, row0 + skip, n - skip, start, kv_start, 0, extent, -1, int64_t(extent) * (n - skip)});
    }
  }
  // Too few units to keep every thread busy (a few long sequences): split their KV ranges into parts of
  // whole chunks, at least min_part_tokens each, whose unnormalised results merge_parts combines.
  const int64_t parts_per_block =
      (2 * num_threads + int64_t(blocks.size()) - 1) / std::max<int64_t>(int64_t(blocks.size()), 1);
  auto units = std::make_shared<std::vector<Unit>>();
  struct Merge {
    Unit block;
    int32_t first, count;  // its parts' slots
  };
  std::vector<Merge> merges;
  int32_t num_parts = 0;
  for (const Unit& b : blocks) {
    const int64_t chunks = (b.kv_hi + kChunk - 1) / kChunk;
    const int64_t p = std::min<int64_t>(parts_per_block, std::max<int64_t>(1, b.kv_hi / std::max(min_part_tokens, 1)));
    if (p <= 1) {
      units->push_back(b);
      continue;
    }
    merges.push_back({b, num_parts, int32_t(p)});
    for (int64_t j = 0; j < p; ++j) {
      Unit u = b;
      u.kv_lo = int32_t(chunks * j / p * kChunk);
      u.kv_hi = std::min<int32_t>(b.kv_hi, int32_t(chunks * (j + 1) / p * kChunk));
      u.part = num_parts++;
      u.cost = int64_t(u.kv_hi - u.kv_lo) * u.num_rows;
      units->push_back(u);
    }
  }
  // Longest first, so the last units handed out are short ones.
  std::stable_sort(units->begin(), units->end(), [](const Unit& a, const Unit& b) { return a.cost > b.cost; });

  const int64_t dv = (sh.head_dim + kChunk - 1) / kChunk;
  const int64_t max_rows = int64_t(rows_per_unit) * sh.group * sh.num_kv_heads;
  const int64_t part_floats = max_rows * (dv * kChunk + 2);
  auto parts = std::make_shared<std::vector<float>>(size_t(num_parts) * part_floats);
  float* parts_data = parts->data();
  auto run_one = [=](const Unit& u) {
    thread_local Scratch scratch;
    scratch.reserve(dv, max_rows);
    float* slot = u.part >= 0 ? parts_data + u.part * part_floats : nullptr;
    if (dv == 4)
      run_unit<T, 4>(u, sh, dv, q, k_pages, v_pages, block_tables, sm_scale, out, slot, scratch);
    else if (dv == 8)
      run_unit<T, 8>(u, sh, dv, q, k_pages, v_pages, block_tables, sm_scale, out, slot, scratch);
    else
      run_unit<T, 0>(u, sh, dv, q, k_pages, v_pages, block_tables, sm_scale, out, slot, scratch);
  };

  // Every unit, on the caller and the pool (work_sharing.h); `units` is co-owned by the tasks.
  sarathi_cpu::share_work(pool, int64_t(units->size()), [units, run_one](int64_t i) { run_one((*units)[i]); });
  for (const Merge& g : merges) merge_parts(g.block, g.first, g.count, sh, dv, parts_data, part_floats, out);
  return ffi::Error::Success();
}

ffi::Error RaggedPagedAttentionImpl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k_pages,
                                    ffi::AnyBuffer v_pages, ffi::Buffer<ffi::S32> kv_lens,
                                    ffi::Buffer<ffi::S32> block_tables, ffi::Buffer<ffi::S32> cu_q_lens,
                                    ffi::Buffer<ffi::S32> num_seqs, ffi::Result<ffi::AnyBuffer> out,
                                    float sm_scale, int32_t unit_rows, int32_t min_part_tokens) {
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
                              cu_q_lens.typed_data(), max_num_seqs, n, sm_scale, unit_rows, min_part_tokens,
                              out->typed_data<float>());
    case ffi::DataType::BF16:
      return Attention<uint16_t>(pool, sh, q.reinterpret_data<uint16_t>(), k_pages.reinterpret_data<uint16_t>(),
                                 v_pages.reinterpret_data<uint16_t>(), kv_lens.typed_data(),
                                 block_tables.typed_data(), cu_q_lens.typed_data(), max_num_seqs, n, sm_scale,
                                 unit_rows, min_part_tokens, out->reinterpret_data<uint16_t>());
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
                                  .Attr<float>("sm_scale")
                                  .Attr<int32_t>("unit_rows")          // query rows x G per unit and KV head
                                  .Attr<int32_t>("min_part_tokens"));  // shortest KV range of a split part
