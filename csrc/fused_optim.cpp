// Fused CPU optimizer steps on fp32 tensors: AdamW / Adam and the two phases of LAMB.
//
// Each step is one pass over memory (LAMB: two, with the whole-parameter norms reduced
// between them), split into chunks run in parallel by at::parallel_for (OpenMP in torch's
// CPU builds) and vectorised by the compiler (-O3, the machine's own vector width) within a
// chunk. Why by hand: torch's fused CPU AdamW has no LAMB, no bf16 copy-out for an offloaded
// master copy, and no way to return the per-tensor norms LAMB needs from the same pass.
// The arithmetic follows torch.optim.AdamW's order (denominator sqrt(v)/sqrt(bc2) + eps),
// so results agree with it to fp32 rounding; autopar/optim/cpu_kernels.py is the reference.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <cmath>
#include <vector>

namespace {

constexpr int64_t kGrain = 1 << 15;  // elements per chunk: large enough to amortise a task

void check_fp32(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor, got ", t.device());
  TORCH_CHECK(t.scalar_type() == torch::kFloat32, name, " must be float32, got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

void check_same(const torch::Tensor& p, const torch::Tensor& t, const char* name) {
  check_fp32(t, name);
  TORCH_CHECK(t.numel() == p.numel(), name, " has ", t.numel(), " elements, the parameter ", p.numel());
}

void check_bf16_out(const torch::Tensor& p, const c10::optional<torch::Tensor>& out) {
  if (!out.has_value()) return;
  TORCH_CHECK(out->device().is_cpu() && out->scalar_type() == torch::kBFloat16 && out->is_contiguous() &&
                  out->numel() == p.numel(),
              "param_bf16 must be a contiguous bfloat16 CPU tensor with as many elements as the parameter");
}

struct Bias {
  float bc1, bc2_sqrt;
  Bias(int64_t step, double b1, double b2, bool on)
      : bc1(on ? static_cast<float>(1.0 - std::pow(b1, step)) : 1.f),
        bc2_sqrt(on ? static_cast<float>(std::sqrt(1.0 - std::pow(b2, step))) : 1.f) {}
};

}  // namespace

// AdamW (decoupled weight decay) or Adam (L2: wd * p added to the gradient) in one pass.
void adam_step(torch::Tensor param, torch::Tensor grad, torch::Tensor exp_avg, torch::Tensor exp_avg_sq,
               int64_t step, double lr, double beta1, double beta2, double eps, double weight_decay,
               bool decoupled, c10::optional<torch::Tensor> param_bf16) {
  check_fp32(param, "param");
  check_same(param, grad, "grad");
  check_same(param, exp_avg, "exp_avg");
  check_same(param, exp_avg_sq, "exp_avg_sq");
  check_bf16_out(param, param_bf16);
  float* __restrict__ p = param.data_ptr<float>();
  const float* __restrict__ g = grad.data_ptr<float>();
  float* __restrict__ m = exp_avg.data_ptr<float>();
  float* __restrict__ v = exp_avg_sq.data_ptr<float>();
  c10::BFloat16* out = param_bf16.has_value() ? param_bf16->data_ptr<c10::BFloat16>() : nullptr;
  const Bias bias(step, beta1, beta2, true);
  const float b2 = beta2, one_b1 = 1.0 - beta1, one_b2 = 1.0 - beta2;
  const float step_size = lr / bias.bc1, inv_bc2 = 1.f / bias.bc2_sqrt, e = eps;
  const float decay = decoupled ? static_cast<float>(1.0 - lr * weight_decay) : 1.f;
  const float l2 = decoupled ? 0.f : static_cast<float>(weight_decay);
  at::parallel_for(0, param.numel(), kGrain, [&](int64_t begin, int64_t end) {
#pragma omp simd
    for (int64_t i = begin; i < end; ++i) {
      const float pi = p[i] * decay;
      const float gi = g[i] + l2 * p[i];
      const float mi = m[i] + one_b1 * (gi - m[i]);  // lerp, as torch's exp_avg.lerp_
      const float vi = b2 * v[i] + one_b2 * gi * gi;
      const float denom = std::sqrt(vi) * inv_bc2 + e;
      const float pn = pi - step_size * (mi / denom);
      m[i] = mi;
      v[i] = vi;
      p[i] = pn;
    }
    if (out != nullptr)
      for (int64_t i = begin; i < end; ++i) out[i] = c10::BFloat16(p[i]);
  });
}

// LAMB phase 1: update the moments, and return [sum x^2, sum u^2] (fp64 accumulation) where
// u = (m / bc1) / (sqrt(v) / sqrt(bc2) + eps) + wd x. Nothing is written to the parameter.
torch::Tensor lamb_phase1(torch::Tensor param, torch::Tensor grad, torch::Tensor exp_avg, torch::Tensor exp_avg_sq,
                          int64_t step, double beta1, double beta2, double eps, double weight_decay,
                          bool bias_correction) {
  check_fp32(param, "param");
  check_same(param, grad, "grad");
  check_same(param, exp_avg, "exp_avg");
  check_same(param, exp_avg_sq, "exp_avg_sq");
  const float* __restrict__ p = param.data_ptr<float>();
  const float* __restrict__ g = grad.data_ptr<float>();
  float* __restrict__ m = exp_avg.data_ptr<float>();
  float* __restrict__ v = exp_avg_sq.data_ptr<float>();
  const Bias bias(step, beta1, beta2, bias_correction);
  const float b2 = beta2, one_b1 = 1.0 - beta1, one_b2 = 1.0 - beta2;
  const float inv_bc1 = 1.f / bias.bc1, inv_bc2 = 1.f / bias.bc2_sqrt, e = eps, wd = weight_decay;
  const int64_t n = param.numel();
  const int64_t chunks = std::max<int64_t>(1, (n + kGrain - 1) / kGrain);
  std::vector<double> wsq(chunks, 0.0), usq(chunks, 0.0);
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t begin = c * kGrain, end = std::min(n, begin + kGrain);
      float ws = 0.f, us = 0.f;  // a chunk's partial sums in fp32 (<= 32K terms), chunks summed in fp64
      // simd reduction: lets the compiler keep one partial sum per vector lane (-fopenmp-simd;
      // no OpenMP runtime is linked, at::parallel_for does the threading)
#pragma omp simd reduction(+ : ws, us)
      for (int64_t i = begin; i < end; ++i) {
        const float mi = m[i] + one_b1 * (g[i] - m[i]);
        const float vi = b2 * v[i] + one_b2 * g[i] * g[i];
        const float u = (mi * inv_bc1) / (std::sqrt(vi) * inv_bc2 + e) + wd * p[i];
        m[i] = mi;
        v[i] = vi;
        ws += p[i] * p[i];
        us += u * u;
      }
      wsq[c] = ws;
      usq[c] = us;
    }
  });
  double w_total = 0.0, u_total = 0.0;
  for (int64_t c = 0; c < chunks; ++c) {
    w_total += wsq[c];
    u_total += usq[c];
  }
  return torch::tensor({w_total, u_total}, torch::kFloat64);
}

