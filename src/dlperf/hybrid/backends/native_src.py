"""C++ source of the plan interpreter that the ``native`` backend compiles at first use.

A captured graph becomes a *plan*: a flat list of instructions over numbered value slots, kept on
the C++ side behind an integer handle, so one replay is one Python -> C++ call. Every PyTorch op
called from Python costs 2-4 us of dispatch on a typical CPU, which dominates small networks (the
d2l MLP at batch 1 does 0.33 MFLOP, about 4 us of arithmetic); a replay in C++ pays it once.

Linear layers with a handful of rows run a hand-written, single-threaded kernel: at batch 1 the
BLAS call and its thread-pool wake-up cost more than the dot products themselves. Larger inputs
go through ATen. Intermediate results live in buffers reused from the previous call; the output,
and any buffer sharing its memory, is handed to the caller and never written again, so results
kept from earlier calls are never overwritten.
"""

from __future__ import annotations

from . import native_train_src as train_src

# Instruction opcodes; keep in sync with the switch in ``interpret``.
OP_LINEAR = 0  # a=input slot, b=output slot, c=weight index, d=bias index (-1: none), e=activation
OP_ACT = 1  # a=input, b=output, e=activation
OP_ADD = 2  # a, c(as slot)=second input, b=output
OP_FLATTEN = 3  # a=input, b=output, c=start_dim, d=end_dim
OP_MUL = 4  # a, c(as slot)=second input, b=output

ACT_NONE, ACT_RELU, ACT_SIGMOID, ACT_TANH = 0, 1, 2, 3

# Rows at or below this go through the hand-written kernel; above it, BLAS wins.
SMALL_ROWS = 8

