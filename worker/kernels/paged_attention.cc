// Paged attention on the CPU, reading K/V blocks of the cache in place (no gather), as one Paddle
// custom operator for a whole step: decode sequences (one query token) and prefill chunks (a chunk may
// follow a cached prefix; causal mask aligned bottom-right) alike.
//
// Cache layout (worker/attention.py): k_cache, v_cache [num_blocks, kv_heads, block_size, head_dim]
// float32; the step's new K/V are already written into it. kv_heads comes from the cache shape (a
// tensor-parallel rank holds kv_heads / tp of them), heads from q, group = heads / kv_heads.
//
// Work item = (sequence, kv head, tile of up to kQueryTile query tokens); its rows are the tile's
// tokens x the group's query heads (token-major). Keys are visited in tiles of kKeyTile positions,
// flash-attention style: scores for a 4-row block against one key tile (K tile transposed once into
// [head_dim][kKeyTile] so the inner loop is a broadcast-FMA over 16 keys), online softmax in float32
// (running max m, running sum l, output rescaled when m grows), then P x V accumulated straight from
// the cache rows. Memory per item is O(rows x head_dim): no score matrix over the whole context.
// Items run under OpenMP, handed out longest first.
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
constexpr int kQueryTile = 32;   // query tokens per work item (prefill)
constexpr int kTransposeMinRows = 8;
constexpr int64_t kParallelMinWork = 1 << 18;  // multiply-adds (keys x rows x head_dim) worth a parallel region  // query rows (tokens x group) from which a sequence's K is transposed
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

constexpr int kChunkKeys = 256;  // keys per chunk: their transposed K and V rows (128 KiB at D=64) stay in L2

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

// Rows row0..row0+NR-1 against keys [key_begin, key_end) (tile aligned). K comes either from the
// sequence's transposed K (kt_all, [tiles][D][16], prefill) or straight from the cache rows by dot
// products (decode: few rows, a transpose would cost more than it saves).
template <int D, int NR>
void block_avx512(const Problem& p, const Sequence& seq, int kv_head, Scratch& s, int row0, const int64_t* pos,
                  int64_t key_begin, int64_t key_end, const float* kt_all) {
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
    if (kt_all != nullptr) {
      const float* kt = kt_all + (key0 / kKeyTile) * D * kKeyTile;
      for (int r = 0; r < NR; ++r) sc[r] = _mm512_setzero_ps();
      for (int d = 0; d < D; ++d) {
        const __m512 kv = _mm512_loadu_ps(kt + d * kKeyTile);
        for (int r = 0; r < NR; ++r) sc[r] = _mm512_fmadd_ps(_mm512_set1_ps(q[r][d]), kv, sc[r]);
      }
    } else {
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
    }
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
                 int64_t key_end, const float* kt_all) {
  constexpr int NR = D >= 128 ? 2 : 4;  // NR x D/16 output registers + scores must fit in 32 zmm
  for (int64_t chunk = 0; chunk < key_end; chunk += kChunkKeys) {
    const int64_t chunk_end = std::min<int64_t>(chunk + kChunkKeys, key_end);
    int row0 = 0;
    for (; row0 + NR <= rows; row0 += NR) {
      if (pos[row0 + NR - 1] < chunk) continue;
      block_avx512<D, NR>(p, seq, kv_head, s, row0, pos + row0, chunk, chunk_end, kt_all);
    }
    for (; row0 < rows; ++row0)
      block_avx512<D, 1>(p, seq, kv_head, s, row0, pos + row0, chunk, chunk_end, kt_all);
  }
}

// K of one sequence and KV head transposed tile by tile into [tiles][D][16] (zero-padded), once per call,
// for all of the sequence's query tiles.
void transpose_keys(const Problem& p, const Sequence& seq, int kv_head, int64_t tile, float* kt_all) {
  const int64_t D = p.head_dim;
  float* kt = kt_all + tile * D * kKeyTile;
  const int64_t key0 = tile * kKeyTile;
  const int keys = static_cast<int>(std::min<int64_t>(kKeyTile, seq.context_len - key0));
  for (int j = 0; j < keys; ++j) {
    const float* k = cache_row(p.k_cache, p, seq.table, key0 + j, kv_head);
    for (int64_t d = 0; d < D; ++d) kt[d * kKeyTile + j] = k[d];
  }
  for (int j = keys; j < kKeyTile; ++j)
    for (int64_t d = 0; d < D; ++d) kt[d * kKeyTile + j] = 0.0f;
}
#endif  // __AVX512F__

