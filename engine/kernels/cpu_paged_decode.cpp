// CPU paged decode attention: one query token per row, K/V read in place from the paged cache.
//
// The PyTorch path gathers every context token's K and V into dense tensors per length bucket and
// then runs SDPA (three passes over the KV per layer per step, plus padding). Here each row walks
// its block table once: for a chunk of tokens it scores every query head against the K row its
// KV head shares (GQA), updates a streaming softmax (running max and sum, float32), and folds the
// chunk's V rows into float32 accumulators. No copy, no padding, no mask. Block ids are trusted
// (the runner's table): an id past the cache reads out of bounds.
//
// Built at runtime on the machine that runs it (engine/kernels/cpu_paged_decode.py), so
// -march=native is safe; `#pragma omp simd` lets the compiler vectorise the float reductions
// without -ffast-math.

// Registered as the operator `loraplex_cpu::paged_decode` through the dispatcher, with only the ATen headers it
// needs: a pybind module built on <torch/extension.h> parsed all of torch's C++ API and took ~2 minutes to
// compile on a 2-core machine, on the first use of every fresh machine (every CI run).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kChunk = 32;  // tokens scored before one softmax update: amortises the rescale

template <typename scalar_t>
inline float to_float(scalar_t x) { return static_cast<float>(x); }

// exp(x) for the softmax weights (x <= 0): Cephes' expf polynomial, ~1 ulp over the range used.
// Plain arithmetic and a bit cast, so `omp simd` loops over it vectorise (std::exp would not
// without -ffast-math), and a chunk's exps cost about as much as its dot products.
inline float softmax_exp(float x) {
  x = std::max(x, -87.0f);  // below: a denormal/zero weight anyway; keeps 2^n a normal float
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;  // x - n*ln2, ln2 split hi/lo
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return y * scale;
}

