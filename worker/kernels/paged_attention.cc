// Paged attention on the CPU, reading K/V blocks of the cache in place (no gather), as one Paddle
// custom operator for a whole step: decode sequences (one query token) and prefill chunks (a chunk may
// follow a cached prefix; causal mask aligned bottom-right) alike.
//
// Cache layout (worker/attention.py): k_cache, v_cache [num_blocks, kv_heads, block_size, head_dim]
// float32; the step's new K/V are already written into it. kv_heads comes from the cache shape (a
// tensor-parallel rank holds kv_heads / tp of them), heads from q, group = heads / kv_heads.
//
// Work item = (sequence, kv head, run of query tokens); its rows are the tokens x the group's query
// heads (token-major). Every path is flash-attention style: keys visited in passes, online softmax in
// float32 (running max m, running sum l, output rescaled when m grows), P x V accumulated straight
// from the cache rows; memory per item is O(rows x head_dim), no score matrix over the whole context.
// Items run under OpenMP, handed out longest first. Two AVX-512 paths:
//
// - prefill ("lanes"): up to 64 query rows of an item sit in the 16 lanes of up to 4 vectors, queries
//   transposed to [head_dim][rows]. Scores of 4 keys x the rows are a GEMM micro-tile (a broadcast
//   K element times a vector of queries; 16 independent accumulators, loads <= FMAs), the softmax's
//   max and sum run across keys lane-wise (no horizontal reductions), and P x V is another micro-tile
//   (a broadcast V element times a vector of probabilities). K and V rows are read where they are.
// - decode (few rows): dot products of each query row with each cached K row.
// Other head sizes and CPUs without AVX-512 take a compiler-vectorised path.
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "paddle/extension.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int kKeyTile = 16;     // keys per tile: one 512-bit vector of scores per query row
constexpr int kRowBlock = 4;     // query rows sharing one K-tile load
constexpr int kQueryTile = 32;   // query tokens per work item (prefill, compiler-vectorised path)
constexpr int64_t kParallelMinWork = 1 << 18;  // multiply-adds (keys x rows x head_dim) worth a parallel region
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// exp(x) for x <= 0 (scores minus their running max), written with arithmetic and bit operations
// only so that the compiler vectorises loops over it (libm's expf is a scalar call). exp(x) =
// 2^n * 2^f with n = round(x log2 e); 2^f by a degree-6 polynomial (relative error ~2e-7, below
// float32's rounding of the sums). Inputs below -87 return 0 (the float32 result would be denormal).
inline float fast_exp(float x) {
  const float clamped = std::max(x, -87.0f);
  const float t = clamped * 1.44269504088896341f;
  // Round to nearest by adding and subtracting 1.5 * 2^23 (|t| < 2^22 here); vectorises, unlike nearbyint.
  const float n = (t + 12582912.0f) - 12582912.0f;
  const float f = t - n;  // in [-0.5, 0.5]
  float p = 1.5353362e-4f;
  p = p * f + 1.3398874e-3f;
  p = p * f + 9.6180329e-3f;
  p = p * f + 5.5504109e-2f;
  p = p * f + 2.4022651e-1f;
  p = p * f + 6.9314718e-1f;
  p = p * f + 1.0f;
  int32_t bits;
  std::memcpy(&bits, &p, sizeof(bits));
  bits += static_cast<int32_t>(n) << 23;
  float result;
  std::memcpy(&result, &bits, sizeof(result));
  return x < -87.0f ? 0.0f : result;
}

struct Sequence {
  int64_t query_start;   // first row of q
  int64_t query_len;
  int64_t context_len;   // keys 0..context_len-1; query i sits at position context_len - query_len + i
  const int64_t* table;  // block ids
};

struct Item {
  int32_t seq;
  int32_t kv_head;
  int32_t first_token;  // within the sequence's query
  int32_t num_tokens;
  int64_t cost;         // keys visited x rows, for ordering
  bool lanes;           // the AVX-512 prefill path (rows in vector lanes)
};

// Per-thread scratch.
struct Scratch {
  std::vector<float> q;    // [rows, D] scaled queries
  std::vector<float> o;    // [rows, D] output accumulators
  std::vector<float> m, l; // [rows] running max and sum
  std::vector<float> kt;   // [D, kKeyTile] transposed key tile
  std::vector<const float*> v_rows;  // [kKeyTile] value rows of the tile
};

struct Problem {
  const float* q;
  const float* k_cache;
  const float* v_cache;
  float* out;
  int64_t heads, kv_heads, block_size, head_dim, group;
  float scale;
};

inline const float* cache_row(const float* cache, const Problem& p, const int64_t* table, int64_t pos,
                              int64_t kv_head) {
  const int64_t block = table[pos / p.block_size];
  return cache + ((block * p.kv_heads + kv_head) * p.block_size + pos % p.block_size) * p.head_dim;
}

