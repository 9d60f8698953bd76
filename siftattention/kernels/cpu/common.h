// Helpers shared by the CPU decode kernels (sift_decode.cpp, keybound_decode.cpp).
#pragma once

#include <torch/extension.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace sift_cpu {

// exp(x) for x <= 0 (Cephes' expf polynomial, about 1 ulp), written branch-free on plain
// floats so that the loops calling it vectorise; below -87.3 it returns 0.
inline float exp_nonpos(float x) {
  const float lo = -87.33654f;
  const float xc = x < lo ? lo : x;
  const float n = std::floor(xc * 1.44269504088896341f + 0.5f);
  float r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float pow2;
  std::memcpy(&pow2, &bits, sizeof(pow2));
  return x < lo ? 0.0f : y * pow2;
}

// The maximum does not depend on the order, so OpenMP SIMD may reorder it.
inline float row_max(const float* x, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
  for (int64_t j = 0; j < n; ++j) m = x[j] > m ? x[j] : m;
  return m;
}

// The sum of y[0..n) in a fixed association (16 lanes, then a fixed tree), so the same values
// always give the same bits.
inline float lane_sum(const float* y, int64_t n) {
  float acc[16] = {0};
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    for (int i = 0; i < 16; ++i) acc[i] += y[j + i];
  }
  for (int w = 8; w >= 1; w /= 2) {
    for (int i = 0; i < w; ++i) acc[i] += acc[i + w];
  }
  float z = acc[0];
  for (; j < n; ++j) z += y[j];
  return z;
}

// y[j] = exp(scale * (x[j] - xmax)); returns their sum (lane_sum). Shifting before scaling
// makes y exactly 1 at the maximum: with scale * x[j] - scale * xmax the compiler may fuse a
// multiply-add whose unrounded product leaves a residue there (p_max = 1 / z no longer holds).
inline float exp_shift_sum(const float* x, float* y, int64_t n, float scale, float xmax) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) y[j] = exp_nonpos(scale * (x[j] - xmax));
  return lane_sum(y, n);
}

// The first i with scale * x[i] == value: the first maximum, as torch's argmax picks it.
inline int64_t first_scaled_equal(const float* x, int64_t n, float scale, float value) {
  for (int64_t i = 0; i < n; ++i) {
    if (scale * x[i] == value) return i;
  }
  return 0;
}

// Keeps key a with weight p whatever the threshold (the first maximum): its weight, the kept
// count and mass, and the mark of the rows some head keeps.
inline void keep_maximum(float* w, uint8_t* rows, int64_t a, float p, int32_t& count, float& mass) {
  w[a] = p;
  count += 1;
  mass += p;
  rows[a] = 1;
}

// Asks for every cache line of a row of n elements (a gathered row: the hardware prefetcher cannot
// guess the next one, and the adjacent-line prefetch covers two of its lines at most).
template <typename T>
inline void prefetch_row(const T* row, int64_t n) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t b = 0; b < n * static_cast<int64_t>(sizeof(T)); b += 64) __builtin_prefetch(p + b);
}

// Rows ahead that a gather asks for.
constexpr int64_t kGatherAhead = 8;

inline void axpy(float* __restrict y, float w, const float* __restrict x, int64_t n) {
  for (int64_t d = 0; d < n; ++d) y[d] += w * x[d];
}

// The positions j < n whose flag is 1 (flags are 0 or 1), ascending, into list, branch-free; returns their count.
template <typename Flag>
inline int64_t compact_flagged(const Flag* flags, int64_t* list, int64_t n) {
  int64_t count = 0;
  for (int64_t j = 0; j < n; ++j) {
    list[count] = j;
    count += flags[j];
  }
  return count;
}

// Each of the G output rows of D values divided by its kept mass (renormalisation).
inline void divide_by_mass(float* out, const float* mass, int64_t G, int64_t D) {
  for (int64_t g = 0; g < G; ++g) {
    const float r = 1.f / mass[g];
    for (int64_t d = 0; d < D; ++d) out[g * D + d] *= r;
  }
}

}  // namespace sift_cpu

// The key-bound step (keybound_decode.cpp); registered with the module in sift_decode.cpp.
std::vector<torch::Tensor> keybound_cpu(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor key_values,
                                        torch::Tensor key_scales, torch::Tensor channel, torch::Tensor offset,
                                        torch::Tensor eta, double scale, double e_scale, double offset_rounding,
                                        double slack, torch::Tensor seq_lens, torch::Tensor starts, bool renormalize);

// The int8 key copy's write (key_write.cpp); registered with the module in sift_decode.cpp.
void write_keys_cpu(torch::Tensor k, torch::Tensor key_values, torch::Tensor key_scales, torch::Tensor channel,
                    torch::Tensor offset, torch::Tensor index, int64_t start, double inv_q, double least);
