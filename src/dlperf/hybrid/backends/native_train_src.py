"""C++ source of the plan interpreter's training half: backward instructions and a fused SGD update.

Appended to :data:`.native_src.SOURCE` (one library, one build). A training plan is an inference plan
whose slots are kept after the forward: ``train_forward`` runs the instructions and leaves every
activation in place; the loss and its gradient are computed in Python (a handful of ATen calls, any
loss); ``train_backward`` walks the instructions in reverse. For linear layers with few rows -- batch 1
and small batches, where per-operator dispatch is the whole cost -- the weight gradient, the input
gradient and the SGD update (weight decay, momentum, dampening, Nesterov) run in one pass over each
weight row while it is in L1, so the weights are read once per step. Larger inputs go through ATen's
matrix products into buffers allocated once, then the same fused update pass.

Per-parameter hyperparameters arrive as 7 doubles: lr, momentum, dampening, weight decay, nesterov,
maximize, first (1 on the step that creates the momentum buffer: it starts as a copy of the gradient).
"""

from __future__ import annotations

HYPER_FIELDS = 7
MODE_GRADS, MODE_SGD = 0, 1

SOURCE = r"""
#include <algorithm>

namespace {

struct TrainState {
  std::vector<at::Tensor> grads;     // gradient per slot, this step
  std::vector<at::Tensor> dx_bufs;   // per-instruction input-gradient buffers, reused across steps
  std::vector<at::Tensor> scratch;   // per-parameter gradient buffers when the caller keeps none
  std::vector<char> needs_grad;      // slot depends on a parameter
  std::vector<float> row;            // one weight row's gradient (fused path)
  int64_t out_slot = 0;
};

std::unordered_map<int64_t, TrainState> g_train;

at::Tensor act_backward(const at::Tensor& dy, const at::Tensor& y, int64_t act) {
  switch (act) {
    case 1: return at::threshold_backward(dy, y, 0);
    case 2: return at::sigmoid_backward(dy, y);
    case 3: return at::tanh_backward(dy, y);
    default: return dy;
  }
}

void accumulate(TrainState& t, int64_t slot, const at::Tensor& g) {
  if (!t.needs_grad[slot]) return;
  at::Tensor& cur = t.grads[slot];
  cur = cur.defined() ? at::add(cur, g) : g;
}

// p -= lr * d(g), torch.optim.SGD's single-tensor arithmetic per element.
void sgd_apply(float* p, const float* g, float* buf, int64_t n, const double* h) {
  const float lr = static_cast<float>(h[0]), mom = static_cast<float>(h[1]);
  const float keep = static_cast<float>(1.0 - h[2]), wd = static_cast<float>(h[3]);
  const bool nesterov = h[4] != 0.0, maximize = h[5] != 0.0, first = h[6] != 0.0;
  for (int64_t i = 0; i < n; ++i) {
    float gi = maximize ? -g[i] : g[i];
    if (wd != 0.f) gi = gi + wd * p[i];
    if (mom != 0.f) {
      const float b = first ? gi : buf[i] * mom + keep * gi;
      buf[i] = b;
      gi = nesterov ? gi + mom * b : b;
    }
    p[i] = p[i] + (-lr) * gi;
  }
}

bool plain_float(const at::Tensor& t) {
  return t.defined() && t.scalar_type() == at::kFloat && t.device().is_cpu() && t.is_contiguous();
}

at::Tensor& reuse(std::vector<at::Tensor>& v, int64_t i, const at::Tensor& like) {
  at::Tensor& cur = v[i];
  if (!cur.defined() || cur.sizes() != like.sizes() || cur.dtype() != like.dtype()) cur = at::empty_like(like);
  return cur;
}

float* ptr_or_null(const std::vector<at::Tensor>& v, int64_t i) {
  return (i < static_cast<int64_t>(v.size()) && v[i].defined() && v[i].numel() > 0) ? v[i].data_ptr<float>()
                                                                                    : nullptr;
}

// The SGD update of parameter `i` (a whole tensor) from its gradient `g`.
void sgd_step(at::Tensor& param, const at::Tensor& g, const std::vector<at::Tensor>& bufs, int64_t i,
              const std::vector<double>& hyper) {
  sgd_apply(param.data_ptr<float>(), g.data_ptr<float>(), ptr_or_null(bufs, i), param.numel(),
            hyper.data() + 7 * i);
}

// The gradient of bias `bi` from a (rows, out) output gradient, into the caller's buffer or scratch, then
// its update; the same for the fused and the ATen paths.
void bias_backward(Plan& p, TrainState& t, int64_t bi, const at::Tensor& dy2, std::vector<at::Tensor>& grads,
                   std::vector<at::Tensor>& bufs, const std::vector<double>& hyper, int64_t mode) {
  at::Tensor& b = p.params[bi];
  at::Tensor gb = !grads.empty() ? grads[bi] : reuse(t.scratch, bi, b);
  gb.copy_(dy2.sum(0));
  if (mode == 1) sgd_step(b, gb, bufs, bi, hyper);
}

void linear_backward(Plan& p, TrainState& t, int64_t index, const int64_t* ins, const at::Tensor& dy_post,
                     std::vector<at::Tensor>& grads, std::vector<at::Tensor>& bufs,
                     const std::vector<double>& hyper, int64_t mode) {
  const at::Tensor& x = p.slots[ins[1]];
  const at::Tensor& y = p.slots[ins[2]];
  at::Tensor& w = p.params[ins[3]];
  const int64_t wi = ins[3], bi = ins[4];
  at::Tensor dy = act_backward(dy_post, y, ins[5]).contiguous();
  const bool need_dx = t.needs_grad[ins[1]] != 0;
  const bool keep = !grads.empty();
  const int64_t rows = x.dim() == 2 ? x.size(0) : -1;
  const bool small = rows > 0 && rows <= SMALL_ROWS_PLACEHOLDER && plain_float(x) && plain_float(w) &&
      plain_float(dy) && (bi < 0 || plain_float(p.params[bi]));
  if (small) {
    const int64_t in = w.size(1), out = w.size(0);
    const float* xp = x.data_ptr<float>();
    const float* dyp = dy.data_ptr<float>();
    float* wp = w.data_ptr<float>();
    float* dxp = nullptr;
    if (need_dx) {
      at::Tensor& dx = reuse(t.dx_bufs, index, x);
      dx.zero_();
      dxp = dx.data_ptr<float>();
    }
    float* gw = keep ? grads[wi].data_ptr<float>() : nullptr;
    float* bw = mode == 1 ? ptr_or_null(bufs, wi) : nullptr;
    if (static_cast<int64_t>(t.row.size()) < in) t.row.resize(in);
    for (int64_t j = 0; j < out; ++j) {
      float* wj = wp + j * in;
      if (dxp) {  // the input gradient reads the weight row before the update below changes it
        for (int64_t r = 0; r < rows; ++r) {
          const float d = dyp[r * out + j];
          float* dxr = dxp + r * in;
#pragma GCC ivdep
          for (int64_t k = 0; k < in; ++k) dxr[k] += d * wj[k];
        }
      }
      float* gj = gw ? gw + j * in : t.row.data();
      for (int64_t k = 0; k < in; ++k) gj[k] = 0.f;
      for (int64_t r = 0; r < rows; ++r) {
        const float d = dyp[r * out + j];
        const float* xr = xp + r * in;
#pragma GCC ivdep
        for (int64_t k = 0; k < in; ++k) gj[k] += d * xr[k];
      }
      if (mode == 1) sgd_apply(wj, gj, bw ? bw + j * in : nullptr, in, hyper.data() + 7 * wi);
    }
    if (bi >= 0) bias_backward(p, t, bi, dy, grads, bufs, hyper, mode);
    if (need_dx) accumulate(t, ins[1], t.dx_bufs[index]);
    return;
  }
  // ATen path: gradients into planned buffers, then the fused update pass.
  at::Tensor x2 = x.reshape({-1, x.size(-1)});
  at::Tensor dy2 = dy.reshape({-1, dy.size(-1)});
  if (need_dx) accumulate(t, ins[1], at::matmul(dy, w));
  at::Tensor gw = keep ? grads[wi] : reuse(t.scratch, wi, w);
  at::mm_out(gw, dy2.t(), x2);
  if (mode == 1) sgd_step(w, gw, bufs, wi, hyper);
  if (bi >= 0) bias_backward(p, t, bi, dy2, grads, bufs, hyper, mode);
}

at::Tensor reduce_like(const at::Tensor& g, const at::Tensor& like) {
  return g.sizes() == like.sizes() ? g : g.sum_to_size(like.sizes());
}

}  // namespace

int64_t make_train_plan(std::vector<int64_t> code, std::vector<at::Tensor> params, int64_t num_slots,
                        int64_t output_slot) {
  // output_slot -1: no slot is handed to a caller, so every buffer is reused across steps.
  const int64_t id = make_plan(code, params, num_slots, -1);
  std::lock_guard<std::mutex> guard(g_lock);
  TrainState& t = g_train[id];
  t.out_slot = output_slot;
  t.grads.resize(num_slots);
  t.dx_bufs.resize(code.size() / 6);
  t.scratch.resize(params.size());
  t.needs_grad.assign(num_slots, 0);
  const int64_t n = static_cast<int64_t>(code.size()) / 6;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t* ins = code.data() + 6 * i;
    const int64_t op = ins[0];
    char need = op == 0 ? 1 : t.needs_grad[ins[1]];
    if (op == 2 || op == 4) need = need || t.needs_grad[ins[3]];
    t.needs_grad[ins[2]] = need;
  }
  return id;
}

void free_train_plan(int64_t id) {
  {
    std::lock_guard<std::mutex> guard(g_lock);
    g_train.erase(id);
  }
  free_plan(id);
}

at::Tensor train_forward(int64_t id, at::Tensor input) {
  auto it = g_plans.find(id);
  TORCH_CHECK(it != g_plans.end() && g_train.count(id), "training plan ", id, " was freed");
  Plan& p = it->second;
  interpret(p, input);
  return p.slots[g_train[id].out_slot];
}

// Mean softmax cross-entropy of (rows, classes) logits and its gradient, in one call: at batch 1 the
// five ATen calls of log_softmax, nll_loss and their backward cost more than the arithmetic.
std::vector<at::Tensor> cross_entropy_grad(at::Tensor logits, at::Tensor target, int64_t ignore_index) {
  TORCH_CHECK(logits.dim() == 2 && plain_float(logits), "cross_entropy_grad takes float32 (rows, classes)");
  TORCH_CHECK(target.dim() == 1 && target.scalar_type() == at::kLong && target.size(0) == logits.size(0),
              "cross_entropy_grad takes int64 class indices, one per row");
  at::Tensor t = target.contiguous();
  const int64_t rows = logits.size(0), classes = logits.size(1);
  at::Tensor grad = at::empty_like(logits);
  const float* z = logits.data_ptr<float>();
  const int64_t* y = t.data_ptr<int64_t>();
  float* g = grad.data_ptr<float>();
  double total = 0.0;
  int64_t counted = 0;
  for (int64_t r = 0; r < rows; ++r) counted += y[r] != ignore_index;
  const float scale = counted > 0 ? 1.f / static_cast<float>(counted) : 0.f;
  for (int64_t r = 0; r < rows; ++r) {
    const float* zr = z + r * classes;
    float* gr = g + r * classes;
    if (y[r] == ignore_index) {
      for (int64_t c = 0; c < classes; ++c) gr[c] = 0.f;
      continue;
    }
    TORCH_CHECK(y[r] >= 0 && y[r] < classes, "target ", y[r], " is out of bounds for ", classes, " classes");
    float m = zr[0];
    for (int64_t c = 1; c < classes; ++c) m = std::max(m, zr[c]);
    float sum = 0.f;
    for (int64_t c = 0; c < classes; ++c) sum += std::exp(zr[c] - m);
    const float log_sum = std::log(sum);
    total += static_cast<double>(log_sum - (zr[y[r]] - m));
    for (int64_t c = 0; c < classes; ++c) gr[c] = std::exp(zr[c] - m - log_sum) * scale;
    gr[y[r]] -= scale;
  }
  at::Tensor loss = at::full({}, counted > 0 ? static_cast<float>(total / counted) : NAN, logits.options());
  return {loss, grad};
}

void train_backward(int64_t id, at::Tensor grad_output, std::vector<at::Tensor> grads,
                    std::vector<at::Tensor> bufs, std::vector<double> hyper, int64_t mode) {
  auto it = g_plans.find(id);
  TORCH_CHECK(it != g_plans.end() && g_train.count(id), "training plan ", id, " was freed");
  Plan& p = it->second;
  TrainState& t = g_train[id];
  TORCH_CHECK(mode == 0 || hyper.size() == 7 * p.params.size(), "one set of hyperparameters per parameter");
  TORCH_CHECK(grads.empty() ? mode == 1 : grads.size() == p.params.size(), "one gradient buffer per parameter");
  at::NoGradGuard no_grad;
  for (auto& g : t.grads) g = at::Tensor();
  t.grads[t.out_slot] = grad_output;
  const int64_t n = static_cast<int64_t>(p.code.size()) / 6;
  for (int64_t i = n - 1; i >= 0; --i) {
    const int64_t* ins = p.code.data() + 6 * i;
    const at::Tensor dy = t.grads[ins[2]];
    if (!dy.defined()) continue;  // nothing downstream depends on this value
    t.grads[ins[2]] = at::Tensor();
    switch (ins[0]) {
      case 0: linear_backward(p, t, i, ins, dy, grads, bufs, hyper, mode); break;
      case 1: accumulate(t, ins[1], act_backward(dy, p.slots[ins[2]], ins[5])); break;
      case 2:
        accumulate(t, ins[1], reduce_like(dy, p.slots[ins[1]]));
        accumulate(t, ins[3], reduce_like(dy, p.slots[ins[3]]));
        break;
      case 3: accumulate(t, ins[1], dy.reshape(p.slots[ins[1]].sizes())); break;
      case 4:
        accumulate(t, ins[1], reduce_like(dy * p.slots[ins[3]], p.slots[ins[1]]));
        accumulate(t, ins[3], reduce_like(dy * p.slots[ins[1]], p.slots[ins[3]]));
        break;
      default: TORCH_CHECK(false, "unknown plan opcode ", ins[0]);
    }
  }
  p.slots[0] = at::Tensor();  // the caller's batch is not kept alive by the plan
}
"""

FUNCTIONS = ["make_train_plan", "free_train_plan", "train_forward", "train_backward", "cross_entropy_grad"]