// Scores of NR rows against one transposed key tile, masked, folded into the online softmax, and
// P x V accumulated. D is the head size when known at compile time (0: runtime p.head_dim).
template <int D, int NR>
void row_block(const Problem& p, Scratch& s, int row0, const int64_t* positions, int64_t key0, int keys) {
  const int64_t hd = D ? D : p.head_dim;
  float scores[NR][kKeyTile];
  for (int r = 0; r < NR; ++r)
    for (int j = 0; j < kKeyTile; ++j) scores[r][j] = 0.0f;
  const float* kt = s.kt.data();
  for (int64_t d = 0; d < hd; ++d) {
    const float* krow = kt + d * kKeyTile;
    for (int r = 0; r < NR; ++r) {
      const float qv = s.q[(row0 + r) * hd + d];
#pragma omp simd
      for (int j = 0; j < kKeyTile; ++j) scores[r][j] += qv * krow[j];
    }
  }
  for (int r = 0; r < NR; ++r) {
    const int row = row0 + r;
    const int64_t visible = positions[r] - key0 + 1;  // keys of this tile the row may see
    float tile_max = kNegInf;
    for (int j = 0; j < kKeyTile; ++j) {
      if (j >= keys || j >= visible) scores[r][j] = kNegInf;
      tile_max = std::max(tile_max, scores[r][j]);
    }
    if (tile_max == kNegInf) {  // nothing visible in this tile for this row: zero weights for P x V
      for (int j = 0; j < kKeyTile; ++j) scores[r][j] = 0.0f;
      continue;
    }
    const float m_new = std::max(s.m[row], tile_max);
    const float correction = fast_exp(s.m[row] - m_new);  // exp(-inf) = 0 on the first tile
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int j = 0; j < kKeyTile; ++j) {
      const float e = scores[r][j] == kNegInf ? 0.0f : fast_exp(scores[r][j] - m_new);
      scores[r][j] = e;
      sum += e;
    }
    s.l[row] = s.l[row] * correction + sum;
    s.m[row] = m_new;
    float* o = s.o.data() + row * hd;
    if (correction != 1.0f) {
#pragma omp simd
      for (int64_t d = 0; d < hd; ++d) o[d] *= correction;
    }
  }
  // P x V: each value row is read once for the NR rows.
  const int usable = keys;
  for (int j = 0; j < usable; ++j) {
    const float* v = s.v_rows[j];
    for (int r = 0; r < NR; ++r) {
      const float w = scores[r][j];
      if (w == 0.0f) continue;
      float* o = s.o.data() + (row0 + r) * hd;
#pragma omp simd
      for (int64_t d = 0; d < hd; ++d) o[d] += w * v[d];
    }
  }
}

#if defined(__AVX512F__)
// ---------------------------------------------------------------------------------- AVX-512 path
// Used for head_dim 64 and 128. A row block's output stays in registers over a chunk of keys.

constexpr int kChunkKeys = 256;  // keys per chunk: their K and V rows (128 KiB at D=64) stay in L2

inline __m512 exp512(__m512 x) {  // the vector twin of fast_exp (x <= 0)
  const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 poly = _mm512_set1_ps(1.5353362e-4f);
  poly = _mm512_fmadd_ps(poly, f, _mm512_set1_ps(1.3398874e-3f));
  poly = _mm512_fmadd_ps(poly, f, _mm512_set1_ps(9.6180329e-3f));
  poly = _mm512_fmadd_ps(poly, f, _mm512_set1_ps(5.5504109e-2f));
  poly = _mm512_fmadd_ps(poly, f, _mm512_set1_ps(2.4022651e-1f));
  poly = _mm512_fmadd_ps(poly, f, _mm512_set1_ps(6.9314718e-1f));
  poly = _mm512_fmadd_ps(poly, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(poly, n);
}

// Rows row0..row0+NR-1 against keys [key_begin, key_end) (tile aligned), K by dot products with the
// cache rows (decode: a few rows, nothing to amortise a reordering of K over).
template <int D, int NR>
void block_avx512(const Problem& p, const Sequence& seq, int kv_head, Scratch& s, int row0, const int64_t* pos,
                  int64_t key_begin, int64_t key_end) {
  constexpr int DV = D / 16;
  __m512 o[NR][DV];
  float m[NR], l[NR];
  const float* q[NR];
  for (int r = 0; r < NR; ++r) {
    m[r] = s.m[row0 + r];
    l[r] = s.l[row0 + r];
    q[r] = s.q.data() + (row0 + r) * D;
    for (int c = 0; c < DV; ++c) o[r][c] = _mm512_loadu_ps(s.o.data() + (row0 + r) * D + 16 * c);
  }
  alignas(64) float probs[NR][kKeyTile];
  for (int64_t key0 = key_begin; key0 < key_end; key0 += kKeyTile) {
    if (pos[NR - 1] < key0) break;  // rows are in position order: later tiles are masked for all
    const int keys = static_cast<int>(std::min<int64_t>(kKeyTile, key_end - key0));
    __m512 sc[NR];
    alignas(64) float dots[NR][kKeyTile] = {};
    for (int j = 0; j < keys; ++j) {
      const float* k = cache_row(p.k_cache, p, seq.table, key0 + j, kv_head);
      __m512 kv[DV];
      for (int c = 0; c < DV; ++c) kv[c] = _mm512_loadu_ps(k + 16 * c);
      for (int r = 0; r < NR; ++r) {
        __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(q[r]), kv[0]);
        for (int c = 1; c < DV; ++c) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q[r] + 16 * c), kv[c], acc);
        dots[r][j] = _mm512_reduce_add_ps(acc);
      }
    }
    for (int r = 0; r < NR; ++r) sc[r] = _mm512_load_ps(dots[r]);
    for (int r = 0; r < NR; ++r) {
      const int64_t count = std::min<int64_t>(keys, pos[r] - key0 + 1);  // keys of the tile row r may see
      if (count <= 0) {
        _mm512_store_ps(probs[r], _mm512_setzero_ps());
        continue;
      }
      const __mmask16 mask = count >= kKeyTile ? static_cast<__mmask16>(0xFFFF)
                                               : static_cast<__mmask16>((1u << count) - 1u);
      const float m_new = std::max(m[r], _mm512_mask_reduce_max_ps(mask, sc[r]));
      const __m512 e = _mm512_maskz_mov_ps(mask, exp512(_mm512_sub_ps(sc[r], _mm512_set1_ps(m_new))));
      const float correction = fast_exp(m[r] - m_new);  // 0 on the row's first tile (m = -inf)
      l[r] = l[r] * correction + _mm512_reduce_add_ps(e);
      m[r] = m_new;
      if (correction != 1.0f) {
        const __m512 cv = _mm512_set1_ps(correction);
        for (int c = 0; c < DV; ++c) o[r][c] = _mm512_mul_ps(o[r][c], cv);
      }
      _mm512_store_ps(probs[r], e);
    }
    for (int j = 0; j < keys; ++j) {
      const float* v = cache_row(p.v_cache, p, seq.table, key0 + j, kv_head);
      __m512 vv[DV];
      for (int c = 0; c < DV; ++c) vv[c] = _mm512_loadu_ps(v + 16 * c);
      for (int r = 0; r < NR; ++r) {
        const __m512 w = _mm512_set1_ps(probs[r][j]);
        for (int c = 0; c < DV; ++c) o[r][c] = _mm512_fmadd_ps(w, vv[c], o[r][c]);
      }
    }
  }
  for (int r = 0; r < NR; ++r) {
    s.m[row0 + r] = m[r];
    s.l[row0 + r] = l[r];
    for (int c = 0; c < DV; ++c) _mm512_storeu_ps(s.o.data() + (row0 + r) * D + 16 * c, o[r][c]);
  }
}

