// bench_kernel_invariance: do LibTorch's CPU kernels give the same bits for a row or a column
// whatever the rest of the operands' shape is? A layout-invariant mode (the same bits at every TP,
// FSDP and pipeline layout) can only use a kernel as it is where the answer is yes; where it is
// no, the kernel must run on fixed-shape tiles.
//
//   build/bench/bench_kernel_invariance [--threads N] [--dtype float32|bfloat16]
//   scripts/bench kernel_invariance
//
// Each row compares a slice of one kernel call on whole operands with the same slice computed
// from a call on only the operands it needs (fewer rows of A: a smaller batch or a decode step;
// fewer columns of B: a column-parallel shard; fewer heads: a head-parallel shard; one query
// row: a decode step against the cache). "contracted dim split" (a row-parallel matmul's
// segments added left to right) is reported, not counted: whether it equals the whole product
// depends on how the kernel blocks the contracted dim.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/version.h>

#include <cstdio>
#include <functional>
#include <iostream>
#include <string>
#include <vector>

#include "common/cli.h"

namespace {

constexpr const char* kUsage =
    R"(usage: bench_kernel_invariance [--threads N] [--dtype float32|bfloat16]

Checks, on this machine's LibTorch CPU kernels, whether a row or a column of a result has the
same bits whatever the rest of the operands' shape is: mm and linear (rows of A, columns of B),
bmm (batch entries), scaled-dot-product attention (heads; a decode step's row against the same
row of a whole-sequence prefill) and row-wise reductions (softmax, rms_norm, sum). Prints a
table (equal bit for bit, or the largest difference in units of the result's magnitude) and a
last line:
  RESULT invariant=<cases equal> cases=<cases> mm_rows=<0|1> mm_columns=<0|1> sdpa_heads=<0|1> sdpa_decode=<0|1>

options:
  --threads N   intra-op threads (default 1, as each rank runs in tests)
  --dtype D     float32 (default) or bfloat16
  --help        print this help
)";

struct Row {
  std::string kernel, varies, shapes;
  bool equal;
  double max_diff;  // relative to the largest magnitude of the whole result
  bool control;     // expected to differ
};

Row compare(const std::string& kernel, const std::string& varies, const std::string& shapes,
            const at::Tensor& whole_slice, const at::Tensor& part, bool control = false) {
  const bool equal = at::equal(whole_slice, part);
  const at::Tensor a = whole_slice.to(at::kDouble), b = part.to(at::kDouble);
  const double scale = std::max(a.abs().max().item<double>(), 1e-30);
  return {kernel, varies, shapes, equal, (a - b).abs().max().item<double>() / scale, control};
}

std::string dims(std::initializer_list<int64_t> d) {
  std::string s;
  for (int64_t x : d) s += (s.empty() ? "" : "x") + std::to_string(x);
  return s;
}

std::vector<Row> run(at::ScalarType dtype) {
  at::manual_seed(0);
  const auto opt = at::TensorOptions().dtype(dtype);
  std::vector<Row> rows;
  // A decoder layer's matmuls at a small scale: 64 tokens, model dim 256, 512 output features.
  const int64_t M = 64, K = 256, N = 512;
  const at::Tensor A = at::randn({M, K}).to(opt), B = at::randn({K, N}).to(opt);
  const at::Tensor bias = at::randn({N}).to(opt);
  const at::Tensor C = at::mm(A, B);
  for (int64_t m : {1, 3, 8, 17, 32})
    rows.push_back(compare("mm", "rows of A", dims({m, K}) + " of " + dims({M, K}),
                           C.narrow(0, 0, m), at::mm(A.narrow(0, 0, m), B)));
  for (int64_t parts : {2, 4, 8}) {
    const int64_t n = N / parts;
    // The last shard, so that an offset column block is checked, not only the first.
    rows.push_back(compare("mm", "columns of B", dims({K, n}) + " of " + dims({K, N}),
                           C.narrow(1, N - n, n), at::mm(A, B.narrow(1, N - n, n).contiguous())));
  }
  {
    // Narrow products: a head-sized column shard of a small model.
    const at::Tensor Bs = at::randn({K, 32}).to(opt);
    const at::Tensor Cs = at::mm(A, Bs);
    for (int64_t n : {16, 8})
      rows.push_back(compare("mm", "columns of B", dims({K, n}) + " of " + dims({K, 32}),
                             Cs.narrow(1, 32 - n, n),
                             at::mm(A, Bs.narrow(1, 32 - n, n).contiguous())));
  }
  {
    // A segment of the contracted dim as a view (leading dim K) against a contiguous copy, and
    // the same for a transposed weight's rows: what the layout-invariant mode multiplies.
    const at::Tensor W2 = at::randn({N, K}).to(opt);
    for (int64_t len : {64, 128}) {
      const at::Tensor a = A.narrow(1, K - len, len), b = W2.t().narrow(0, K - len, len);
      rows.push_back(compare("mm", "leading dim of views", dims({M, len}) + " of " + dims({M, K}),
                             at::mm(a.contiguous(), b.contiguous()), at::mm(a, b)));
    }
  }
  // Row-parallel: the contracted dim cut into segments whose products are added left to right.
  // Whether that equals the whole product depends on how the kernel blocks the contracted dim.
  auto segmented = [](const at::Tensor& a, const at::Tensor& b, std::vector<int64_t> cuts) {
    at::Tensor sum;
    int64_t start = 0;
    for (int64_t len : cuts) {
      const at::Tensor part = at::mm(a.narrow(1, start, len), b.narrow(0, start, len));
      sum = sum.defined() ? sum + part : part;
      start += len;
    }
    return sum;
  };
  for (const auto& [label, cuts] : std::vector<std::pair<std::string, std::vector<int64_t>>>{
           {"2 x 128", {128, 128}},
           {"4 x 64", {64, 64, 64, 64}},
           {"8 x 32", std::vector<int64_t>(8, 32)},
           {"96+96+64", {96, 96, 64}}}) {
    rows.push_back(compare("mm", "contracted dim split", label + " of K=" + std::to_string(K), C,
                           segmented(A, B, cuts), /*control=*/true));
  }
  {
    const int64_t K2 = 2048;
    const at::Tensor A2 = at::randn({M, K2}).to(opt), B2 = at::randn({K2, N}).to(opt);
    const at::Tensor C2 = at::mm(A2, B2);
    for (int64_t parts : {2, 4})
      rows.push_back(compare("mm", "contracted dim split",
                             std::to_string(parts) + " x " + std::to_string(K2 / parts) +
                                 " of K=" + std::to_string(K2),
                             C2, segmented(A2, B2, std::vector<int64_t>(parts, K2 / parts)),
                             /*control=*/true));
  }

  // linear (weight [N, K], bias): the 3-D input's rows and the weight's rows (output features).
  const at::Tensor W = B.t().contiguous();
  const at::Tensor X = A.view({2, M / 2, K});
  const at::Tensor Y = at::linear(X, W, bias);
  rows.push_back(compare("linear", "batch entries",
                         dims({1, M / 2, K}) + " of " + dims({2, M / 2, K}), Y.narrow(0, 1, 1),
                         at::linear(X.narrow(0, 1, 1), W, bias)));
  for (int64_t parts : {2, 4}) {
    const int64_t n = N / parts;
    rows.push_back(compare("linear", "output features", dims({n, K}) + " of " + dims({N, K}),
                           Y.narrow(2, N - n, n),
                           at::linear(X, W.narrow(0, N - n, n), bias.narrow(0, N - n, n))));
  }

  // bmm: per (batch x head) products, the shape attention's matmuls have.
  const int64_t G = 16, S = 64, D = 32;
  const at::Tensor P = at::randn({G, S, D}).to(opt), Q = at::randn({G, D, S}).to(opt);
  const at::Tensor R = at::bmm(P, Q);
  for (int64_t g : {1, 4, 8})
    rows.push_back(compare("bmm", "batch entries", dims({g, S, D}) + " of " + dims({G, S, D}),
                           R.narrow(0, G - g, g),
                           at::bmm(P.narrow(0, G - g, g), Q.narrow(0, G - g, g))));

  // Scaled-dot-product attention (B, H, S, D), causal.
  const int64_t Bt = 2, H = 8;
  const at::Tensor q = at::randn({Bt, H, S, D}).to(opt), k = at::randn({Bt, H, S, D}).to(opt),
                   v = at::randn({Bt, H, S, D}).to(opt);
  const at::Tensor O = at::scaled_dot_product_attention(q, k, v, std::nullopt, 0.0, true);
  for (int64_t h : {1, 2, 4}) {
    auto heads = [&](const at::Tensor& t) { return t.narrow(1, H - h, h).contiguous(); };
    rows.push_back(compare(
        "sdpa", "heads", dims({Bt, h, S, D}) + " of " + dims({Bt, H, S, D}), O.narrow(1, H - h, h),
        at::scaled_dot_product_attention(heads(q), heads(k), heads(v), std::nullopt, 0.0, true)));
  }
  rows.push_back(compare(
      "sdpa", "batch entries", dims({1, H, S, D}) + " of " + dims({Bt, H, S, D}), O.narrow(0, 1, 1),
      at::scaled_dot_product_attention(q.narrow(0, 1, 1), k.narrow(0, 1, 1), v.narrow(0, 1, 1),
                                       std::nullopt, 0.0, true)));
  for (int64_t t : {S - 1, S / 2}) {
    // Decode: query t alone attends to keys 0..t, as generation with a KV cache runs it.
    const at::Tensor one = at::scaled_dot_product_attention(
        q.narrow(2, t, 1), k.narrow(2, 0, t + 1), v.narrow(2, 0, t + 1), std::nullopt, 0.0, false);
    rows.push_back(compare("sdpa", "decode row vs prefill",
                           "query " + std::to_string(t) + " of " + std::to_string(S),
                           O.narrow(2, t, 1), one));
  }
  // A prefill of the first half, then the rest (chunked prefill).
  rows.push_back(
      compare("sdpa", "prefill prefix", dims({Bt, H, S / 2, D}) + " of " + dims({Bt, H, S, D}),
              O.narrow(2, 0, S / 2),
              at::scaled_dot_product_attention(q.narrow(2, 0, S / 2), k.narrow(2, 0, S / 2),
                                               v.narrow(2, 0, S / 2), std::nullopt, 0.0, true)));

  // Row-wise reductions over the last dim.
  const at::Tensor Z = at::randn({M, N}).to(opt);
  for (int64_t m : {1, 17}) {
    const std::string shape = dims({m, N}) + " of " + dims({M, N});
    rows.push_back(compare("softmax", "rows", shape, at::softmax(Z, -1).narrow(0, 0, m),
                           at::softmax(Z.narrow(0, 0, m), -1)));
    rows.push_back(compare("rms_norm", "rows", shape,
                           at::rms_norm(Z, {N}, std::nullopt, 1e-5).narrow(0, 0, m),
                           at::rms_norm(Z.narrow(0, 0, m), {N}, std::nullopt, 1e-5)));
    rows.push_back(
        compare("sum(-1)", "rows", shape, Z.sum(-1).narrow(0, 0, m), Z.narrow(0, 0, m).sum(-1)));
  }
  return rows;
}

bool all_equal(const std::vector<Row>& rows, const std::string& kernel, const std::string& varies) {
  bool any = false;
  for (const Row& r : rows) {
    if (r.kernel != kernel || r.varies != varies) continue;
    any = true;
    if (!r.equal) return false;
  }
  return any;
}

}  // namespace

