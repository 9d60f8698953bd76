// Fused SiftAttention decode step for the CPU (float32).
//
// One task per (batch row, KV head): the scores of its valid keys (dots.h: each key row read
// once for every head of the group; one BLAS product where the key rows are not contiguous or
// the vector kernel does not apply), each query head's softmax
// maximum and normaliser (a vectorised exp), the threshold turned into kept weights,
// and one pass over the value rows that some head of the group keeps, so value rows
// no head keeps are never read. The torch backend instead runs separate passes over
// [B, Hq, S] tensors and a dense product with every value row.
//
// Modes: SPARSE (Sift's step), DENSE (exact attention), WARMUP (exact attention and the
// tau-quantile of each head's probabilities) and ANCHORED (Sift's step with the anchored
// normaliser: keep s > A + gap + log eta, A the log-sum-exp over the first `first` and newest
// `last` valid keys, gap the previous step's log-sum-exp minus A, which this step overwrites).
// The probabilities are computed by one code path whose results do not depend on memory
// alignment or threads, so a threshold taken from WARMUP's quantile filters the very same
// numbers in SPARSE.
//
// shared (SPARSE and WARMUP; Sift(gqa="shared"), eta equal over each group's heads): the group keeps
// one set, the keys whose largest probability over its heads passes eta (each head adds its own
// maximum), and WARMUP's quantile is that group maximum's, given to every head of the group.
//
// Semantics (kernels/torch_ref.py): valid keys of row b are [starts[b], seq_lens[b]);
// p = softmax over them; keep p > eta, every valid key where eta <= 0, and always the
// first maximum; out = sum_kept p_i v_i (divided by the kept mass with renormalize), plus, given the
// sum of each KV head's valid value rows, (1 - kept mass) * that sum / n (value-mean compensation).
// The quantile is torch.quantile's linear rule at position tau * (n - 1), ascending.
// A row without a valid key (start == seq_len) gives zeros: output, kept count, quantile and gap.

#include <ATen/Parallel.h>

#include "common.h"
#include "dots.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

using namespace sift_cpu;

enum Mode : int64_t { SPARSE = 0, DENSE = 1, WARMUP = 2, ANCHORED = 3 };

// Sum of e over the anchors of a row of n keys: [0, first) and [max(first, n - last), n).
inline float anchor_sum(const float* e, int64_t n, int64_t first, int64_t last) {
  const int64_t a = std::min(first, n), b = std::max(a, n - last);
  float z = 0.f;
  for (int64_t j = 0; j < a; ++j) z += e[j];
  for (int64_t j = b; j < n; ++j) z += e[j];
  return z;
}

// The anchored filter's probability threshold (torch_ref.anchored_threshold in probabilities):
// p > exp(A + gap + log eta - lse) = eta * exp(gap - g), g = lse - A = log(z / z_anchors).
inline float anchored_prob_threshold(float log_eta, float gap, float g) {
  if (log_eta >= 0.f) return std::numeric_limits<float>::infinity();  // eta >= 1: the maximum only
  if (std::isnan(gap) || std::isinf(log_eta)) return -1.f;           // no gap yet, or eta <= 0: every key
  return std::exp(gap - g + log_eta);                                  // NaN log eta: the maximum only
}

// tau-quantile of p[0..n) with linear interpolation (torch.quantile's rule); reorders tmp.
float quantile(const float* p, float* tmp, int64_t n, double tau) {
  std::copy(p, p + n, tmp);
  const double pos = tau * static_cast<double>(n - 1);
  const int64_t lo = std::max<int64_t>(0, static_cast<int64_t>(std::floor(pos)));
  const int64_t hi = std::min<int64_t>(lo + 1, n - 1);
  std::nth_element(tmp, tmp + lo, tmp + n);
  const float a = tmp[lo];
  const float b = hi > lo ? *std::min_element(tmp + lo + 1, tmp + n) : a;
  const float w = static_cast<float>(pos - std::floor(pos));
  // torch.lerp's two-sided formula
  return w < 0.5f ? a + w * (b - a) : b - (b - a) * (1.0f - w);
}

}  // namespace