template <int D>
void item_avx512(const Problem& p, const Sequence& seq, int kv_head, Scratch& s, int rows, const int64_t* pos,
                 int64_t key_end) {
  constexpr int NR = D >= 128 ? 2 : 4;  // NR x D/16 output registers + scores must fit in 32 zmm
  for (int64_t chunk = 0; chunk < key_end; chunk += kChunkKeys) {
    const int64_t chunk_end = std::min<int64_t>(chunk + kChunkKeys, key_end);
    int row0 = 0;
    for (; row0 + NR <= rows; row0 += NR) {
      if (pos[row0 + NR - 1] < chunk) continue;
      block_avx512<D, NR>(p, seq, kv_head, s, row0, pos + row0, chunk, chunk_end);
    }
    for (; row0 < rows; ++row0)
      block_avx512<D, 1>(p, seq, kv_head, s, row0, pos + row0, chunk, chunk_end);
  }
}

// ------------------------------------------------------------------ prefill: query rows in lanes

constexpr int kLanes = 16;
constexpr int kMaxRowVectors = 4;                        // up to 64 query rows per item
constexpr int kLaneRows = kLanes * kMaxRowVectors;
constexpr int kLaneMinRows = 16;                         // fewer rows: the decode path (lanes would idle)
constexpr int kPassKeys = 64;                            // keys scored, softmaxed and applied per pass
constexpr int kKeysPerTile = 6;                          // keys per score micro-tile
constexpr int kDimsPerTile = 6;                          // head dims per P x V micro-tile

// Aligned per-thread buffers of the lanes path (W = row vectors x 16 floats per row of these arrays).
struct LaneScratch {
  std::vector<__m512> qt;     // [D][W] scaled queries, transposed
  std::vector<__m512> ot;     // [D][W] output accumulators, transposed
  std::vector<__m512> probs;  // [kPassKeys][W] scores, then probabilities
  __m512 m[kMaxRowVectors], l[kMaxRowVectors];
  __m512i pos[kMaxRowVectors];
  const float* k_rows[kPassKeys];
  const float* v_rows[kPassKeys];
};

// probs[kk][lanes] = K[kk] . Qt[.][lanes] for KB keys: KB x RV accumulators, one broadcast K element
// feeds RV FMAs.
template <int RV, int KB>
inline void score_tile(const __m512* qt, int64_t D, const float* const* k, __m512* probs) {
  __m512 acc[KB][RV];
  for (int kb = 0; kb < KB; ++kb)
    for (int rv = 0; rv < RV; ++rv) acc[kb][rv] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    __m512 qv[RV];
    for (int rv = 0; rv < RV; ++rv) qv[rv] = qt[d * RV + rv];
    for (int kb = 0; kb < KB; ++kb) {
      const __m512 kv = _mm512_set1_ps(k[kb][d]);
      for (int rv = 0; rv < RV; ++rv) acc[kb][rv] = _mm512_fmadd_ps(kv, qv[rv], acc[kb][rv]);
    }
  }
  for (int kb = 0; kb < KB; ++kb)
    for (int rv = 0; rv < RV; ++rv) probs[kb * RV + rv] = acc[kb][rv];
}