// LAMB phase 2: x -= scale * u, u recomputed from the moments phase 1 left (scale = lr * trust ratio).
void lamb_phase2(torch::Tensor param, torch::Tensor exp_avg, torch::Tensor exp_avg_sq, int64_t step, double scale,
                 double beta1, double beta2, double eps, double weight_decay, bool bias_correction,
                 c10::optional<torch::Tensor> param_bf16) {
  check_fp32(param, "param");
  check_same(param, exp_avg, "exp_avg");
  check_same(param, exp_avg_sq, "exp_avg_sq");
  check_bf16_out(param, param_bf16);
  float* __restrict__ p = param.data_ptr<float>();
  const float* __restrict__ m = exp_avg.data_ptr<float>();
  const float* __restrict__ v = exp_avg_sq.data_ptr<float>();
  c10::BFloat16* out = param_bf16.has_value() ? param_bf16->data_ptr<c10::BFloat16>() : nullptr;
  const Bias bias(step, beta1, beta2, bias_correction);
  const float inv_bc1 = 1.f / bias.bc1, inv_bc2 = 1.f / bias.bc2_sqrt, e = eps, wd = weight_decay, s = scale;
  at::parallel_for(0, param.numel(), kGrain, [&](int64_t begin, int64_t end) {
#pragma omp simd
    for (int64_t i = begin; i < end; ++i) {
      const float u = (m[i] * inv_bc1) / (std::sqrt(v[i]) * inv_bc2 + e) + wd * p[i];
      p[i] = p[i] - s * u;
    }
    if (out != nullptr)
      for (int64_t i = begin; i < end; ++i) out[i] = c10::BFloat16(p[i]);
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "autopar fused CPU optimizer steps (fp32): Adam/AdamW and LAMB";
  m.def("adam_step", &adam_step, "fused Adam/AdamW step in place");
  m.def("lamb_phase1", &lamb_phase1, "LAMB moments update; returns [sum x^2, sum u^2]");
  m.def("lamb_phase2", &lamb_phase2, "LAMB parameter update with the trust-ratio scale");
}
