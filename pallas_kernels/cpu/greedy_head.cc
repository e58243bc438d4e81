// The LM head and the greedy sampler in one pass, for few rows on CPUs: an XLA FFI custom call
// (pallas_kernels/greedy_head_cpu.py loads it; setup.py builds it into the CPU matmul library).
//
//   h         float32 [R, K]   final-normed rows (R <= kMaxRows)
//   w         float32 [V, K]   the LM head weight, [vocab, embed] (HF's layout, tied or not), read in place
//   banned    int32   [R, B]   ids row r may not pick (min_tokens' stop ids); -1 pads, ids outside [0, V) ignored
//   tokens    int32   [R]      the first v of the largest logits[r, v], banned ids at -inf; V - 1 where those
//                              masked logits hold a NaN; 0 where all of them are -inf
//   logprobs  float32 [R]      logits[r, token] - logsumexp_v logits[r, v], over the raw logits (nothing banned)
//
// That is `sampling_vocab_major.greedy_vocab_major` (and `sampling.sample`'s greedy-only variant) on
// logits = h . w^T, without the logits ever being written: on a CPU the [R, V] logits and the passes that
// reduce them cost about half as much again as the dot.
//
// How: h is transposed once per call into hT [K][P] (P = R rounded up to whole vectors, zero rows after R), so
// a vector holds one logit of 16 (AVX-512; 8 on AVX2) rows. The vocabulary is split into units of kUnitVocab
// ids, handed out to the calling thread and XLA's intra-op pool (work_sharing.h). In a unit, blocks of VB
// weight rows meet hT: VB x NV accumulators (NV = P / lanes) gather, for each k, w[v, k] broadcast times hT[k]
// (each weight float is read once per call, in address order). A finished block is stored to a small buffer
// and folded into per-row running state: the raw logits' running max and sum of exps (logsumexp, rescaled
// once per block), then the banned ids set to -inf, then the masked running max and the first id holding it.
// Units are merged in vocabulary order, so ties keep the first id as on one thread.
// Sums over K run in another order than XLA's dot: logits, and so tokens on exact ties of nearly equal
// logits, can differ from the jnp path by float32 rounding.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "work_sharing.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

#if defined(__AVX512F__)
typedef float vnat __attribute__((vector_size(64)));
typedef int32_t vnat_i __attribute__((vector_size(64)));
constexpr int kAccumulators = 24;  // of 32 registers: the rest hold hT's vectors and a broadcast
#else
typedef float vnat __attribute__((vector_size(32)));
typedef int32_t vnat_i __attribute__((vector_size(32)));
constexpr int kAccumulators = 12;  // of 16
#endif
constexpr int kLanes = int(sizeof(vnat) / sizeof(float));
constexpr int kMaxRows = 64;
constexpr int kMaxVectors = kMaxRows / kLanes;
constexpr int64_t kUnitVocab = 192;  // vocabulary ids per unit of work: a multiple of every block size
constexpr int64_t kPrefetchFloats = 64;  // how far ahead along a weight row (4 cache lines)
constexpr float kInf = std::numeric_limits<float>::infinity();