// Online softmax of one pass, lane-wise: scores -> probabilities in place, m and l updated, the output
// accumulators rescaled where the running max grew. Every row sees key 0, so after the first pass m is
// finite in every lane; on the first pass exp(-inf - m) clamps to ~1e-38, multiplying zeros.
template <int RV>
inline void softmax_pass(LaneScratch& s, int64_t D, int keys, int64_t key0, bool masked) {
  for (int rv = 0; rv < RV; ++rv) {
    const __m512 m_old = s.m[rv];
    __m512 m_new = m_old;
    for (int kk = 0; kk < keys; ++kk) {
      __m512 sc = s.probs[kk * RV + rv];
      if (masked) {
        const __mmask16 visible = _mm512_cmpge_epi32_mask(s.pos[rv], _mm512_set1_epi32(static_cast<int>(key0 + kk)));
        sc = _mm512_mask_mov_ps(_mm512_set1_ps(kNegInf), visible, sc);
        s.probs[kk * RV + rv] = sc;
      }
      m_new = _mm512_max_ps(m_new, sc);
    }
    __m512 sum = _mm512_setzero_ps();
    for (int kk = 0; kk < keys; ++kk) {
      __m512 e = exp512(_mm512_sub_ps(s.probs[kk * RV + rv], m_new));
      if (masked) {
        const __mmask16 visible = _mm512_cmpge_epi32_mask(s.pos[rv], _mm512_set1_epi32(static_cast<int>(key0 + kk)));
        e = _mm512_maskz_mov_ps(visible, e);
      }
      s.probs[kk * RV + rv] = e;
      sum = _mm512_add_ps(sum, e);
    }
    const __m512 correction = exp512(_mm512_sub_ps(m_old, m_new));
    s.l[rv] = _mm512_fmadd_ps(s.l[rv], correction, sum);
    s.m[rv] = m_new;
    if (_mm512_cmp_ps_mask(m_new, m_old, _CMP_NEQ_OQ) != 0) {  // most passes after the first change nothing
      for (int64_t d = 0; d < D; ++d) s.ot[d * RV + rv] = _mm512_mul_ps(s.ot[d * RV + rv], correction);
    }
  }
}

// Ot[d][lanes] += sum over the pass's keys of V[kk][d] * P[kk][lanes] for DB dims from d0: DB x RV
// accumulators, one broadcast V element feeds RV FMAs.
template <int RV, int DB>
inline void value_tile(LaneScratch& s, int64_t d0, int keys) {
  __m512 acc[DB][RV];
  for (int dd = 0; dd < DB; ++dd)
    for (int rv = 0; rv < RV; ++rv) acc[dd][rv] = s.ot[(d0 + dd) * RV + rv];
  for (int kk = 0; kk < keys; ++kk) {
    __m512 pv[RV];
    for (int rv = 0; rv < RV; ++rv) pv[rv] = s.probs[kk * RV + rv];
    const float* v = s.v_rows[kk] + d0;
    for (int dd = 0; dd < DB; ++dd) {
      const __m512 vv = _mm512_set1_ps(v[dd]);
      for (int rv = 0; rv < RV; ++rv) acc[dd][rv] = _mm512_fmadd_ps(vv, pv[rv], acc[dd][rv]);
    }
  }
  for (int dd = 0; dd < DB; ++dd)
    for (int rv = 0; rv < RV; ++rv) s.ot[(d0 + dd) * RV + rv] = acc[dd][rv];
}

// D (a multiple of 4) = 6a + 4b with b <= 2: tiles of 6 dims, then one or two of 4.
template <int RV>
inline void apply_values(LaneScratch& s, int64_t D, int keys) {
  static_assert(kDimsPerTile == 6, "the split of D below assumes tiles of 6 and 4 dims");
  const int64_t fours = D % 6 == 0 ? 0 : (D % 6 == 4 ? 1 : 2);
  const int64_t sixes_end = D - 4 * fours;
  int64_t d0 = 0;
  for (; d0 < sixes_end; d0 += kDimsPerTile) value_tile<RV, kDimsPerTile>(s, d0, keys);
  for (; d0 < D; d0 += 4) value_tile<RV, 4>(s, d0, keys);
}

