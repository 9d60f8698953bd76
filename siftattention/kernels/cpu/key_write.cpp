// The int8 key copy's write on the CPU (kernels/key_write.py, write_int8_keys): new float32 keys quantised
// as keybound.quantize_keys does, bit for bit, and stored at positions [start, start + n) or at index[n].
//
// Per key row x (the key; per channel (k - o) / c): scale = max(max|x| * float32(1 / 127), least),
// value = clamp(round(x / scale), -127, 127), rounded half to even. The same float32 operations as torch's on
// the CPU, one each: a subtraction and a true division per channel, the product with float32(1 / 127) (torch
// rounds the Python scalar to float32 and multiplies in float32), the maximum with the least scale, a true
// division per value and std::nearbyint in the default rounding mode (torch.round's nearest-even). NaN follows
// torch too: a NaN magnitude gives a NaN scale (amax and clamp_min propagate it) and a NaN quotient the value 0
// (what torch's float-to-int8 conversion gives on x86), so a row with an infinity gets scale inf and 0 there.
//
// Exactness under cpu_decode.CFLAGS (-O3 -march=native -fopenmp -fno-trapping-math): none of them lets the
// compiler change a value (no -ffast-math, -freciprocal-math, -funsafe-math-optimizations or
// -ffinite-math-only: a division by the row's scale stays a division, not a product with its reciprocal);
// -ffp-contract=fast, GCC's default, only fuses a product into a following sum, and no product here feeds a
// sum; -fno-trapping-math only lets std::nearbyint become one rounding instruction (the same value). The
// guard below stops a build whose flags would allow more.

#if defined(__FAST_MATH__) || defined(__FINITE_MATH_ONLY__) && __FINITE_MATH_ONLY__
#error "key_write.cpp must be compiled without -ffast-math: the int8 key copy is bit for bit torch's"
#endif

#include "common.h"

namespace {

// One key row x (float32; per channel (k - o) / c), D values: its scale; its int8 values into q (contiguous, so
// that every loop vectorises: vdivps and vroundps, the same values as the scalar instructions).
inline float quantize_row(const float* __restrict x, int64_t D, float inv_q, float least, int8_t* __restrict q) {
  float m = 0.f;
  int32_t nan = 0;
#pragma omp simd reduction(max : m) reduction(| : nan)
  for (int64_t d = 0; d < D; ++d) {
    const float a = std::fabs(x[d]);
    m = a > m ? a : m;
    nan |= static_cast<int32_t>(a != a);
  }
  float scale = (nan ? std::numeric_limits<float>::quiet_NaN() : m) * inv_q;
  scale = scale < least ? least : scale;  // a NaN stays (torch's clamp_min)
  for (int64_t d = 0; d < D; ++d) {
    float v = std::nearbyint(x[d] / scale);
    v = v < -127.f ? -127.f : (v > 127.f ? 127.f : v);
    q[d] = v == v ? static_cast<int8_t>(static_cast<int32_t>(v)) : 0;
  }
  return scale;
}

}  // namespace