SOURCE = r"""
#include <torch/extension.h>
#include <cmath>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace {

struct Plan {
  std::vector<int64_t> code;        // 6 ints per instruction: op, a, b, c, d, e
  std::vector<at::Tensor> params;   // weights and biases, shared with the module (no copies)
  std::vector<at::Tensor> slots;    // value slots; slot 0 is the input
  int64_t num_slots = 0;
  int64_t output_slot = 0;
};

std::mutex g_lock;
std::unordered_map<int64_t, Plan> g_plans;
int64_t g_next = 1;

inline float activate(float v, int64_t act) {
  switch (act) {
    case 1: return v > 0.f ? v : 0.f;
    case 2: return 1.f / (1.f + std::exp(-v));
    case 3: return std::tanh(v);
    default: return v;
  }
}

// y[r, j] = act(sum_k x[r, k] * w[j, k] + b[j]) for few rows r: four weight rows at a time so each
// load of x feeds four fused multiply-adds; the inner loop vectorizes under -O3 -march=native.
void small_linear(const float* x, const float* w, const float* b, float* y,
                  int64_t rows, int64_t in, int64_t out, int64_t act) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * in;
    float* yr = y + r * out;
    int64_t j = 0;
    for (; j + 4 <= out; j += 4) {
      const float* w0 = w + j * in;
      const float* w1 = w0 + in;
      const float* w2 = w1 + in;
      const float* w3 = w2 + in;
      float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma GCC ivdep
      for (int64_t k = 0; k < in; ++k) {
        const float xv = xr[k];
        s0 += w0[k] * xv; s1 += w1[k] * xv; s2 += w2[k] * xv; s3 += w3[k] * xv;
      }
      if (b) { s0 += b[j]; s1 += b[j + 1]; s2 += b[j + 2]; s3 += b[j + 3]; }
      yr[j] = activate(s0, act); yr[j + 1] = activate(s1, act);
      yr[j + 2] = activate(s2, act); yr[j + 3] = activate(s3, act);
    }
    for (; j < out; ++j) {
      const float* wj = w + j * in;
      float s = 0.f;
      for (int64_t k = 0; k < in; ++k) s += wj[k] * xr[k];
      if (b) s += b[j];
      yr[j] = activate(s, act);
    }
  }
}

at::Tensor apply_act(const at::Tensor& t, int64_t act, bool inplace) {
  switch (act) {
    case 1: return inplace ? t.relu_() : t.relu();
    case 2: return inplace ? t.sigmoid_() : t.sigmoid();
    case 3: return inplace ? t.tanh_() : t.tanh();
    default: return t;
  }
}

// A buffer for slot s shaped like `sizes`: reused across calls, except for the output slot, which
// is fresh every call because the caller owns it.
at::Tensor buffer_for(Plan& p, int64_t s, at::IntArrayRef sizes, const at::TensorOptions& opt) {
  if (s != p.output_slot) {
    at::Tensor& cur = p.slots[s];
    if (cur.defined() && cur.sizes() == sizes && cur.options().dtype() == opt.dtype() &&
        cur.device() == opt.device())
      return cur;
  }
  return at::empty(sizes, opt);
}

void run_linear(Plan& p, const int64_t* ins) {
  const at::Tensor& x = p.slots[ins[1]];
  const at::Tensor& w = p.params[ins[3]];
  const bool has_b = ins[4] >= 0;
  const int64_t act = ins[5];
  const int64_t out_features = w.size(0);
  const bool small = x.dim() == 2 && x.size(0) <= SMALL_ROWS_PLACEHOLDER &&
      x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat && x.device().is_cpu() &&
      x.is_contiguous() && w.is_contiguous() && (!has_b || p.params[ins[4]].is_contiguous());
  if (small) {
    at::Tensor y = buffer_for(p, ins[2], {x.size(0), out_features}, x.options());
    small_linear(x.data_ptr<float>(), w.data_ptr<float>(),
                 has_b ? p.params[ins[4]].data_ptr<float>() : nullptr, y.data_ptr<float>(),
                 x.size(0), x.size(1), out_features, act);
    p.slots[ins[2]] = y;
    return;
  }
  at::Tensor y = has_b ? at::linear(x, w, p.params[ins[4]]) : at::linear(x, w);
  p.slots[ins[2]] = apply_act(y, act, true);
}

// Runs the plan's instructions on `input`, leaving every result in its slot. Both entry points share
// it: run_plan hands the output to its caller, train_forward keeps every slot for train_backward.
void interpret(Plan& p, const at::Tensor& input) {
  at::NoGradGuard no_grad;
  p.slots[0] = input;
  const int64_t n = static_cast<int64_t>(p.code.size()) / 6;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t* ins = p.code.data() + 6 * i;
    switch (ins[0]) {
      case 0: run_linear(p, ins); break;
      case 1: p.slots[ins[2]] = apply_act(p.slots[ins[1]], ins[5], false); break;
      case 2: p.slots[ins[2]] = at::add(p.slots[ins[1]], p.slots[ins[3]]); break;
      case 3: p.slots[ins[2]] = p.slots[ins[1]].flatten(ins[3], ins[4]); break;
      case 4: p.slots[ins[2]] = at::mul(p.slots[ins[1]], p.slots[ins[3]]); break;
      default: TORCH_CHECK(false, "unknown plan opcode ", ins[0]);
    }
  }
}

}  // namespace

int64_t make_plan(std::vector<int64_t> code, std::vector<at::Tensor> params, int64_t num_slots,
                  int64_t output_slot) {
  TORCH_CHECK(code.size() % 6 == 0, "plan code length must be a multiple of 6");
  std::lock_guard<std::mutex> guard(g_lock);
  int64_t id = g_next++;
  Plan& p = g_plans[id];
  p.code = std::move(code);
  p.params = std::move(params);
  p.num_slots = num_slots;
  p.output_slot = output_slot;
  p.slots.resize(num_slots);
  return id;
}

void free_plan(int64_t id) {
  std::lock_guard<std::mutex> guard(g_lock);
  g_plans.erase(id);
}

at::Tensor run_plan(int64_t id, at::Tensor input) {
  // No lock on the hot path: a plan belongs to one hybridized module, which, like any nn.Module
  // with reused buffers, is not meant to be called from two threads at once.
  auto it = g_plans.find(id);
  TORCH_CHECK(it != g_plans.end(), "plan ", id, " was freed");
  Plan& p = it->second;
  interpret(p, input);
  at::Tensor out = p.slots[p.output_slot];
  // The caller owns the output: forget every slot that shares its memory (a flatten view of a
  // buffer, the input itself) so a later call never writes into it. Also drop the input reference.
  for (int64_t s = 0; s < p.num_slots; ++s) {
    if (s == 0 || (p.slots[s].defined() && p.slots[s].is_alias_of(out))) p.slots[s] = at::Tensor();
  }
  return out;
}
"""

# One library for inference and training plans: the training half reuses the plan and its kernels.
SOURCE = (SOURCE + train_src.SOURCE).replace("SMALL_ROWS_PLACEHOLDER", str(SMALL_ROWS))

FUNCTIONS = ["make_plan", "free_plan", "run_plan", *train_src.FUNCTIONS]