inline vnat load(const float* p) {
  vnat v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void store(float* p, vnat v) { std::memcpy(p, &v, sizeof(v)); }
inline vnat splat(float x) {  // not `vnat{} + x`: -0.0 keeps that add from folding away
  vnat v;
  for (int i = 0; i < kLanes; ++i) v[i] = x;
  return v;
}
inline vnat vmax(vnat a, vnat b) { return a > b ? a : b; }  // a NaN in a gives b

// exp(x), vectorised (Cephes' expf polynomial, about 1 ulp), for x clamped to [-87.3, 88.7]: what the running
// sums need (their arguments are <= 0 but for the rescaling of an infinite max, handled apart).
inline vnat vexp(vnat x) {
  x = x < splat(-87.3f) ? splat(-87.3f) : x;
  x = x > splat(88.7f) ? splat(88.7f) : x;
  const vnat t = x * splat(1.44269504088896341f) + splat(0.5f);
  vnat_i n = __builtin_convertvector(t, vnat_i);                     // truncation toward zero ...
  n -= (__builtin_convertvector(n, vnat) > t) ? vnat_i{} + 1 : vnat_i{};  // ... made floor
  const vnat nf = __builtin_convertvector(n, vnat);
  const vnat r = x - nf * splat(0.693359375f) - nf * splat(-2.12194440e-4f);
  vnat p = splat(1.9875691500e-4f);
  p = p * r + splat(1.3981999507e-3f);
  p = p * r + splat(8.3334519073e-3f);
  p = p * r + splat(4.1665795894e-2f);
  p = p * r + splat(1.6666665459e-1f);
  p = p * r + splat(5.0000001201e-1f);
  const vnat y = p * r * r + r + splat(1.0f);
  vnat scale;
  const vnat_i bits = (n + 127) << 23;
  std::memcpy(&scale, &bits, sizeof(scale));
  return y * scale;
}

// One unit's running state for every row (P lanes).
struct RowState {
  float raw_max[kMaxRows];  // the largest raw logit seen (NaNs skipped)
  float raw_sum[kMaxRows];  // sum of exp(raw - base), base = raw_max where finite, else 0
  int32_t raw_nan[kMaxRows];
  float best[kMaxRows];     // the largest masked logit seen
  int32_t best_id[kMaxRows];
  int32_t masked_nan[kMaxRows];
};

struct Problem {
  const float* hT;  // [K][P]
  const float* w;   // [V][K]
  int64_t K, V, P;
  const std::pair<int64_t, int32_t>* bans;  // (vocab id, row), sorted by id
  int64_t num_bans;
  float* raw_first;  // [P]: raw logits of vocab id 0
  float* raw_last;   // [P]: of vocab id V - 1
};

// Folds the vb raw logit rows in buf ([vb][P], vocab ids v0 .. v0 + vb - 1, all valid) into state.
template <int NV>
inline void fold(const Problem& pb, float* buf, int vb, int64_t v0, RowState& s) {
  for (int j = 0; j < NV; ++j) {
    const int64_t o = j * kLanes;
    vnat block_max = splat(-kInf);
    vnat_i nan = vnat_i{};
    for (int i = 0; i < vb; ++i) {
      const vnat x = load(buf + i * pb.P + o);
      block_max = vmax(x, block_max);
      nan |= (x != x);
    }
    const vnat old_max = load(s.raw_max + o);
    const vnat new_max = vmax(block_max, old_max);
    // The sums are relative to a finite base: the max where finite (no NaN reaches it), else 0.
    const vnat base = (new_max < splat(kInf)) & (new_max > splat(-kInf)) ? new_max : splat(0.0f);
    const vnat old_base = (old_max < splat(kInf)) & (old_max > splat(-kInf)) ? old_max : splat(0.0f);
    vnat sum = load(s.raw_sum + o) * vexp(old_base - base);
    for (int i = 0; i < vb; ++i) sum += vexp(load(buf + i * pb.P + o) - base);
    store(s.raw_max + o, new_max);
    store(s.raw_sum + o, sum);
    vnat_i raw_nan;
    std::memcpy(&raw_nan, s.raw_nan + o, sizeof(raw_nan));
    raw_nan |= nan;
    std::memcpy(s.raw_nan + o, &raw_nan, sizeof(raw_nan));
  }
  if (v0 == 0) std::memcpy(pb.raw_first, buf, pb.P * sizeof(float));
  if (v0 + vb == pb.V) std::memcpy(pb.raw_last, buf + (vb - 1) * pb.P, pb.P * sizeof(float));
  // Banned ids: -inf in the masked logits (the raw ones above saw them as they are).
  const auto* ban = std::lower_bound(pb.bans, pb.bans + pb.num_bans, std::pair<int64_t, int32_t>(v0, -1));
  for (; ban < pb.bans + pb.num_bans && ban->first < v0 + vb; ++ban) buf[(ban->first - v0) * pb.P + ban->second] = -kInf;
  for (int j = 0; j < NV; ++j) {
    const int64_t o = j * kLanes;
    vnat best = load(s.best + o);
    vnat_i best_id, masked_nan;
    std::memcpy(&best_id, s.best_id + o, sizeof(best_id));
    std::memcpy(&masked_nan, s.masked_nan + o, sizeof(masked_nan));
    for (int i = 0; i < vb; ++i) {
      const vnat x = load(buf + i * pb.P + o);
      masked_nan |= (x != x);
      const vnat_i better = x > best;  // strictly: the first id of the max stays
      best = better ? x : best;
      best_id = better ? vnat_i{} + int32_t(v0 + i) : best_id;
    }
    store(s.best + o, best);
    std::memcpy(s.best_id + o, &best_id, sizeof(best_id));
    std::memcpy(s.masked_nan + o, &masked_nan, sizeof(masked_nan));
  }
}

// Logits of weight rows v0 .. v0 + VB - 1 (all valid) against hT, into buf [VB][P].
template <int NV, int VB>
inline void logits_block(const Problem& pb, int64_t v0, float* buf) {
  vnat acc[VB][NV] = {};
  const float* w = pb.w + v0 * pb.K;
  for (int64_t k = 0; k < pb.K; ++k) {
    // Each weight row is its own stream: fetch a few lines ahead of every one.
    if (k % 16 == 0)
      for (int i = 0; i < VB; ++i) __builtin_prefetch(w + i * pb.K + k + kPrefetchFloats, 0, 3);
    vnat hv[NV];
    for (int j = 0; j < NV; ++j) hv[j] = load(pb.hT + k * pb.P + j * kLanes);
    for (int i = 0; i < VB; ++i) {
      const float wk = w[i * pb.K + k];  // broadcast by the multiply
      for (int j = 0; j < NV; ++j) acc[i][j] += hv[j] * wk;
    }
  }
  for (int i = 0; i < VB; ++i)
    for (int j = 0; j < NV; ++j) store(buf + i * pb.P + j * kLanes, acc[i][j]);
}

template <int NV>
void unit(const Problem& pb, int64_t v0, int64_t v1, RowState& s) {
  // One vector of rows: 12 weight rows a block, not 24 (the rows are the streams the block reads at once; 24
  // took 1.4x the time of 12 on the 60M Llama's and SmolLM2's heads).
  constexpr int VB = NV == 1 ? 12 : (kAccumulators / NV > 0 ? kAccumulators / NV : 1);
  float buf[VB * kMaxRows];
  for (int64_t r = 0; r < pb.P; ++r) {
    s.raw_max[r] = -kInf, s.raw_sum[r] = 0.0f, s.raw_nan[r] = 0;
    s.best[r] = -kInf, s.best_id[r] = 0, s.masked_nan[r] = 0;
  }
  int64_t v = v0;
  for (; v + VB <= v1; v += VB) {
    logits_block<NV, VB>(pb, v, buf);
    fold<NV>(pb, buf, VB, v, s);
  }
  for (; v < v1; ++v) {  // the vocabulary's tail, a row at a time
    logits_block<NV, 1>(pb, v, buf);
    fold<NV>(pb, buf, 1, v, s);
  }
}

template <int NV>
void run_units(ffi::ThreadPool& pool, const Problem& pb, std::vector<RowState>& states) {
  const int64_t num_units = int64_t(states.size());
  RowState* out = states.data();
  sarathi_cpu::share_work(pool, num_units, [pb, out](int64_t u) {
    unit<NV>(pb, u * kUnitVocab, std::min(pb.V, (u + 1) * kUnitVocab), out[u]);
  });
}

ffi::Error GreedyHeadImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> h, ffi::Buffer<ffi::F32> w,
                          ffi::Buffer<ffi::S32> banned, ffi::ResultBuffer<ffi::S32> tokens,
                          ffi::ResultBuffer<ffi::F32> logprobs) {
  auto hd = h.dimensions(), wd = w.dimensions(), bd = banned.dimensions();
  if (hd.size() != 2 || wd.size() != 2 || bd.size() != 2 || hd[1] != wd[1] || bd[0] != hd[0] ||
      tokens->dimensions().size() != 1 || tokens->dimensions()[0] != hd[0] || logprobs->dimensions().size() != 1 ||
      logprobs->dimensions()[0] != hd[0])
    return ffi::Error::InvalidArgument(
        "greedy_head_cpu: h must be [R, K], w [V, K], banned [R, B], tokens and logprobs [R]");
  const int64_t R = hd[0], K = hd[1], V = wd[0], B = bd[1];
  if (R > kMaxRows) return ffi::Error::InvalidArgument("greedy_head_cpu: at most 64 rows");
  if (V == 0) return ffi::Error::InvalidArgument("greedy_head_cpu: an empty vocabulary");
  if (R == 0) return ffi::Error::Success();
  const int64_t NV = (R + kLanes - 1) / kLanes, P = NV * kLanes;

  std::vector<float> hT(std::max<int64_t>(K, 1) * P, 0.0f);  // [K][P], rows past R zero
  const float* hp = h.typed_data();
  for (int64_t r = 0; r < R; ++r)
    for (int64_t k = 0; k < K; ++k) hT[k * P + r] = hp[r * K + k];
  std::vector<std::pair<int64_t, int32_t>> bans;
  const int32_t* bp = banned.typed_data();
  for (int64_t r = 0; r < R; ++r)
    for (int64_t b = 0; b < B; ++b)
      if (bp[r * B + b] >= 0 && bp[r * B + b] < V) bans.emplace_back(bp[r * B + b], int32_t(r));
  std::sort(bans.begin(), bans.end());
  std::vector<float> raw_first(P), raw_last(P);
  const Problem pb{hT.data(), w.typed_data(), K, V, P, bans.data(), int64_t(bans.size()), raw_first.data(),
                   raw_last.data()};
  std::vector<RowState> states((V + kUnitVocab - 1) / kUnitVocab);
  switch (NV) {
    case 1: run_units<1>(pool, pb, states); break;
    case 2: run_units<2>(pool, pb, states); break;
    case 3: run_units<3>(pool, pb, states); break;
    case 4: run_units<4>(pool, pb, states); break;
#if !defined(__AVX512F__)
    case 5: run_units<5>(pool, pb, states); break;
    case 6: run_units<6>(pool, pb, states); break;
    case 7: run_units<7>(pool, pb, states); break;
    case 8: run_units<8>(pool, pb, states); break;
#endif
    default: return ffi::Error::Internal("greedy_head_cpu: unexpected vector count");
  }

  // Merge the units in vocabulary order (strict comparisons: the first id of the max stays), in double.
  int32_t* tp = tokens->typed_data();
  float* lp = logprobs->typed_data();
  for (int64_t r = 0; r < R; ++r) {
    double raw_max = -INFINITY, raw_sum = 0.0;
    bool raw_nan = false, masked_nan = false;
    float best = -kInf;
    int32_t best_id = 0;
    for (const RowState& s : states) {
      raw_nan |= s.raw_nan[r] != 0;
      masked_nan |= s.masked_nan[r] != 0;
      if (s.best[r] > best) best = s.best[r], best_id = s.best_id[r];
      const double m = s.raw_max[r], sum = s.raw_sum[r];
      const double base = std::isfinite(m) ? m : 0.0;  // the unit's sum is relative to this
      if (m > raw_max) {
        const double old_base = std::isfinite(raw_max) ? raw_max : 0.0;
        const double new_base = std::isfinite(m) ? m : 0.0;
        raw_sum = raw_sum * std::exp(old_base - new_base) + sum * std::exp(base - new_base);
        raw_max = m;
      } else {
        const double cur_base = std::isfinite(raw_max) ? raw_max : 0.0;
        raw_sum += sum * std::exp(base - cur_base);
      }
    }
    double lse;
    if (raw_nan) lse = NAN;
    else if (raw_max == INFINITY) lse = INFINITY;
    else if (raw_max == -INFINITY) lse = -INFINITY;
    else lse = raw_max + std::log(raw_sum);
    int32_t token;
    double chosen;
    if (masked_nan) token = int32_t(V - 1), chosen = raw_last[r];
    else if (best == -kInf) token = 0, chosen = raw_first[r];
    else token = best_id, chosen = best;
    tp[r] = token;
    lp[r] = float(chosen - lse);
  }
  return ffi::Error::Success();
}

}  // namespace

extern "C" __attribute__((visibility("default"))) XLA_FFI_Error* SarathiGreedyHead(XLA_FFI_CallFrame*);

XLA_FFI_DEFINE_HANDLER_SYMBOL(SarathiGreedyHead, GreedyHeadImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()    // h [R, K]
                                  .Arg<ffi::Buffer<ffi::F32>>()    // w [V, K]
                                  .Arg<ffi::Buffer<ffi::S32>>()    // banned [R, B]
                                  .Ret<ffi::Buffer<ffi::S32>>()    // tokens [R]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // logprobs [R]