// One lanes item: rows = tokens x group <= 64, padded to RV x 16 lanes by repeating the last row (its
// results are finite and dropped).
template <int RV>
void run_lanes_item(const Problem& p, const Sequence& seq, const Item& item, LaneScratch& s) {
  constexpr int W = RV * kLanes;
  const int64_t D = p.head_dim;
  const int64_t group = p.group;
  const int rows = item.num_tokens * static_cast<int>(group);
  const int64_t first_position = seq.context_len - seq.query_len + item.first_token;
  s.qt.resize(D * RV);
  s.ot.assign(D * RV, _mm512_setzero_ps());
  s.probs.resize(kPassKeys * RV);
  float* qt = reinterpret_cast<float*>(s.qt.data());
  alignas(64) int32_t positions[W];
  for (int lane = 0; lane < W; ++lane) {
    const int row = std::min(lane, rows - 1);
    const int64_t t = row / group;
    positions[lane] = static_cast<int32_t>(first_position + t);
    const int64_t q_row = seq.query_start + item.first_token + t;
    const float* src = p.q + (q_row * p.heads + item.kv_head * group + row % group) * D;
    for (int64_t d = 0; d < D; ++d) qt[d * W + lane] = src[d] * p.scale;
  }
  for (int rv = 0; rv < RV; ++rv) {
    s.pos[rv] = _mm512_load_si512(positions + rv * kLanes);
    s.m[rv] = _mm512_set1_ps(kNegInf);
    s.l[rv] = _mm512_setzero_ps();
  }
  const int64_t all_see_up_to = first_position;                // every row sees keys <= its first token's
  const int64_t key_end = first_position + item.num_tokens;    // no row sees a key past the last token
  for (int64_t key0 = 0; key0 < key_end; key0 += kPassKeys) {
    const int keys = static_cast<int>(std::min<int64_t>(kPassKeys, key_end - key0));
    for (int kk = 0; kk < keys; ++kk) {
      s.k_rows[kk] = cache_row(p.k_cache, p, seq.table, key0 + kk, item.kv_head);
      s.v_rows[kk] = cache_row(p.v_cache, p, seq.table, key0 + kk, item.kv_head);
    }
    int kk = 0;
    for (; kk + kKeysPerTile <= keys; kk += kKeysPerTile)
      score_tile<RV, kKeysPerTile>(s.qt.data(), D, s.k_rows + kk, s.probs.data() + kk * RV);
    if (kk + 4 <= keys) { score_tile<RV, 4>(s.qt.data(), D, s.k_rows + kk, s.probs.data() + kk * RV); kk += 4; }
    for (; kk < keys; ++kk) score_tile<RV, 1>(s.qt.data(), D, s.k_rows + kk, s.probs.data() + kk * RV);
    softmax_pass<RV>(s, D, keys, key0, key0 + keys - 1 > all_see_up_to);
    apply_values<RV>(s, D, keys);
  }
  const float* ot = reinterpret_cast<const float*>(s.ot.data());
  alignas(64) float inv_l[W];
  for (int rv = 0; rv < RV; ++rv) _mm512_store_ps(inv_l + rv * kLanes, _mm512_div_ps(_mm512_set1_ps(1.0f), s.l[rv]));
  for (int row = 0; row < rows; ++row) {
    const int64_t t = row / group;
    const int64_t q_row = seq.query_start + item.first_token + t;
    float* dst = p.out + (q_row * p.heads + item.kv_head * group + row % group) * D;
    for (int64_t d = 0; d < D; ++d) dst[d] = ot[d * W + row] * inv_l[row];
  }
}

void run_lanes(const Problem& p, const Sequence& seq, const Item& item, LaneScratch& s) {
  switch ((item.num_tokens * p.group + kLanes - 1) / kLanes) {
    case 1: run_lanes_item<1>(p, seq, item, s); break;
    case 2: run_lanes_item<2>(p, seq, item, s); break;
    case 3: run_lanes_item<3>(p, seq, item, s); break;
    default: run_lanes_item<4>(p, seq, item, s); break;
  }
}

// The lanes path serves a sequence when it has enough query rows, head_dim splits into P x V tiles and
// a whole token's group fits in one item.
bool lanes_fit(const Problem& p, const Sequence& seq) {
  return seq.query_len * p.group >= kLaneMinRows && p.head_dim % 4 == 0 && p.group <= kLaneRows;
}
#endif  // __AVX512F__

template <int D>
void run_item(const Problem& p, const Sequence& seq, const Item& item, Scratch& s) {
  const int64_t hd = D ? D : p.head_dim;
  const int64_t group = p.group;
  const int rows = item.num_tokens * static_cast<int>(group);
  s.q.resize(rows * hd);
  s.o.assign(rows * hd, 0.0f);
  s.m.assign(rows, kNegInf);
  s.l.assign(rows, 0.0f);
  s.kt.resize(hd * kKeyTile);
  s.v_rows.resize(kKeyTile);
  std::vector<int64_t> positions(rows + kRowBlock);
  const int64_t first_position = seq.context_len - seq.query_len + item.first_token;
  for (int t = 0; t < item.num_tokens; ++t) {
    const int64_t q_row = seq.query_start + item.first_token + t;
    for (int64_t g = 0; g < group; ++g) {
      const int row = t * group + g;
      positions[row] = first_position + t;
      const float* src = p.q + (q_row * p.heads + item.kv_head * group + g) * hd;
      float* dst = s.q.data() + row * hd;
      for (int64_t d = 0; d < hd; ++d) dst[d] = src[d] * p.scale;
    }
  }
  const int64_t key_end = first_position + item.num_tokens;  // keys after the last query are masked for all
#if defined(__AVX512F__)
  if (D == 64 || D == 128) {
    item_avx512<D ? D : 64>(p, seq, item.kv_head, s, rows, positions.data(), key_end);
  } else
#endif
  for (int64_t key0 = 0; key0 < key_end; key0 += kKeyTile) {
    const int keys = static_cast<int>(std::min<int64_t>(kKeyTile, key_end - key0));
    float* kt = s.kt.data();
    for (int j = 0; j < keys; ++j) {
      const float* k = cache_row(p.k_cache, p, seq.table, key0 + j, item.kv_head);
      for (int64_t d = 0; d < hd; ++d) kt[d * kKeyTile + j] = k[d];
      s.v_rows[j] = cache_row(p.v_cache, p, seq.table, key0 + j, item.kv_head);
    }
    for (int j = keys; j < kKeyTile; ++j)
      for (int64_t d = 0; d < hd; ++d) kt[d * kKeyTile + j] = 0.0f;
    int row0 = 0;
    // Rows are token-major: a block whose first row cannot see key0 cannot see the whole tile.
    for (; row0 + kRowBlock <= rows; row0 += kRowBlock) {
      if (positions[row0 + kRowBlock - 1] < key0) continue;
      row_block<D, kRowBlock>(p, s, row0, positions.data() + row0, key0, keys);
    }
    switch (rows - row0) {
      case 3: row_block<D, 3>(p, s, row0, positions.data() + row0, key0, keys); break;
      case 2: row_block<D, 2>(p, s, row0, positions.data() + row0, key0, keys); break;
      case 1: row_block<D, 1>(p, s, row0, positions.data() + row0, key0, keys); break;
      default: break;
    }
  }
  for (int t = 0; t < item.num_tokens; ++t) {
    const int64_t q_row = seq.query_start + item.first_token + t;
    for (int64_t g = 0; g < group; ++g) {
      const int row = t * group + g;
      const float inv = 1.0f / s.l[row];
      const float* o = s.o.data() + row * hd;
      float* dst = p.out + (q_row * p.heads + item.kv_head * group + g) * hd;
      for (int64_t d = 0; d < hd; ++d) dst[d] = o[d] * inv;
    }
  }
}