template <int D>
void run_item(const Problem& p, const Sequence& seq, const Item& item, Scratch& s, const float* kt_all) {
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
    item_avx512<D ? D : 64>(p, seq, item.kv_head, s, rows, positions.data(), key_end, kt_all);
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

void check(bool ok, const char* message) { PD_CHECK(ok, message); }

std::vector<paddle::Tensor> PagedAttention(const paddle::Tensor& q, const paddle::Tensor& k_cache,
                                           const paddle::Tensor& v_cache, const paddle::Tensor& block_tables,
                                           const paddle::Tensor& query_starts, const paddle::Tensor& query_lens,
                                           const paddle::Tensor& context_lens, float scale) {
  check(q.is_cpu() && k_cache.is_cpu() && v_cache.is_cpu(), "fd_paged_attention: CPU tensors only");
  check(q.dtype() == paddle::DataType::FLOAT32 && k_cache.dtype() == paddle::DataType::FLOAT32 &&
            v_cache.dtype() == paddle::DataType::FLOAT32,
        "fd_paged_attention: q and the caches must be float32");
  check(block_tables.dtype() == paddle::DataType::INT64 && query_starts.dtype() == paddle::DataType::INT64 &&
            query_lens.dtype() == paddle::DataType::INT64 && context_lens.dtype() == paddle::DataType::INT64,
        "fd_paged_attention: block tables and lengths must be int64");
  const auto qs = q.shape();
  const auto ks = k_cache.shape();
  check(qs.size() == 3 && ks.size() == 4 && v_cache.shape() == ks, "fd_paged_attention: q [T, H, D], caches [N, KVH, BS, D]");
  check(qs[2] == ks[3], "fd_paged_attention: q and cache head_dim differ");
  check(ks[1] > 0 && qs[1] % ks[1] == 0, "fd_paged_attention: heads must be a multiple of kv_heads");
  const auto ts = block_tables.shape();
  check(ts.size() == 2, "fd_paged_attention: block_tables [S, max_blocks]");
  const int64_t num_seqs = ts[0];
  check(query_starts.numel() == num_seqs && query_lens.numel() == num_seqs && context_lens.numel() == num_seqs,
        "fd_paged_attention: one start, query length and context length per sequence");

  Problem p{q.data<float>(), k_cache.data<float>(), v_cache.data<float>(), nullptr,
            qs[1], ks[1], ks[2], ks[3], qs[1] / ks[1], scale};
  auto out = paddle::empty({qs[0], qs[1] * qs[2]}, paddle::DataType::FLOAT32, paddle::CPUPlace());
  p.out = out.data<float>();

  const int64_t* tables = block_tables.data<int64_t>();
  std::vector<Sequence> seqs(num_seqs);
  std::vector<Item> items;
  for (int64_t i = 0; i < num_seqs; ++i) {
    Sequence seq{query_starts.data<int64_t>()[i], query_lens.data<int64_t>()[i], context_lens.data<int64_t>()[i],
                 tables + i * ts[1]};
    check(seq.query_len >= 1 && seq.context_len >= seq.query_len, "fd_paged_attention: need 1 <= query_len <= context_len");
    check(seq.query_start >= 0 && seq.query_start + seq.query_len <= qs[0], "fd_paged_attention: query rows out of range");
    check((seq.context_len + p.block_size - 1) / p.block_size <= ts[1], "fd_paged_attention: block table too short");
    for (int64_t b = 0; b < (seq.context_len + p.block_size - 1) / p.block_size; ++b)
      check(seq.table[b] >= 0 && seq.table[b] < ks[0], "fd_paged_attention: block id out of range");
    seqs[i] = seq;
    for (int64_t first = 0; first < seq.query_len; first += kQueryTile) {
      const int64_t n = std::min<int64_t>(kQueryTile, seq.query_len - first);
      const int64_t keys = seq.context_len - seq.query_len + first + n;
      for (int64_t h = 0; h < p.kv_heads; ++h)
        items.push_back(Item{static_cast<int32_t>(i), static_cast<int32_t>(h), static_cast<int32_t>(first),
                             static_cast<int32_t>(n), keys * n});
    }
  }
  // Longest items first, so the dynamic schedule does not end on one long straggler.
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });

  // Sequences with enough query rows get their K transposed once ([tiles][D][16] per KV head), shared by
  // all their query tiles; decodes read K rows in place.
  std::vector<int64_t> kt_offset(num_seqs, -1);
  std::vector<std::pair<int64_t, int64_t>> transpose_jobs;  // (sequence, kv_head * tiles + tile)
  int64_t kt_floats = 0;