// One task: decode row `row`, KV heads [kv_begin, kv_end) and the query heads they serve.
// Tokens go in chunks of at most kChunk within one block, so a chunk's K (then V) rows are one
// contiguous run of the cache (all KV heads of a slot lie side by side) that stays in L1 while
// each head of the group re-reads it. kD > 0 fixes head_dim at compile time (the common sizes):
// the D loops then unroll and a head's q and accumulator live in registers across the chunk.
template <int kD, typename scalar_t, typename index_t>
void decode_task(const scalar_t* q, const scalar_t* k_cache, const scalar_t* v_cache, const index_t* table,
                 int64_t length, scalar_t* out, int64_t heads, int64_t kv_heads, int64_t kv_begin,
                 int64_t kv_end, int64_t runtime_D, int64_t block_size, float scale, float* qf, float* acc,
                 float* scores, float* m, float* l) {
  const int64_t D = kD > 0 ? kD : runtime_D;
  const int64_t group = heads / kv_heads;
  const int64_t h0 = kv_begin * group, nh = (kv_end - kv_begin) * group;  // the task's query heads
  const int64_t slot_stride = kv_heads * D;
  for (int64_t h = 0; h < nh; ++h) {
    const scalar_t* qp = q + (h0 + h) * D;
    for (int64_t d = 0; d < D; ++d) qf[h * D + d] = to_float(qp[d]) * scale;  // fold the scale into q
    m[h] = -std::numeric_limits<float>::infinity();
    l[h] = 0.f;
  }
  std::fill(acc, acc + nh * D, 0.f);

  for (int64_t start = 0; start < length;) {
    const int64_t offset = start % block_size;
    const int64_t n = std::min({kChunk, length - start, block_size - offset});
    const int64_t first = (static_cast<int64_t>(table[start / block_size]) * block_size + offset) * slot_stride;
    for (int64_t h = 0; h < nh; ++h) {
      const int64_t kv_offset = (kv_begin + h / group) * D;
      const scalar_t* kc = k_cache + first + kv_offset;
      const scalar_t* vc = v_cache + first + kv_offset;
      const float* qh = qf + h * D;
      float* sh = scores;
      // Scores: the chunk's K rows for this head, read in place, four tokens at a time (four
      // independent FMA chains instead of one long one per dot product).
      int64_t j = 0;
      for (; j + 4 <= n; j += 4) {
        const scalar_t* k0 = kc + j * slot_stride;
        const scalar_t* k1 = k0 + slot_stride;
        const scalar_t* k2 = k1 + slot_stride;
        const scalar_t* k3 = k2 + slot_stride;
        float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
        for (int64_t d = 0; d < D; ++d) {
          const float qd = qh[d];
          s0 += qd * to_float(k0[d]);
          s1 += qd * to_float(k1[d]);
          s2 += qd * to_float(k2[d]);
          s3 += qd * to_float(k3[d]);
        }
        sh[j] = s0;
        sh[j + 1] = s1;
        sh[j + 2] = s2;
        sh[j + 3] = s3;
      }
      for (; j < n; ++j) {
        const scalar_t* kp = kc + j * slot_stride;
        float s = 0.f;
#pragma omp simd reduction(+ : s)
        for (int64_t d = 0; d < D; ++d) s += qh[d] * to_float(kp[d]);
        sh[j] = s;
      }
      // Streaming softmax: one rescale of the head's accumulator per chunk.
      float chunk_max = sh[0];
      for (int64_t j = 1; j < n; ++j) chunk_max = std::max(chunk_max, sh[j]);
      const float new_m = std::max(m[h], chunk_max);
      const float correction = std::exp(m[h] - new_m);  // exp(-inf) = 0 on the first chunk
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t j = 0; j < n; ++j) {
        sh[j] = softmax_exp(sh[j] - new_m);
        sum += sh[j];
      }
      l[h] = l[h] * correction + sum;
      m[h] = new_m;
      // Values: the chunk's V rows folded into the head's accumulator.
      float* ah = acc + h * D;
      if constexpr (kD > 0) {
        float a[kD];  // register-resident across the chunk
        for (int64_t d = 0; d < kD; ++d) a[d] = ah[d] * correction;
        for (int64_t j = 0; j < n; ++j) {
          const scalar_t* vp = vc + j * slot_stride;
          const float p = sh[j];
#pragma omp simd
          for (int64_t d = 0; d < kD; ++d) a[d] += p * to_float(vp[d]);
        }
        for (int64_t d = 0; d < kD; ++d) ah[d] = a[d];
      } else {
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) ah[d] *= correction;
        for (int64_t j = 0; j < n; ++j) {
          const scalar_t* vp = vc + j * slot_stride;
          const float p = sh[j];
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) ah[d] += p * to_float(vp[d]);
        }
      }
    }
    start += n;
  }
  for (int64_t h = 0; h < nh; ++h) {
    scalar_t* op = out + (h0 + h) * D;
    const float inv = l[h] > 0.f ? 1.f / l[h] : 0.f;  // length 0: zeros rather than NaN
    const float* ah = acc + h * D;
    for (int64_t d = 0; d < D; ++d) op[d] = static_cast<scalar_t>(ah[d] * inv);
  }
}

template <int kD, typename scalar_t, typename index_t>
void decode_rows(const scalar_t* q, const scalar_t* k_cache, const scalar_t* v_cache,
                 const index_t* block_table, const index_t* lengths, scalar_t* out,
                 int64_t rows, int64_t heads, int64_t kv_heads, int64_t D, int64_t block_size,
                 int64_t max_blocks, float scale) {
  // A whole row per task walks each block once for all heads; only when rows are fewer than
  // threads (batch-1 decode) are a row's KV heads split across tasks.
  const int64_t splits = rows >= at::get_num_threads() ? 1 : kv_heads;
  const int64_t kv_per_task = kv_heads / splits;
  at::parallel_for(0, rows * splits, 1, [&](int64_t begin, int64_t end) {
    // Scratch reused across this thread's tasks.
    std::vector<float> qf(heads * D), acc(heads * D), scores(kChunk), m(heads), l(heads);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t row = task / splits;
      const int64_t kv_begin = (task % splits) * kv_per_task;
      decode_task<kD>(q + row * heads * D, k_cache, v_cache, block_table + row * max_blocks,
                      static_cast<int64_t>(lengths[row]), out + row * heads * D, heads, kv_heads, kv_begin,
                      kv_begin + kv_per_task, D, block_size, scale, qf.data(), acc.data(), scores.data(),
                      m.data(), l.data());
    }
  });
}