#if defined(__AVX512F__)
constexpr int64_t kLaneRowsLimit = kLaneRows;
#else
constexpr int64_t kLaneRowsLimit = 1;
#endif

void check(bool ok, const char* message) { PD_CHECK(ok, message); }

// Attention for every sequence of the step into p.out; checks the per-sequence inputs against the cache.
void attend(Problem& p, int64_t num_tokens, int64_t num_blocks, const paddle::Tensor& block_tables,
            const paddle::Tensor& query_starts, const paddle::Tensor& query_lens, const paddle::Tensor& context_lens) {
  check(block_tables.dtype() == paddle::DataType::INT64 && query_starts.dtype() == paddle::DataType::INT64 &&
            query_lens.dtype() == paddle::DataType::INT64 && context_lens.dtype() == paddle::DataType::INT64,
        "fd_paged_attention: block tables and lengths must be int64");
  const auto ts = block_tables.shape();
  check(ts.size() == 2, "fd_paged_attention: block_tables [S, max_blocks]");
  const int64_t num_seqs = ts[0];
  check(query_starts.numel() == num_seqs && query_lens.numel() == num_seqs && context_lens.numel() == num_seqs,
        "fd_paged_attention: one start, query length and context length per sequence");
  const int64_t* tables = block_tables.data<int64_t>();
  std::vector<Sequence> seqs(num_seqs);
  std::vector<Item> items;
  for (int64_t i = 0; i < num_seqs; ++i) {
    Sequence seq{query_starts.data<int64_t>()[i], query_lens.data<int64_t>()[i], context_lens.data<int64_t>()[i],
                 tables + i * ts[1]};
    check(seq.query_len >= 1 && seq.context_len >= seq.query_len, "fd_paged_attention: need 1 <= query_len <= context_len");
    check(seq.query_start >= 0 && seq.query_start + seq.query_len <= num_tokens, "fd_paged_attention: query rows out of range");
    check((seq.context_len + p.block_size - 1) / p.block_size <= ts[1], "fd_paged_attention: block table too short");
    for (int64_t b = 0; b < (seq.context_len + p.block_size - 1) / p.block_size; ++b)
      check(seq.table[b] >= 0 && seq.table[b] < num_blocks, "fd_paged_attention: block id out of range");
    seqs[i] = seq;
    bool lanes = false;
#if defined(__AVX512F__)
    lanes = lanes_fit(p, seq);
#endif
    // Lanes items hold as many whole tokens as fit in 64 rows; the other paths tile by kQueryTile tokens.
    const int64_t tile = lanes ? std::max<int64_t>(1, kLaneRowsLimit / p.group) : kQueryTile;
    for (int64_t first = 0; first < seq.query_len; first += tile) {
      const int64_t n = std::min<int64_t>(tile, seq.query_len - first);
      const int64_t keys = seq.context_len - seq.query_len + first + n;
      for (int64_t h = 0; h < p.kv_heads; ++h)
        items.push_back(Item{static_cast<int32_t>(i), static_cast<int32_t>(h), static_cast<int32_t>(first),
                             static_cast<int32_t>(n), keys * n, lanes});
    }
  }
  // Longest items first, so the dynamic schedule does not end on one long straggler.
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });

  const int64_t num_items = static_cast<int64_t>(items.size());
  // Work is handed out by hand (an atomic counter) rather than with "omp for": the library links Paddle's
  // libiomp5, which lacks the GOMP_loop_nonmonotonic_* entry points gcc emits for dynamic schedules (they
  // would bind to libgomp, a different runtime than the one running the team).
  std::atomic<int64_t> next_item{0};
  auto work = [&]() {
    Scratch scratch;
#if defined(__AVX512F__)
    LaneScratch lane_scratch;
#endif
    for (int64_t i = next_item.fetch_add(1); i < num_items; i = next_item.fetch_add(1)) {
      const Item& item = items[i];
      const Sequence& seq = seqs[item.seq];
#if defined(__AVX512F__)
      if (item.lanes) {
        run_lanes(p, seq, item, lane_scratch);
        continue;
      }
#endif
      switch (p.head_dim) {
        case 64: run_item<64>(p, seq, item, scratch); break;
        case 128: run_item<128>(p, seq, item, scratch); break;
        default: run_item<0>(p, seq, item, scratch); break;
      }
    }
  };
  // Entering a parallel region costs tens of microseconds: small steps (a short decode) run on this thread.
  int64_t total_cost = 0;
  for (const Item& item : items) total_cost += item.cost;
  if (total_cost * p.group * p.head_dim < kParallelMinWork || num_items < 2) {
    work();
  } else {
#pragma omp parallel
    work();
  }
}