// Returns {out [B, Hq, D] float32, kept [B, Hq] int32, theta [B, Hq] float32 (WARMUP; else empty)}.
// ANCHORED: eta holds log eta, and gap [B, Hq] float32 is read and overwritten in place.
// value_sum: [B, Hkv, D] float32 (SPARSE and ANCHORED without renormalize), or empty for none.
// shared: one kept set per KV group (SPARSE, WARMUP; the file's header).
std::vector<torch::Tensor> decode_cpu(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor eta,
                                      torch::Tensor tau, double scale, torch::Tensor seq_lens, torch::Tensor starts,
                                      bool renormalize, int64_t mode, torch::Tensor gap, int64_t first, int64_t last,
                                      torch::Tensor value_sum, bool shared) {
  TORCH_CHECK(mode == SPARSE || mode == DENSE || mode == WARMUP || mode == ANCHORED, "unknown mode");
  TORCH_CHECK(!shared || mode == SPARSE || mode == WARMUP, "shared runs the SPARSE and WARMUP modes only");
  TORCH_CHECK(q.dtype() == torch::kFloat32 && k.dtype() == torch::kFloat32 && v.dtype() == torch::kFloat32,
              "float32 tensors expected");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 4 && v.dim() == 4, "q [B, Hq, D] and caches [B, Hkv, S, D] expected");
  TORCH_CHECK(q.is_contiguous() && v.stride(3) == 1, "q and the value rows must be contiguous");
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t Hkv = k.size(1), S = k.size(2);
  TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0, "query heads must be a multiple of KV heads");
  const int64_t G = Hq / Hkv;
  for (const auto* idx : {&seq_lens, &starts}) {
    TORCH_CHECK(idx->numel() == 0 || (idx->dtype() == torch::kInt32 && idx->numel() == B && idx->is_contiguous()),
                "seq_lens and starts must be int32 [B]");
  }
  const bool sparse = mode == SPARSE || mode == ANCHORED;
  TORCH_CHECK(!sparse || (eta.dtype() == torch::kFloat32 && eta.numel() == B * Hq && eta.is_contiguous()),
              "eta must be float32 [B, Hq]");
  TORCH_CHECK(mode != ANCHORED || (gap.dtype() == torch::kFloat32 && gap.numel() == B * Hq && gap.is_contiguous()
                                   && first >= 0 && last >= 0),
              "gap must be float32 [B, Hq] and the anchor counts non-negative");
  TORCH_CHECK(mode != WARMUP || (tau.dtype() == torch::kFloat64 && tau.numel() == B * Hq && tau.is_contiguous()),
              "tau must be float64 [B, Hq]");
  const bool compensate = value_sum.numel() > 0;
  TORCH_CHECK(!compensate || (sparse && !renormalize && value_sum.dtype() == torch::kFloat32
                              && value_sum.numel() == B * Hkv * D && value_sum.is_contiguous()),
              "value_sum must be float32 [B, Hkv, D], for a sparse step without renormalize");
  auto out = torch::zeros({B, Hq, D}, q.options());
  auto kept = torch::zeros({B, Hq}, q.options().dtype(torch::kInt32));
  auto theta = mode == WARMUP ? torch::zeros({B, Hq}, q.options()) : torch::empty({0}, q.options());

  // Row ranges on the host (there is no device to synchronise with); the scores of the
  // union range come from one batched matrix product.
  const int32_t* lens = seq_lens.numel() ? seq_lens.data_ptr<int32_t>() : nullptr;
  const int32_t* st = starts.numel() ? starts.data_ptr<int32_t>() : nullptr;
  int64_t lo_all = S, hi_all = 0;
  for (int64_t b = 0; b < B; ++b) {
    lo_all = std::min<int64_t>(lo_all, st ? st[b] : 0);
    hi_all = std::max<int64_t>(hi_all, lens ? lens[b] : S);
    if (mode == ANCHORED && (lens ? lens[b] : S) <= (st ? st[b] : 0)) {
      std::fill(gap.data_ptr<float>() + b * Hq, gap.data_ptr<float>() + (b + 1) * Hq, 0.f);  // no keys, all anchors
    }
  }
  if (hi_all <= lo_all) return {out, kept, theta};
  const int64_t W = hi_all - lo_all;
  // [B, Hkv, G, W]: each task fills its own rows (own_dots), or BLAS all of them here.
  const bool own_dots = kVectorDots && D % 8 == 0 && k.stride(3) == 1;
  auto scores = own_dots ? torch::empty({B, Hkv, G, W}, q.options())
                         : at::matmul(q.view({B, Hkv, G, D}), k.narrow(2, lo_all, W).transpose(-1, -2)).contiguous();

  float* sp = scores.data_ptr<float>();
  const float* qp = q.data_ptr<float>();
  const float* kf = k.data_ptr<float>();
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1), ks2 = k.stride(2);
  const float* vp = v.data_ptr<float>();
  const float* ep = sparse ? eta.data_ptr<float>() : nullptr;
  float* gp = mode == ANCHORED ? gap.data_ptr<float>() : nullptr;
  const float* vsp = compensate ? value_sum.data_ptr<float>() : nullptr;
  const double* tp = mode == WARMUP ? tau.data_ptr<double>() : nullptr;
  float* op = out.data_ptr<float>();
  int32_t* kp = kept.data_ptr<int32_t>();
  float* thp = mode == WARMUP ? theta.data_ptr<float>() : nullptr;
  const int64_t vs0 = v.stride(0), vs1 = v.stride(1), vs2 = v.stride(2);
  const float sc = static_cast<float>(scale);

  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> e;        // [G, L]: exp(s - max), then the kept weights (0 where dropped)
    std::vector<float> tmp;      // [L]: a quantile's scratch
    std::vector<uint8_t> rows;   // [L]: 1 where some head of the group keeps the key
    std::vector<int64_t> list;   // [L]: the kept keys of the group, ascending
    std::vector<float> top;      // [L] (shared): the group's largest probability of each key
    std::vector<float> inv_z(G), thr(G), max_scaled(G), mass(G);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / Hkv, h = task % Hkv;
      const int64_t lo = st ? st[b] : 0, hi = lens ? lens[b] : S;
      const int64_t L = hi - lo;
      if (L <= 0) continue;
      e.resize(G * L);
      if (static_cast<int64_t>(rows.size()) < L) {
        rows.resize(L);
        list.resize(L);
      }
      const int64_t head0 = b * Hq + h * G;
      float* s0 = sp + task * G * W + (lo - lo_all);  // unscaled scores of head g: s0 + g * W
      if (own_dots) group_dots(qp + head0 * D, G, D, kf + b * ks0 + h * ks1 + lo * ks2, ks2, nullptr, L, s0, W);
      for (int64_t g = 0; g < G; ++g) {
        const float* srow = s0 + g * W;
        float* eg = e.data() + g * L;
        // A positive scale keeps the order, so the scaled maximum is the scale times the raw one.
        const float xmax = row_max(srow, L);
        max_scaled[g] = sc * xmax;
        const float z = exp_shift_sum(srow, eg, L, sc, xmax);
        inv_z[g] = 1.f / z;
        if (mode == ANCHORED) {
          const float gnew = std::log(z) - std::log(anchor_sum(eg, L, first, last));
          thr[g] = anchored_prob_threshold(ep[head0 + g], gp[head0 + g], gnew);
          gp[head0 + g] = gnew;  // this task owns its heads' gaps: read above, then replaced
        } else if (mode == SPARSE) {
          const float et = ep[head0 + g];
          thr[g] = et <= 0.f ? -1.f : et;  // eta <= 0: every valid key; NaN: the maximum only (p > NaN is false)
        } else {
          thr[g] = -1.f;
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        float* eg = e.data() + g * L;
        const float iz = inv_z[g];
#pragma omp simd
        for (int64_t j = 0; j < L; ++j) eg[j] *= iz;  // the probabilities
      }
      if (shared) {  // a key passes the group's threshold when its largest probability over the heads does
        top.assign(e.begin(), e.begin() + L);
        for (int64_t g = 1; g < G; ++g) {
          const float* eg = e.data() + g * L;
#pragma omp simd
          for (int64_t j = 0; j < L; ++j) top[j] = std::max(top[j], eg[j]);
        }
        if (mode == WARMUP) {
          tmp.resize(L);
          const float th = quantile(top.data(), tmp.data(), L, tp[head0]);
          std::fill(thp + head0, thp + head0 + G, th);
        }
      }
      // The kept weights and the keys some head keeps, branch-free, so that the pass over
      // V below reads only the marked rows and never mispredicts.
      std::fill(rows.begin(), rows.begin() + L, 0);
      for (int64_t g = 0; g < G; ++g) {
        float* eg = e.data() + g * L;
        const float iz = inv_z[g];
        if (mode == WARMUP && !shared) {
          tmp.resize(L);
          thp[head0 + g] = quantile(eg, tmp.data(), L, tp[head0 + g]);
        }
        const float t = thr[g];
        const float* by = shared ? top.data() : eg;  // what the threshold is compared with
        int32_t c = 0;
        float m = 0.f;
#pragma omp simd reduction(+ : c, m)
        for (int64_t j = 0; j < L; ++j) {
          const bool keep = by[j] > t;
          eg[j] = keep ? eg[j] : 0.f;
          c += keep ? 1 : 0;
          m += eg[j];
          rows[j] = rows[j] | static_cast<uint8_t>(keep);
        }
        // The maximum has e = exp(0) = 1, so p = 1 / z. Where the threshold drops it (or
        // eta is NaN), keep the first maximum by index, as torch's argmax picks it.
        if (!(iz > t)) {
          const int64_t a = first_scaled_equal(s0 + g * W, L, sc, max_scaled[g]);
          if (!shared || !(top[a] > t)) keep_maximum(eg, rows.data(), a, iz, c, m);  // shared: the group's set may hold it
        }
        kp[head0 + g] = c;
        mass[g] = m;
      }
      const int64_t n = compact_flagged(rows.data(), list.data(), L);
      const float* vb = vp + b * vs0 + h * vs1;
      float* og = op + head0 * D;
      for (int64_t i = 0; i < n; ++i) {
        if (i + kGatherAhead < n) prefetch_row(vb + (lo + list[i + kGatherAhead]) * vs2, D);
        const int64_t j = list[i];
        const float* vrow = vb + (lo + j) * vs2;
        for (int64_t g = 0; g < G; ++g) {
          const float w = e[g * L + j];
          if (w != 0.f) axpy(og + g * D, w, vrow, D);
        }
      }
      if (renormalize && sparse) divide_by_mass(og, mass.data(), G, D);
      if (compensate) {  // the pruned mass spread evenly over the L valid keys: V was read once for the sum
        const float* vsum = vsp + task * D;
        for (int64_t g = 0; g < G; ++g) {
          const float c = (1.f - mass[g]) / static_cast<float>(L);
          for (int64_t d = 0; d < D; ++d) og[g * D + d] += c * vsum[d];
        }
      }
    }
  });
  return {out, kept, theta};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode", &decode_cpu,
        "Fused decode step on the CPU, float32: mode 0 Sift (threshold eta), 1 exact, 2 exact and tau-quantile, "
        "3 Sift with the anchored normaliser (log eta, gap in place, anchor counts); value_sum: value-mean "
        "compensation of modes 0 and 3; shared: one kept set per KV group (modes 0 and 2)");
  m.def("keybound", &keybound_cpu,
        "Key-bound Sift step on the CPU (keybound_decode.cpp): bounds from the int8 key copy, full float32 keys "
        "of the candidates only; returns out, kept and the candidate rows per (batch row, KV head)");
  m.def("write_keys", &write_keys_cpu,
        "The int8 key copy's write on the CPU (key_write.cpp): float32 keys quantised as keybound.quantize_keys, "
        "bit for bit, into the copy's values and scales at positions start.. or index");
}