int main(int argc, char** argv) {
  int threads = 1;
  std::string dtype_name = "float32";
  CLI::App app("", "bench_kernel_invariance");
  app.add_option("--threads", threads)->check(CLI::PositiveNumber);
  app.add_option("--dtype", dtype_name)->check(CLI::IsMember({"float32", "bfloat16"}));
  if (auto code = dtensor::cli::parse(app, argc, argv, kUsage)) return *code;
  at::set_num_threads(threads);
  const at::ScalarType dtype = dtype_name == "bfloat16" ? at::kBFloat16 : at::kFloat;
  const std::vector<Row> rows = run(dtype);

  std::printf("LibTorch %d.%d.%d, %s, %d intra-op thread(s)\n\n", TORCH_VERSION_MAJOR,
              TORCH_VERSION_MINOR, TORCH_VERSION_PATCH, dtype_name.c_str(), threads);
  std::printf("%-9s %-23s %-26s %-8s %s\n", "kernel", "what varies", "part of whole", "bits",
              "max |diff| / max |whole|");
  int invariant = 0, cases = 0;
  for (const Row& r : rows) {
    char diff[32] = "0";
    if (!r.equal) std::snprintf(diff, sizeof diff, "%.2e", r.max_diff);
    std::printf("%-9s %-23s %-26s %-8s %s%s\n", r.kernel.c_str(), r.varies.c_str(),
                r.shapes.c_str(), r.equal ? "equal" : "DIFFER", diff,
                r.control ? "   (not counted)" : "");
    if (r.control) continue;
    ++cases;
    invariant += r.equal ? 1 : 0;
  }
  const bool mm_rows = all_equal(rows, "mm", "rows of A");
  const bool mm_columns = all_equal(rows, "mm", "columns of B");
  const bool sdpa_heads = all_equal(rows, "sdpa", "heads");
  const bool sdpa_decode = all_equal(rows, "sdpa", "decode row vs prefill");
  std::printf(
      "\nRESULT invariant=%d cases=%d mm_rows=%d mm_columns=%d sdpa_heads=%d sdpa_decode=%d\n",
      invariant, cases, mm_rows, mm_columns, sdpa_heads, sdpa_decode);
  return 0;
}