std::vector<paddle::Tensor> PagedAttention(const paddle::Tensor& q, const paddle::Tensor& k_cache,
                                           const paddle::Tensor& v_cache, const paddle::Tensor& block_tables,
                                           const paddle::Tensor& query_starts, const paddle::Tensor& query_lens,
                                           const paddle::Tensor& context_lens, float scale) {
  check(q.is_cpu() && k_cache.is_cpu() && v_cache.is_cpu(), "fd_paged_attention: CPU tensors only");
  check(q.dtype() == paddle::DataType::FLOAT32 && k_cache.dtype() == paddle::DataType::FLOAT32 &&
            v_cache.dtype() == paddle::DataType::FLOAT32,
        "fd_paged_attention: q and the caches must be float32");
  const auto qs = q.shape();
  const auto ks = k_cache.shape();
  check(qs.size() == 3 && ks.size() == 4 && v_cache.shape() == ks, "fd_paged_attention: q [T, H, D], caches [N, KVH, BS, D]");
  check(qs[2] == ks[3], "fd_paged_attention: q and cache head_dim differ");
  check(ks[1] > 0 && qs[1] % ks[1] == 0, "fd_paged_attention: heads must be a multiple of kv_heads");
  Problem p{q.data<float>(), k_cache.data<float>(), v_cache.data<float>(), nullptr,
            qs[1], ks[1], ks[2], ks[3], qs[1] / ks[1], scale};
  auto out = paddle::empty({qs[0], qs[1] * qs[2]}, paddle::DataType::FLOAT32, paddle::CPUPlace());
  p.out = out.data<float>();
  attend(p, qs[0], ks[0], block_tables, query_starts, query_lens, context_lens);
  return {out};
}

// ------------------------------------------------------------ RoPE + cache write + attention, fused

// dst[d] = x[d] * cos[d] + x[d +- D/2] * sin[d] (rotate-half RoPE; the sin table carries the sign). Each
// product is rounded before the sum, as the Paddle path computes it, so both paths give the same bits:
// the empty asm keeps the compiler from contracting the multiply and add into an FMA.
void rope_row(const float* x, const float* cos, const float* sin, int64_t D, float* dst) {
  const int64_t half = D / 2;
  int64_t d = 0;
#if defined(__AVX512F__)
  if (half % 16 == 0) {
    for (; d < D; d += 16) {
      const int64_t partner = d < half ? d + half : d - half;
      __m512 a = _mm512_mul_ps(_mm512_loadu_ps(x + d), _mm512_loadu_ps(cos + d));
      __m512 b = _mm512_mul_ps(_mm512_loadu_ps(x + partner), _mm512_loadu_ps(sin + d));
      asm("" : "+v"(a), "+v"(b));
      _mm512_storeu_ps(dst + d, _mm512_add_ps(a, b));
    }
  }
#endif
  for (; d < D; ++d) {
    float a = x[d] * cos[d];
    float b = x[d < half ? d + half : d - half] * sin[d];
    asm("" : "+x"(a), "+x"(b));
    dst[d] = a + b;
  }
}