template <typename scalar_t, typename index_t>
void dispatch_head_dim(const scalar_t* q, const scalar_t* k_cache, const scalar_t* v_cache,
                       const index_t* block_table, const index_t* lengths, scalar_t* out, int64_t rows,
                       int64_t heads, int64_t kv_heads, int64_t D, int64_t block_size, int64_t max_blocks,
                       float scale) {
  switch (D) {
    case 64:
      return decode_rows<64>(q, k_cache, v_cache, block_table, lengths, out, rows, heads, kv_heads, D,
                             block_size, max_blocks, scale);
    case 128:
      return decode_rows<128>(q, k_cache, v_cache, block_table, lengths, out, rows, heads, kv_heads, D,
                              block_size, max_blocks, scale);
    default:
      return decode_rows<0>(q, k_cache, v_cache, block_table, lengths, out, rows, heads, kv_heads, D,
                            block_size, max_blocks, scale);
  }
}

template <typename scalar_t>
void dispatch_index(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                    const at::Tensor& block_table, const at::Tensor& lengths, at::Tensor& out,
                    int64_t block_size, float scale) {
  const int64_t rows = q.size(0), heads = q.size(1), D = q.size(2), kv_heads = k_cache.size(1);
  const int64_t max_blocks = block_table.size(1);
  if (block_table.scalar_type() == at::kInt) {
    dispatch_head_dim<scalar_t, int32_t>(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(),
                                   v_cache.data_ptr<scalar_t>(), block_table.data_ptr<int32_t>(),
                                   lengths.data_ptr<int32_t>(), out.data_ptr<scalar_t>(), rows, heads,
                                   kv_heads, D, block_size, max_blocks, scale);
  } else {
    dispatch_head_dim<scalar_t, int64_t>(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(),
                                   v_cache.data_ptr<scalar_t>(), block_table.data_ptr<int64_t>(),
                                   lengths.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), rows, heads,
                                   kv_heads, D, block_size, max_blocks, scale);
  }
}

}  // namespace

// q: [rows, heads, D]; k_cache, v_cache: [slots, kv_heads, D] (slot = block * block_size + offset);
// block_table: [rows, max_blocks] int32/int64; lengths: [rows], same dtype. Returns [rows, heads, D].
at::Tensor paged_decode(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                           at::Tensor block_table, at::Tensor lengths, int64_t block_size,
                           double scale) {
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu(),
              "paged_decode: CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3, "paged_decode: 3-d q and caches");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
              "paged_decode: q and caches must share a dtype");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "paged_decode: contiguous caches");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "paged_decode: K and V caches differ in shape");
  TORCH_CHECK(q.size(2) == k_cache.size(2), "paged_decode: head_dim mismatch");
  TORCH_CHECK(q.size(1) % k_cache.size(1) == 0, "paged_decode: heads must be a multiple of kv_heads");
  TORCH_CHECK(block_table.dim() == 2 && block_table.size(0) == q.size(0), "paged_decode: block_table [rows, max_blocks]");
  TORCH_CHECK(lengths.dim() == 1 && lengths.size(0) == q.size(0), "paged_decode: lengths [rows]");
  TORCH_CHECK(block_table.scalar_type() == lengths.scalar_type() &&
                  (lengths.scalar_type() == at::kInt || lengths.scalar_type() == at::kLong),
              "paged_decode: block_table and lengths both int32 or both int64");
  TORCH_CHECK(block_size > 0, "paged_decode: block_size must be positive");
  q = q.contiguous();
  block_table = block_table.contiguous();
  lengths = lengths.contiguous();
  auto out = at::empty_like(q);
  const float s = static_cast<float>(scale);
  switch (q.scalar_type()) {
    case at::kFloat:
      dispatch_index<float>(q, k_cache, v_cache, block_table, lengths, out, block_size, s);
      break;
    case at::kBFloat16:
      dispatch_index<c10::BFloat16>(q, k_cache, v_cache, block_table, lengths, out, block_size, s);
      break;
    case at::kHalf:
      dispatch_index<c10::Half>(q, k_cache, v_cache, block_table, lengths, out, block_size, s);
      break;
    default:
      TORCH_CHECK(false, "paged_decode: float32, bfloat16 or float16 only");
  }
  return out;
}

TORCH_LIBRARY(loraplex_cpu, m) {
  m.def("paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, Tensor lengths, "
        "int block_size, float scale) -> Tensor", &paged_decode);
}
