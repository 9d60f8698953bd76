// The key-bound Sift step on the CPU (float32 caches): one fused task per (batch row, KV head).
//
// The rule and why it is exact are in kernels/keybound.py; this is its torch reference's arithmetic
// in one pass per stage, on data that stays in the core's caches:
//
//   1. scan: every valid int8 key row k_hat_j (D bytes) against the group's scaled queries q' gives
//      the estimates s_hat = (q' . k_hat_j) c_j sm + sm q . o and the bound e = sm r_j |q'|_1 / 2 (1 + MARGIN)
//      + e_o; the largest lower bound s_hat - e per head;
//   2. T_lo = LSE(s_hat - e) + log eta - slack per head (every key's lower bound, one exp each);
//   3. candidates: key rows where some head's s_hat + e passes its T_lo or reaches its largest lower
//      bound; the others' estimates summed as exp(s_hat) (the normaliser's non-candidate part);
//   4. the candidates' full float32 key rows, exact scores for every head of the group;
//   5. per head: Z_est = sum over candidates exp(s) + sum over the others exp(s_hat), T_est =
//      max(log Z_est + log eta, T_lo); kept: candidates with s > T_est and the first maximum;
//   6. one pass over the value rows some head keeps.
//
// So the step reads D + 4 bytes a key row plus 4 D a candidate row and 4 D a kept value row, where
// the exact step reads 4 D a key row. A non-candidate is never kept (its s_hat <= s_hat + e <= T_lo
// <= T_est) and never the maximum (s_hat + e < the largest lower bound <= that key's exact score).

#include <ATen/Parallel.h>

#include "common.h"

#include <algorithm>

#include "dots.h"

namespace {

using namespace sift_cpu;

// log(eta) with the filter's edges (keybound._log_eta): eta <= 0 gives -inf (every key), eta >= 1
// and NaN +inf (the maximum only).
inline float log_eta_of(float eta) {
  if (eta <= 0.f) return -std::numeric_limits<float>::infinity();
  if (!(eta < 1.f)) return std::numeric_limits<float>::infinity();
  return static_cast<float>(std::log(static_cast<double>(eta)));
}

}  // namespace