std::vector<paddle::Tensor> RopePagedAttention(const paddle::Tensor& qkv, const paddle::Tensor& cos_table,
                                               const paddle::Tensor& sin_table, const paddle::Tensor& positions,
                                               const paddle::Tensor& slots, paddle::Tensor& k_cache,
                                               paddle::Tensor& v_cache, const paddle::Tensor& block_tables,
                                               const paddle::Tensor& query_starts, const paddle::Tensor& query_lens,
                                               const paddle::Tensor& context_lens, int num_heads, float scale) {
  check(qkv.is_cpu() && k_cache.is_cpu() && v_cache.is_cpu() && cos_table.is_cpu() && sin_table.is_cpu(),
        "fd_rope_paged_attention: CPU tensors only");
  check(qkv.dtype() == paddle::DataType::FLOAT32 && k_cache.dtype() == paddle::DataType::FLOAT32 &&
            v_cache.dtype() == paddle::DataType::FLOAT32 && cos_table.dtype() == paddle::DataType::FLOAT32 &&
            sin_table.dtype() == paddle::DataType::FLOAT32,
        "fd_rope_paged_attention: qkv, the RoPE tables and the caches must be float32");
  check(positions.dtype() == paddle::DataType::INT64 && slots.dtype() == paddle::DataType::INT64,
        "fd_rope_paged_attention: positions and slots must be int64");
  const auto ks = k_cache.shape();
  check(ks.size() == 4 && v_cache.shape() == ks, "fd_rope_paged_attention: caches [N, KVH, BS, D]");
  const int64_t kv_heads = ks[1], block_size = ks[2], D = ks[3], num_blocks = ks[0];
  const auto xs = qkv.shape();
  check(num_heads > 0 && kv_heads > 0 && num_heads % kv_heads == 0,
        "fd_rope_paged_attention: num_heads must be a positive multiple of the cache's kv_heads");
  check(xs.size() == 2 && xs[1] == (num_heads + 2 * kv_heads) * D,
        "fd_rope_paged_attention: qkv must be [T, (num_heads + 2 * kv_heads) * head_dim]");
  check(D % 2 == 0 && cos_table.shape().size() == 2 && cos_table.shape()[1] == D &&
            sin_table.shape() == cos_table.shape(),
        "fd_rope_paged_attention: RoPE tables [max_positions, head_dim], head_dim even");
  const int64_t T = xs[0];
  check(positions.numel() == T && slots.numel() == T, "fd_rope_paged_attention: one position and slot per token");
  const int64_t max_positions = cos_table.shape()[0];
  const int64_t* pos = positions.data<int64_t>();
  const int64_t* slot = slots.data<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    check(pos[t] >= 0 && pos[t] < max_positions, "fd_rope_paged_attention: position out of the RoPE table");
    check(slot[t] >= 0 && slot[t] < num_blocks * block_size, "fd_rope_paged_attention: slot out of the cache");
  }

  // Rotate q into its own buffer, rotate k and copy v into their cache rows.
  std::vector<float> q(T * num_heads * D);
  const float* x = qkv.data<float>();
  const float* cos = cos_table.data<float>();
  const float* sin = sin_table.data<float>();
  float* kc = k_cache.data<float>();
  float* vc = v_cache.data<float>();
  const int64_t width = xs[1];
  for (int64_t t = 0; t < T; ++t) {
    const float* row = x + t * width;
    const float* c = cos + pos[t] * D;
    const float* s = sin + pos[t] * D;
    for (int64_t h = 0; h < num_heads; ++h) rope_row(row + h * D, c, s, D, q.data() + (t * num_heads + h) * D);
    const int64_t block = slot[t] / block_size, offset = slot[t] % block_size;
    for (int64_t h = 0; h < kv_heads; ++h) {
      const int64_t cache_offset = ((block * kv_heads + h) * block_size + offset) * D;
      rope_row(row + (num_heads + h) * D, c, s, D, kc + cache_offset);
      std::memcpy(vc + cache_offset, row + (num_heads + kv_heads + h) * D, D * sizeof(float));
    }
  }
  Problem p{q.data(), kc, vc, nullptr, num_heads, kv_heads, block_size, D, num_heads / kv_heads, scale};
  auto out = paddle::empty({T, num_heads * D}, paddle::DataType::FLOAT32, paddle::CPUPlace());
  p.out = out.data<float>();
  attend(p, T, num_blocks, block_tables, query_starts, query_lens, context_lens);
  return {out};
}

std::vector<std::vector<int64_t>> PagedAttentionShape(const std::vector<int64_t>& q, const std::vector<int64_t>&,
                                                      const std::vector<int64_t>&, const std::vector<int64_t>&,
                                                      const std::vector<int64_t>&, const std::vector<int64_t>&,
                                                      const std::vector<int64_t>&) {
  return {{q[0], q[1] * q[2]}};
}

std::vector<paddle::DataType> PagedAttentionDtype(const paddle::DataType& q, const paddle::DataType&,
                                                  const paddle::DataType&, const paddle::DataType&,
                                                  const paddle::DataType&, const paddle::DataType&,
                                                  const paddle::DataType&) {
  return {q};
}

}  // namespace

PD_BUILD_OP(fd_paged_attention)
    .Inputs({"Q", "KCache", "VCache", "BlockTables", "QueryStarts", "QueryLens", "ContextLens"})
    .Outputs({"Out"})
    .Attrs({"scale: float"})
    .SetKernelFn(PD_KERNEL(PagedAttention))
    .SetInferShapeFn(PD_INFER_SHAPE(PagedAttentionShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(PagedAttentionDtype));

namespace {

std::vector<std::vector<int64_t>> RopePagedAttentionShape(
    const std::vector<int64_t>& qkv, const std::vector<int64_t>&, const std::vector<int64_t>&,
    const std::vector<int64_t>&, const std::vector<int64_t>&, const std::vector<int64_t>& k_cache,
    const std::vector<int64_t>&, const std::vector<int64_t>&, const std::vector<int64_t>&,
    const std::vector<int64_t>&, const std::vector<int64_t>&, int num_heads, float) {
  return {{qkv[0], num_heads * k_cache[3]}};
}

std::vector<paddle::DataType> RopePagedAttentionDtype(
    const paddle::DataType& qkv, const paddle::DataType&, const paddle::DataType&, const paddle::DataType&,
    const paddle::DataType&, const paddle::DataType&, const paddle::DataType&, const paddle::DataType&,
    const paddle::DataType&, const paddle::DataType&, const paddle::DataType&) {
  return {qkv};
}

}  // namespace

// The caches are written in place (the step's K/V), declared as in-place outputs.
PD_BUILD_OP(fd_rope_paged_attention)
    .Inputs({"QKV", "CosTable", "SinTable", "Positions", "Slots", "KCache", "VCache", "BlockTables", "QueryStarts",
             "QueryLens", "ContextLens"})
    .Outputs({"Out", "KCacheOut", "VCacheOut"})
    .SetInplaceMap({{"KCache", "KCacheOut"}, {"VCache", "VCacheOut"}})
    .Attrs({"num_heads: int", "scale: float"})
    .SetKernelFn(PD_KERNEL(RopePagedAttention))
    .SetInferShapeFn(PD_INFER_SHAPE(RopePagedAttentionShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(RopePagedAttentionDtype));