// k [B, Hkv, n, D] float32 (any strides) into key_values [B, Hkv, S, D] int8 and key_scales [B, Hkv, S] float32 at
// positions index[i] (int64 or int32 [n]) or, with index empty, start + i. channel and offset [B, Hkv, D] float32
// for the per-channel form, empty for the per-row form. inv_q = INV_QMAX, least = the least scale of the form.
void write_keys_cpu(torch::Tensor k, torch::Tensor key_values, torch::Tensor key_scales, torch::Tensor channel,
                    torch::Tensor offset, torch::Tensor index, int64_t start, double inv_q, double least) {
  TORCH_CHECK(k.device().is_cpu() && k.dtype() == torch::kFloat32 && k.dim() == 4, "float32 CPU keys [B, Hkv, n, D] expected");
  const int64_t B = k.size(0), H = k.size(1), n = k.size(2), D = k.size(3);
  TORCH_CHECK(key_values.device().is_cpu() && key_values.dtype() == torch::kInt8 && key_values.dim() == 4 &&
                  key_values.size(0) == B && key_values.size(1) == H && key_values.size(3) == D,
              "key values must be int8 [B, Hkv, S, D] on the CPU, as the keys");
  const int64_t S = key_values.size(2);
  TORCH_CHECK(key_scales.device().is_cpu() && key_scales.dtype() == torch::kFloat32 && key_scales.dim() == 3 &&
                  key_scales.size(0) == B && key_scales.size(1) == H && key_scales.size(2) == S,
              "key scales must be float32 [B, Hkv, S] on the CPU");
  const bool per_channel = channel.numel() > 0;
  for (const auto* t : {&channel, &offset}) {
    TORCH_CHECK(!per_channel || (t->device().is_cpu() && t->dtype() == torch::kFloat32 && t->dim() == 3 &&
                                 t->size(0) == B && t->size(1) == H && t->size(2) == D),
                "channel scales and offsets must be float32 [B, Hkv, D] on the CPU");
  }
  const bool has_index = index.numel() > 0;
  std::vector<int64_t> pos(n);
  if (has_index) {
    TORCH_CHECK(index.device().is_cpu() && index.dim() == 1 && index.numel() == n &&
                    (index.dtype() == torch::kInt64 || index.dtype() == torch::kInt32),
                "index must be int64 or int32 [n] on the CPU");
    const int64_t is = index.stride(0);
    for (int64_t i = 0; i < n; ++i) {
      pos[i] = index.dtype() == torch::kInt64 ? index.data_ptr<int64_t>()[i * is] : index.data_ptr<int32_t>()[i * is];
      TORCH_CHECK(pos[i] >= 0 && pos[i] < S, "index ", pos[i], " is out of range for a copy of ", S, " positions");
    }
  } else {
    TORCH_CHECK(start >= 0 && start + n <= S, "positions [", start, ", ", start + n, ") do not fit a copy of ", S);
    for (int64_t i = 0; i < n; ++i) pos[i] = start + i;
  }
  if (B * H * n == 0 || D == 0) return;

  const float* kp = k.data_ptr<float>();
  int8_t* vp = key_values.data_ptr<int8_t>();
  float* sp = key_scales.data_ptr<float>();
  const float* chp = per_channel ? channel.data_ptr<float>() : nullptr;
  const float* ofp = per_channel ? offset.data_ptr<float>() : nullptr;
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1), ks2 = k.stride(2), ks3 = k.stride(3);
  const int64_t vs0 = key_values.stride(0), vs1 = key_values.stride(1), vs2 = key_values.stride(2),
                vs3 = key_values.stride(3);
  const int64_t ss0 = key_scales.stride(0), ss1 = key_scales.stride(1), ss2 = key_scales.stride(2);
  const int64_t zs0 = per_channel ? channel.stride(0) : 0, zs1 = per_channel ? channel.stride(1) : 0,
                zs2 = per_channel ? channel.stride(2) : 0;
  const int64_t os0 = per_channel ? offset.stride(0) : 0, os1 = per_channel ? offset.stride(1) : 0,
                os2 = per_channel ? offset.stride(2) : 0;
  const float iq = static_cast<float>(inv_q), lst = static_cast<float>(least);  // torch's float32 scalars

  // One thread: a decode step's write is B * Hkv rows of one key (a few microseconds), which the pool's hand-off
  // would cost more than; a prompt's write is once per prompt.
  std::vector<float> x(D);
  std::vector<int8_t> q(D);
  const bool unit = ks3 == 1 && (!per_channel || (zs2 == 1 && os2 == 1));
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < H; ++h) {
      const float* ch = per_channel ? chp + b * zs0 + h * zs1 : nullptr;
      const float* of = per_channel ? ofp + b * os0 + h * os1 : nullptr;
      for (int64_t i = 0; i < n; ++i) {
        const float* kr = kp + b * ks0 + h * ks1 + i * ks2;
        const float* xr = kr;
        if (per_channel) {
          if (unit) {
            for (int64_t d = 0; d < D; ++d) x[d] = (kr[d] - of[d]) / ch[d];
          } else {
            for (int64_t d = 0; d < D; ++d) x[d] = (kr[d * ks3] - of[d * os2]) / ch[d * zs2];
          }
          xr = x.data();
        } else if (!unit) {
          for (int64_t d = 0; d < D; ++d) x[d] = kr[d * ks3];
          xr = x.data();
        }
        int8_t* vr = vp + b * vs0 + h * vs1 + pos[i] * vs2;
        sp[b * ss0 + h * ss1 + pos[i] * ss2] = quantize_row(xr, D, iq, lst, vs3 == 1 ? vr : q.data());
        if (vs3 != 1) {
          for (int64_t d = 0; d < D; ++d) vr[d * vs3] = q[d];
        }
      }
    }
  }
}