// Returns {out [B, Hq, D] float32, kept [B, Hq] int32, candidates [B, Hkv] int32}.
// key_values [B, Hkv, >= L, D] int8 and key_scales [B, Hkv, >= L] float32 (kernels.keybound.Int8Keys);
// channel and offset [B, Hkv, D] float32 for the per-channel form, empty for the per-row form.
// e_scale = sm / 2 (1 + MARGIN), offset_rounding = OFFSET_ROUNDING, slack = SLACK2 ln 2 (nats).
std::vector<torch::Tensor> keybound_cpu(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor key_values,
                                        torch::Tensor key_scales, torch::Tensor channel, torch::Tensor offset,
                                        torch::Tensor eta, double scale, double e_scale, double offset_rounding,
                                        double slack, torch::Tensor seq_lens, torch::Tensor starts, bool renormalize) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 && k.dtype() == torch::kFloat32 && v.dtype() == torch::kFloat32,
              "float32 q and caches expected");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 4 && v.dim() == 4, "q [B, Hq, D] and caches [B, Hkv, S, D] expected");
  TORCH_CHECK(q.is_contiguous() && k.stride(3) == 1 && v.stride(3) == 1, "q and the key and value rows must be contiguous");
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t Hkv = k.size(1), S = k.size(2);
  TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0, "query heads must be a multiple of KV heads");
  const int64_t G = Hq / Hkv;
  TORCH_CHECK(key_values.dtype() == torch::kInt8 && key_values.dim() == 4 && key_values.size(0) == B &&
                  key_values.size(1) == Hkv && key_values.size(2) >= S && key_values.size(3) == D &&
                  key_values.stride(3) == 1,
              "key values must be int8 [B, Hkv, >= S, D] with contiguous rows");
  TORCH_CHECK(key_scales.dtype() == torch::kFloat32 && key_scales.dim() == 3 && key_scales.size(0) == B &&
                  key_scales.size(1) == Hkv && key_scales.size(2) >= S && key_scales.stride(2) == 1,
              "key scales must be float32 [B, Hkv, >= S] with contiguous rows");
  const bool per_channel = channel.numel() > 0;
  for (const auto* t : {&channel, &offset}) {
    TORCH_CHECK(!per_channel || (t->dtype() == torch::kFloat32 && t->dim() == 3 && t->size(0) == B &&
                                 t->size(1) == Hkv && t->size(2) == D && t->stride(2) == 1),
                "channel scales and offsets must be float32 [B, Hkv, D] with contiguous rows");
  }
  TORCH_CHECK(eta.dtype() == torch::kFloat32 && eta.numel() == B * Hq && eta.is_contiguous(), "eta must be float32 [B, Hq]");
  for (const auto* idx : {&seq_lens, &starts}) {
    TORCH_CHECK(idx->numel() == 0 || (idx->dtype() == torch::kInt32 && idx->numel() == B && idx->is_contiguous()),
                "seq_lens and starts must be int32 [B]");
  }
  auto out = torch::zeros({B, Hq, D}, q.options());
  auto kept = torch::zeros({B, Hq}, q.options().dtype(torch::kInt32));
  auto cand = torch::zeros({B, Hkv}, q.options().dtype(torch::kInt32));

  const int32_t* lens = seq_lens.numel() ? seq_lens.data_ptr<int32_t>() : nullptr;
  const int32_t* st = starts.numel() ? starts.data_ptr<int32_t>() : nullptr;
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const int8_t* hp = key_values.data_ptr<int8_t>();
  const float* cp = key_scales.data_ptr<float>();
  const float* chp = per_channel ? channel.data_ptr<float>() : nullptr;
  const float* ofp = per_channel ? offset.data_ptr<float>() : nullptr;
  const float* ep = eta.data_ptr<float>();
  float* op = out.data_ptr<float>();
  int32_t* keptp = kept.data_ptr<int32_t>();
  int32_t* candp = cand.data_ptr<int32_t>();
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1), ks2 = k.stride(2);
  const int64_t vs0 = v.stride(0), vs1 = v.stride(1), vs2 = v.stride(2);
  const int64_t hs0 = key_values.stride(0), hs1 = key_values.stride(1), hs2 = key_values.stride(2);
  const int64_t cs0 = key_scales.stride(0), cs1 = key_scales.stride(1);
  const int64_t zs0 = per_channel ? channel.stride(0) : 0, zs1 = per_channel ? channel.stride(1) : 0;
  const int64_t os0 = per_channel ? offset.stride(0) : 0, os1 = per_channel ? offset.stride(1) : 0;
  const double scales_in[4] = {scale, e_scale, offset_rounding, slack};

  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    // Locals, not captures: a captured float may alias the buffers written below, which keeps the
    // loops that read it from vectorising.
    const float sc = static_cast<float>(scales_in[0]), esc = static_cast<float>(scales_in[1]);
    const float orr = static_cast<float>(scales_in[2]), slk = static_cast<float>(scales_in[3]);
    const float inf = std::numeric_limits<float>::infinity();
    std::vector<float> qs(G * D);  // the group's queries, scaled by the channel scales (q')
    std::vector<float> est;        // [G, L]: the estimates s_hat
    std::vector<float> exact;      // [G, n]: the candidates' unscaled exact dots
    std::vector<float> w;          // [G, n]: exp(s - max), then the kept weights (0 where dropped)
    std::vector<int32_t> mark;     // [L]: 1 where the key row is a candidate (as wide as a float: the loops vectorise)
    std::vector<uint8_t> rows;     // [n]: 1 where some head keeps the candidate
    std::vector<int64_t> list;     // [L]: the candidates' positions (from the row's first valid key), ascending
    std::vector<int64_t> picked;   // [n]: the candidates some head keeps (indices into list)
    std::vector<float> shift(G), e_off(G), e_row(G), top(G), t_lo(G), log_eta(G), rest(G), mass(G);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / Hkv, h = task % Hkv;
      const int64_t lo = st ? st[b] : 0, hi = lens ? lens[b] : S;
      const int64_t L = hi - lo;
      if (L <= 0) continue;
      const int64_t head0 = b * Hq + h * G;
      const float* qg = qp + head0 * D;
      const float* c = cp + b * cs0 + h * cs1 + lo;  // the rows' scales
      for (int64_t g = 0; g < G; ++g) {
        const float* qrow = qg + g * D;
        float* qsrow = qs.data() + g * D;
        float sum_o = 0.f, abs_o = 0.f, l1 = 0.f;
        if (per_channel) {
          const float* ch = chp + b * zs0 + h * zs1;
          const float* of = ofp + b * os0 + h * os1;
          for (int64_t d = 0; d < D; ++d) {
            const float qo = qrow[d] * of[d];
            sum_o += qo;
            abs_o += std::fabs(qo);
            qsrow[d] = qrow[d] * ch[d];
          }
        } else {
          std::copy(qrow, qrow + D, qsrow);
        }
        for (int64_t d = 0; d < D; ++d) l1 += std::fabs(qsrow[d]);
        shift[g] = sum_o * sc;
        e_off[g] = abs_o * (sc * orr);
        e_row[g] = l1 * esc;  // e_j = e_row c_j + e_off
        log_eta[g] = log_eta_of(ep[head0 + g]);
      }

      // 1. The scan: estimates and each head's largest lower bound.
      est.resize(G * L);
      group_dots(qs.data(), G, D, hp + b * hs0 + h * hs1 + lo * hs2, hs2, nullptr, L, est.data(), L);
      for (int64_t g = 0; g < G; ++g) {
        float* s = est.data() + g * L;
        const float sh = shift[g], er = e_row[g], eo = e_off[g];
        float m = -inf;
#pragma omp simd reduction(max : m)
        for (int64_t j = 0; j < L; ++j) {
          s[j] = s[j] * c[j] * sc + sh;
          const float low = s[j] - (er * c[j] + eo);
          m = low > m ? low : m;
        }
        top[g] = m;
      }
      // 2. T_lo from the log-sum-exp of the lower bounds.
      for (int64_t g = 0; g < G; ++g) {
        const float* s = est.data() + g * L;
        const float er = e_row[g], eo = e_off[g], m = top[g];
        float z = 0.f;
#pragma omp simd reduction(+ : z)
        for (int64_t j = 0; j < L; ++j) z += exp_nonpos((s[j] - (er * c[j] + eo)) - m);
        t_lo[g] = std::isinf(log_eta[g]) ? log_eta[g] : m + std::log(z) + log_eta[g] - slk;
      }
      // 3. The candidates, and the others' estimates summed relative to each head's largest lower bound.
      mark.assign(L, 0);
      for (int64_t g = 0; g < G; ++g) {
        const float* s = est.data() + g * L;
        const float er = e_row[g], eo = e_off[g], tl = t_lo[g], m = top[g];
#pragma omp simd
        for (int64_t j = 0; j < L; ++j) {
          const float up = s[j] + (er * c[j] + eo);
          mark[j] |= static_cast<int32_t>((up > tl) | (up >= m));
        }
      }
      if (static_cast<int64_t>(list.size()) < L) list.resize(L);
      const int64_t n = compact_flagged(mark.data(), list.data(), L);
      candp[task] = static_cast<int32_t>(n);
      if (n == 0) continue;  // only where the bounds are not finite
      for (int64_t g = 0; g < G; ++g) {
        const float* s = est.data() + g * L;
        const float m = top[g];
        float z = 0.f;
#pragma omp simd reduction(+ : z)
        for (int64_t j = 0; j < L; ++j) z += exp_nonpos(mark[j] ? -inf : s[j] - m);  // s_hat + e < m here
        rest[g] = z;
      }

      // 4. The candidates' exact scores (unscaled dots; scaled where compared, as the exact step).
      exact.resize(G * n);
      w.resize(G * n);
      rows.assign(n, 0);
      picked.resize(n);
      group_dots(qg, G, D, kp + b * ks0 + h * ks1 + lo * ks2, ks2, list.data(), n, exact.data(), n);

      // 5. Each head's normaliser, threshold and kept weights.
      for (int64_t g = 0; g < G; ++g) {
        const float* x = exact.data() + g * n;
        float* wg = w.data() + g * n;
        const float xmax = row_max(x, n);
        const float m = sc * xmax;
        const float zc = exp_shift_sum(x, wg, n, sc, xmax);
        const float z = zc + std::exp(top[g] - m) * rest[g];
        const float le = log_eta[g];
        const float t_est = std::isinf(le) ? le : std::max(m + std::log(z) + le, t_lo[g]);
        const float iz = 1.f / z;
        int32_t cnt = 0;
        float ms = 0.f;
#pragma omp simd reduction(+ : cnt, ms)
        for (int64_t i = 0; i < n; ++i) {
          const bool keep = sc * x[i] > t_est;
          wg[i] = keep ? wg[i] * iz : 0.f;
          cnt += keep ? 1 : 0;
          ms += wg[i];
          rows[i] = rows[i] | static_cast<uint8_t>(keep);
        }
        if (!(m > t_est)) keep_maximum(wg, rows.data(), first_scaled_equal(x, n, sc, m), iz, cnt, ms);
        keptp[head0 + g] = cnt;
        mass[g] = ms;
      }

      // 6. The value rows some head keeps.
      const float* vb = vp + b * vs0 + h * vs1 + lo * vs2;
      float* og = op + head0 * D;
      int64_t nk = 0;
      for (int64_t i = 0; i < n; ++i) {
        picked[nk] = i;
        nk += rows[i];
      }
      for (int64_t r = 0; r < nk; ++r) {
        if (r + kGatherAhead < nk) prefetch_row(vb + list[picked[r + kGatherAhead]] * vs2, D);
        const int64_t i = picked[r];
        const float* vrow = vb + list[i] * vs2;
        for (int64_t g = 0; g < G; ++g) {
          const float wt = w[g * n + i];
          if (wt != 0.f) axpy(og + g * D, wt, vrow, D);
        }
      }
      if (renormalize) divide_by_mass(og, mass.data(), G, D);
    }
  });
  return {out, kept, cand};
}
