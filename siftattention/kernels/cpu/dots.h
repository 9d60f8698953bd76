// The dot products of a KV group's query rows with key rows (int8 or float32), shared by the exact
// step's scores (sift_decode.cpp) and the key-bound step's scan and candidates (keybound_decode.cpp).
// A thin product ([G, D] x [D, L], G <= 8 or so) is far from what BLAS is tuned for: this kernel
// keeps 2 key rows x up to 6 heads of accumulators in registers and reads each key row once.
#pragma once

#include "common.h"

#include <algorithm>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SIFT_CPU_AVX2 1
#endif

namespace sift_cpu {

#ifdef SIFT_CPU_AVX2
// Whether group_dots runs the vector kernel for head dims that are a multiple of 8.
constexpr bool kVectorDots = true;
#else
constexpr bool kVectorDots = false;
#endif

// Key rows at a time in the dot products: a block of int8 or float32 rows stays in L1 while
// every head tile of the group reads it.
constexpr int64_t kKeyBlock = 32;
// Query heads per tile: 2 keys x 6 heads of 8-lane accumulators, the two key vectors and a query
// vector fill the 16 AVX2 registers.
constexpr int64_t kMaxTile = 6;

#ifdef SIFT_CPU_AVX2
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// The four horizontal sums of a, b, c and d.
inline __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

// out[g * ld + t] = q_g . row_t for GT heads (rows g * D of q) and NK <= 2 key rows (D a multiple of 8).
template <int GT, int NK, typename T>
inline void dot_tile(const float* q, int64_t D, const T* const* rows, float* out, int64_t ld) {
  __m256 acc[GT * NK + 3];
#pragma GCC unroll 16
  for (int t = 0; t < GT * NK + 3; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += 8) {
    __m256 kv[NK];
#pragma GCC unroll 2
    for (int r = 0; r < NK; ++r) kv[r] = load8(rows[r] + d);
#pragma GCC unroll 8
    for (int g = 0; g < GT; ++g) {
      const __m256 qv = _mm256_loadu_ps(q + g * D + d);
#pragma GCC unroll 2
      for (int r = 0; r < NK; ++r) acc[g * NK + r] = _mm256_fmadd_ps(qv, kv[r], acc[g * NK + r]);
    }
  }
  alignas(16) float sums[GT * NK + 3];
#pragma GCC unroll 4
  for (int t = 0; t < GT * NK; t += 4) _mm_store_ps(sums + t, hsum4(acc[t], acc[t + 1], acc[t + 2], acc[t + 3]));
#pragma GCC unroll 8
  for (int g = 0; g < GT; ++g) {
#pragma GCC unroll 2
    for (int r = 0; r < NK; ++r) out[g * ld + r] = sums[g * NK + r];
  }
}
#endif

// out[g * ld + i] = q_g . row_i for GT heads and the key rows base + (idx ? idx[i] : i) * stride, i < n;
// with idx, the rows up to idx[listed - 1] are asked for ahead (past this block too).
template <int GT, typename T>
void dot_rows(const float* q, int64_t D, const T* base, int64_t stride, const int64_t* idx, int64_t n, float* out,
              int64_t ld, int64_t listed) {
  auto row = [&](int64_t i) { return base + (idx ? idx[i] : i) * stride; };
#ifdef SIFT_CPU_AVX2
  if (D % 8 == 0) {
    int64_t i = 0;
    for (; i + 2 <= n; i += 2) {
      if (idx && i + kGatherAhead + 1 < listed) {  // scattered rows
        prefetch_row(row(i + kGatherAhead), D);
        prefetch_row(row(i + kGatherAhead + 1), D);
      }
      const T* rows[2] = {row(i), row(i + 1)};
      dot_tile<GT, 2>(q, D, rows, out + i, ld);
    }
    if (i < n) {
      const T* rows[1] = {row(i)};
      dot_tile<GT, 1>(q, D, rows, out + i, ld);
    }
    return;
  }
#endif
  for (int64_t i = 0; i < n; ++i) {
    const T* r = row(i);
    for (int g = 0; g < GT; ++g) {
      const float* qg = q + g * D;
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t d = 0; d < D; ++d) s += qg[d] * static_cast<float>(r[d]);
      out[g * ld + i] = s;
    }
  }
}

// out[g * ld + i] = q_g . row_i for the G query rows of q ([G, D]) and n key rows (see dot_rows),
// in blocks of key rows, each read by every tile of heads while it is in L1.
template <typename T>
void group_dots(const float* q, int64_t G, int64_t D, const T* base, int64_t stride, const int64_t* idx, int64_t n,
                float* out, int64_t ld) {
  const int64_t tiles = (G + kMaxTile - 1) / kMaxTile;
  for (int64_t i0 = 0; i0 < n; i0 += kKeyBlock) {
    const int64_t m = std::min(kKeyBlock, n - i0);
    const T* blk = idx ? base : base + i0 * stride;
    const int64_t* bidx = idx ? idx + i0 : nullptr;
    for (int64_t t = 0, g0 = 0; t < tiles; ++t) {
      const int64_t gt = (G - g0) / (tiles - t);  // the remaining heads spread evenly over the remaining tiles
      const float* qt = q + g0 * D;
      float* o = out + g0 * ld + i0;
      switch (gt) {
        case 1: dot_rows<1>(qt, D, blk, stride, bidx, m, o, ld, n - i0); break;
        case 2: dot_rows<2>(qt, D, blk, stride, bidx, m, o, ld, n - i0); break;
        case 3: dot_rows<3>(qt, D, blk, stride, bidx, m, o, ld, n - i0); break;
        case 4: dot_rows<4>(qt, D, blk, stride, bidx, m, o, ld, n - i0); break;
        case 5: dot_rows<5>(qt, D, blk, stride, bidx, m, o, ld, n - i0); break;
        default: dot_rows<6>(qt, D, blk, stride, bidx, m, o, ld, n - i0); break;
      }
      g0 += gt;
    }
  }
}

}  // namespace sift_cpu