#if defined(__AVX512F__)
  if (p.head_dim == 64 || p.head_dim == 128) {
    for (int64_t i = 0; i < num_seqs; ++i) {
      if (seqs[i].query_len * p.group < kTransposeMinRows) continue;
      const int64_t tiles = (seqs[i].context_len + kKeyTile - 1) / kKeyTile;
      kt_offset[i] = kt_floats;
      kt_floats += p.kv_heads * tiles * p.head_dim * kKeyTile;
      for (int64_t job = 0; job < p.kv_heads * tiles; ++job) transpose_jobs.emplace_back(i, job);
    }
  }
#endif
  std::vector<float> kt_buffer(kt_floats);
  auto kt_of = [&](int64_t seq, int64_t kv_head) -> float* {
    if (kt_offset[seq] < 0) return nullptr;
    const int64_t tiles = (seqs[seq].context_len + kKeyTile - 1) / kKeyTile;
    return kt_buffer.data() + kt_offset[seq] + kv_head * tiles * p.head_dim * kKeyTile;
  };

  const int64_t num_items = static_cast<int64_t>(items.size());
  const int64_t num_jobs = static_cast<int64_t>(transpose_jobs.size());
  // Work is handed out by hand (static slices, then an atomic counter) rather than with "omp for": the
  // library links Paddle's libiomp5, which lacks the GOMP_loop_nonmonotonic_* entry points gcc emits for
  // dynamic schedules (they would bind to libgomp, a different runtime than the one running the team).
  std::atomic<int64_t> next_item{0};
  auto work = [&](int64_t thread, int64_t threads) {
#if defined(__AVX512F__)
    for (int64_t j = thread; j < num_jobs; j += threads) {
      const int64_t seq = transpose_jobs[j].first;
      const int64_t tiles = (seqs[seq].context_len + kKeyTile - 1) / kKeyTile;
      const int64_t kv_head = transpose_jobs[j].second / tiles;
      transpose_keys(p, seqs[seq], static_cast<int>(kv_head), transpose_jobs[j].second % tiles,
                     kt_of(seq, kv_head));
    }
#endif
    if (threads > 1 && num_jobs > 0) {  // items read the transposed keys; decode-only steps have none
#pragma omp barrier
    }
    Scratch scratch;
    for (int64_t i = next_item.fetch_add(1); i < num_items; i = next_item.fetch_add(1)) {
      const Item& item = items[i];
      const float* kt = kt_of(item.seq, item.kv_head);
      switch (p.head_dim) {
        case 64: run_item<64>(p, seqs[item.seq], item, scratch, kt); break;
        case 128: run_item<128>(p, seqs[item.seq], item, scratch, kt); break;
        default: run_item<0>(p, seqs[item.seq], item, scratch, kt); break;
      }
    }
  };
  // Entering a parallel region costs tens of microseconds: small steps (a short decode) run on this thread.
  int64_t total_cost = 0;
  for (const Item& item : items) total_cost += item.cost;
  if (total_cost * p.group * p.head_dim < kParallelMinWork || num_items < 2) {
    work(0, 1);
  } else {
#pragma omp parallel
    work(omp_get_thread_num(), omp_get_num_threads());
  }
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
