#include "support/opinfo_sweep.h"

#include <fcntl.h>
#include <sys/wait.h>
#include <torch/csrc/autograd/autograd.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <fstream>
#include <set>
#include <sstream>
#include <thread>

#include "dtensor/dtensor.h"
#include "support/rank_outcomes.h"
#include "support/temp_dir.h"

namespace dtensor::testing::opinfo {
namespace {

// float32 results computed in another order (a sum over shards) differ in the last bits.
constexpr double kRtol = 1e-4;
constexpr double kAtol = 1e-5;

Placements layout_for(const at::Tensor& t, size_t layout) {
  if (layout == 1 || t.dim() == 0) return {Replicate()};
  return {Shard(layout == 0 ? 0 : t.dim() - 1)};
}

std::string one_line(std::string s) {
  for (char& c : s) c = (c == '\n' || c == '\r' || c == '\t') ? ' ' : c;
  return s.size() > 400 ? s.substr(0, 400) + "..." : s;
}

// Whether the error is a collective that timed out: the ranks took different paths.
bool is_timeout(const std::string& msg) {
  return msg.find("timed out") != std::string::npos || msg.find("Timed out") != std::string::npos ||
         msg.find("timeout") != std::string::npos;
}

// "" when `got` (a DTensor result or a plain one) equals `want`, else why not.
std::string differs(const c10::IValue& got, const c10::IValue& want) {
  if (want.isTensor()) {
    if (!got.isTensor()) return "a " + got.tagKind() + " where a tensor was expected";
    const at::Tensor& w = want.toTensor();
    at::Tensor g = got.toTensor();
    if (!g.defined() || !w.defined()) {
      return g.defined() == w.defined() ? "" : "an undefined tensor on one side";
    }
    if (is_dtensor(g)) g = full_tensor(g);
    if (g.sizes() != w.sizes()) {
      return c10::str("shape ", g.sizes(), ", expected ", w.sizes());
    }
    if (g.scalar_type() != w.scalar_type()) {
      return c10::str("dtype ", g.scalar_type(), ", expected ", w.scalar_type());
    }
    if (w.numel() == 0) return "";
    at::Tensor a = g.detach(), b = w.detach();
    if (a.is_complex()) {
      a = at::view_as_real(a.resolve_conj());
      b = at::view_as_real(b.resolve_conj());
    }
    if (a.is_floating_point()) {
      a = a.to(at::kDouble);
      b = b.to(at::kDouble);
      if (at::allclose(a, b, kRtol, kAtol, /*equal_nan=*/true)) return "";
      const at::Tensor diff = (a - b).abs().nan_to_num(std::numeric_limits<double>::infinity());
      return c10::str("values differ: max abs diff ", diff.max().item<double>());
    }
    if (at::equal(a, b)) return "";
    return "values differ";
  }
  if (want.isTensorList()) {
    if (!got.isTensorList()) return "a " + got.tagKind() + " where a tensor list was expected";
    const auto g = got.toTensorList();
    const auto w = want.toTensorList();
    if (g.size() != w.size()) return c10::str(g.size(), " tensors, expected ", w.size());
    for (size_t i = 0; i < w.size(); ++i) {
      std::string d = differs(g.get(i), w.get(i));
      if (!d.empty()) return c10::str("tensor ", i, ": ", d);
    }
    return "";
  }
  if (want.isDouble() || got.isDouble()) {
    const double a = got.toScalar().toDouble(), b = want.toScalar().toDouble();
    if ((std::isnan(a) && std::isnan(b)) || std::abs(a - b) <= kAtol + kRtol * std::abs(b)) {
      return "";
    }
    return c10::str(a, ", expected ", b);
  }
  if (want.isInt() || want.isBool()) {
    if (got.isInt() || got.isBool()) {
      return got.toScalar().toLong() == want.toScalar().toLong() ? "" : c10::str(got, " vs ", want);
    }
  }
  return got.tagKind() == want.tagKind() ? "" : c10::str(got.tagKind(), " vs ", want.tagKind());
}

// The negative control: change the first element of the first DTensor result's local shard.
bool alter_first_result(const Replay& r) {
  at::NoGradGuard no_grad;
  for (const auto& v : r.results) {
    if (!v.isTensor() || !is_dtensor(v.toTensor())) continue;
    at::Tensor local = local_tensor(v.toTensor());
    if (local.numel() == 0) return false;
    at::Tensor e = local;  // the first element, as a view into the shard's storage
    while (e.dim() > 0) e = e.select(0, 0);
    if (e.scalar_type() == at::kBool) {
      e.logical_not_();
    } else if (e.is_floating_point() || e.is_complex()) {
      // x + 1000, or 0 for a NaN or an infinity (which an addition would leave alone).
      const bool finite = at::isfinite(e).all().item<bool>();
      finite ? e.add_(1000) : e.zero_();
    } else {
      e.add_(1);
    }
    return true;
  }
  return false;
}

// The real floating results that require grad: the loss is sum_k <result_k, w_k>.
std::vector<size_t> grad_result_indices(const Sample& s, const Replay& plain) {
  std::vector<size_t> out;
  for (int k : s.grad_results) {
    const c10::IValue& v = plain.results.at(k);
    if (v.isTensor() && v.toTensor().requires_grad() && v.toTensor().is_floating_point()) {
      out.push_back(static_cast<size_t>(k));
    }
  }
  return out;
}

at::Tensor weight_for(const at::Tensor& result, size_t k) {
  at::Generator gen = at::detail::createCPUGenerator(1234 + k);
  return at::randn(result.sizes(), gen, result.options().requires_grad(false));
}

at::Tensor loss_of(const Replay& r, const std::vector<size_t>& ks) {
  at::Tensor loss;
  for (size_t k : ks) {
    const at::Tensor res = r.results[k].toTensor();
    at::Tensor w = weight_for(res, k);
    if (is_dtensor(res)) {
      w = distribute_tensor(w, device_mesh(res), replicate_all(device_mesh(res).ndim()),
                            std::nullopt);
    }
    at::Tensor term = (res * w).sum();
    loss = loss.defined() ? loss + term : term;
  }
  return loss;
}

std::string error_text(const std::exception& e) {
  if (const auto* c = dynamic_cast<const c10::Error*>(&e)) return c->what_without_backtrace();
  return e.what();
}

CaseResult run_case(const SampleSet& set, const Sample& s, const DeviceMesh& mesh, size_t layout,
                    const SweepOptions& o) {
  CaseResult res;
  std::map<std::string, at::Tensor> plain_in, dist_in, plain_const, dist_const;
  std::vector<std::string> grad_inputs;
  for (const auto& in : s.inputs) {
    const at::Tensor& t = set.tensors.at(in.name);
    const bool rg = in.requires_grad && t.is_floating_point();
    if (rg) grad_inputs.push_back(in.name);
    plain_in[in.name] = t.clone().requires_grad_(rg);
  }
  for (const auto& c : s.constants) {
    plain_const[c] = set.tensors.at(c).clone();
    dist_const[c] = set.tensors.at(c).clone();
  }
  Replay plain;
  try {
    plain = replay(s, plain_in, plain_const);
  } catch (const std::exception& e) {
    res.forward = Outcome::Skipped;
    res.message = "fails on plain tensors: " + one_line(error_text(e));
    return res;
  }
  Replay dist;
  try {
    for (const auto& in : s.inputs) {
      const at::Tensor& t = set.tensors.at(in.name);
      at::Tensor d = distribute_tensor(t.clone(), mesh, layout_for(t, layout), std::nullopt);
      dist_in[in.name] = d.requires_grad_(plain_in[in.name].requires_grad());
    }
    dist = replay(s, dist_in, dist_const);
    if (o.negative_control) res.altered = alter_first_result(dist);
    at::NoGradGuard no_grad;
    for (size_t k = 0; k < plain.results.size(); ++k) {
      const std::string d = differs(dist.results[k], plain.results[k]);
      if (!d.empty()) {
        res.forward = Outcome::Wrong;
        res.message = c10::str("result ", k, ": ", d);
        return res;
      }
    }
  } catch (const std::exception& e) {
    const std::string msg = one_line(error_text(e));
    res.forward = is_timeout(msg) ? Outcome::Hang : Outcome::Refused;
    res.message = msg;
    return res;
  }
  res.forward = Outcome::Pass;
  // Backward: the gradient of sum_k <result_k, w_k> for every input that requires grad.
  const std::vector<size_t> ks = grad_result_indices(s, plain);
  if (ks.empty() || grad_inputs.empty()) return res;
  std::vector<at::Tensor> plain_leaves, dist_leaves;
  for (const auto& n : grad_inputs) {
    plain_leaves.push_back(plain_in[n]);
    dist_leaves.push_back(dist_in[n]);
  }
  std::vector<at::Tensor> want;
  try {
    want = torch::autograd::grad({loss_of(plain, ks)}, plain_leaves, {}, false, false, true);
  } catch (const std::exception& e) {
    res.message = "no backward on plain tensors: " + one_line(error_text(e));
    return res;  // no derivative (or not for these arguments): nothing to compare
  }
  try {
    const auto got =
        torch::autograd::grad({loss_of(dist, ks)}, dist_leaves, {}, false, false, true);
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < want.size(); ++i) {
      std::string d;
      if (got[i].defined() && !is_dtensor(got[i])) {
        d = "a plain tensor";
      } else if (got[i].defined() && !(device_mesh(got[i]) == mesh)) {
        d = "a DTensor on another mesh";
      } else if (got[i].defined() && got[i].sizes() != dist_leaves[i].sizes()) {
        d = c10::str("global shape ", got[i].sizes(), " for an input of ", dist_leaves[i].sizes());
      } else {
        d = differs(got[i], want[i]);
      }
      if (!d.empty()) {
        res.backward = Outcome::Wrong;
        res.message = c10::str("gradient of ", grad_inputs[i], ": ", d);
        return res;
      }
    }
    res.backward = Outcome::Pass;
  } catch (const std::exception& e) {
    const std::string msg = one_line(error_text(e));
    res.backward = is_timeout(msg) ? Outcome::Hang : Outcome::Refused;
    res.message = "backward: " + msg;
  }
  return res;
}

void write_line(int fd, const std::string& line) {
  const std::string s = line + "\n";
  size_t off = 0;
  while (off < s.size()) {
    const ssize_t n = ::write(fd, s.data() + off, s.size() - off);
    if (n <= 0) return;
    off += static_cast<size_t>(n);
  }
}

// What one rank's progress file says: per case, whether it began and how it ended.
struct RankProgress {
  std::map<size_t, CaseResult> ended;
  std::set<size_t> begun;
  std::set<size_t> hung;          // its watchdog fired in the case
  std::set<size_t> group_failed;  // the check after the case failed
};

RankProgress read_progress(const std::string& path) {
  RankProgress p;
  std::ifstream f(path);
  std::string line;
  while (std::getline(f, line)) {
    std::istringstream in(line);
    char kind = 0;
    size_t c = 0;
    in >> kind >> c;
    if (kind == 'B') p.begun.insert(c);
    if (kind == 'H') p.hung.insert(c);
    if (kind == 'X') p.group_failed.insert(c);
    if (kind == 'E') {
      int fwd = 0, bwd = 0, altered = 0;
      in >> fwd >> bwd >> altered;
      CaseResult r{static_cast<Outcome>(fwd), static_cast<Outcome>(bwd), altered != 0, ""};
      std::getline(in, r.message);
      if (!r.message.empty() && r.message[0] == ' ') r.message.erase(0, 1);
      p.ended[c] = r;
    }
  }
  return p;
}

void merge(CaseResult& into, const CaseResult& r) {
  if (r.forward > into.forward || r.backward > into.backward) {
    if (!r.message.empty()) into.message = r.message;
  } else if (into.message.empty()) {
    into.message = r.message;
  }
  into.forward = std::max(into.forward, r.forward);
  into.backward = std::max(into.backward, r.backward);
  into.altered = into.altered || r.altered;
}

}  // namespace

const char* outcome_name(Outcome o) {
  switch (o) {
    case Outcome::NotRun:
      return "-";
    case Outcome::Skipped:
      return "skip";
    case Outcome::Pass:
      return "PASS";
    case Outcome::Refused:
      return "REFUSED";
    case Outcome::Wrong:
      return "WRONG";
    case Outcome::Hang:
      return "HANG";
    case Outcome::Crash:
      return "CRASH";
  }
  return "?";
}

std::vector<CaseResult> sweep(const SampleSet& set, const std::vector<size_t>& samples, int world,
                              const SweepOptions& o) {
  const size_t layouts = layout_names().size();
  const size_t n = samples.size() * layouts;
  std::vector<CaseResult> out(n);
  TempDir dir;
  size_t start = 0;
  int attempt = 0;
  while (start < n) {
    const std::string prefix = dir.file("world" + std::to_string(attempt++) + ".rank");
    RunOptions ro;
    ro.comm_timeout = std::chrono::seconds(20);
    ro.timeout = std::chrono::seconds(
        static_cast<int64_t>(60 + (n - start) * (o.case_timeout_s + ro.comm_timeout.count())));
    const auto outcomes = run_ranks_collect(
        world,
        [&](int rank) {
          const int fd =
              ::open((prefix + std::to_string(rank)).c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
          auto mesh = init_device_mesh("cpu", {world});
          // A case past its time is a hang: say so and leave (the parent restarts the world).
          std::atomic<size_t> current{0};
          std::atomic<int64_t> deadline_ms{std::numeric_limits<int64_t>::max()};
          std::atomic<bool> stop{false};
          auto now_ms = [] {
            return std::chrono::duration_cast<std::chrono::milliseconds>(
                       std::chrono::steady_clock::now().time_since_epoch())
                .count();
          };
          std::thread watchdog([&] {
            while (!stop) {
              std::this_thread::sleep_for(std::chrono::milliseconds(100));
              if (now_ms() > deadline_ms) {
                write_line(fd, "H " + std::to_string(current.load()));
                ::_exit(124);
              }
            }
          });
          for (size_t c = start; c < n; ++c) {
            current = c;
            write_line(fd, "B " + std::to_string(c));
            deadline_ms = now_ms() + static_cast<int64_t>(o.case_timeout_s * 1000);
            const Sample& s = set.samples[samples[c / layouts]];
            const CaseResult r = run_case(set, s, mesh, c % layouts, o);
            write_line(
                fd, c10::str("E ", c, " ", static_cast<int>(r.forward), " ",
                             static_cast<int>(r.backward), " ", r.altered ? 1 : 0, " ", r.message));
            // Every rank reaches the next case together, on a group that still works: a
            // case that left it broken (a collective failed on some rank, which then starts
            // none, or ranks on different paths) ends this world here.
            try {
              comm::all_reduce(at::ones({1}), ReduceOp::Max, mesh.group(0));
            } catch (const std::exception&) {
              write_line(fd, "X " + std::to_string(c));
              ::_exit(3);
            }
          }
          stop = true;
          watchdog.join();
          ::close(fd);
        },
        ro);
    std::vector<RankProgress> progress;
    for (int r = 0; r < world; ++r) progress.push_back(read_progress(prefix + std::to_string(r)));
    // After a case that left the group broken on some rank, the world's later cases are not
    // trusted (a rank may have gone on with collectives paired wrongly): they run again.
    size_t limit = n;
    for (const auto& p : progress) {
      if (!p.group_failed.empty()) limit = std::min(limit, *p.group_failed.begin() + 1);
    }
    size_t c = start;
    for (; c < limit; ++c) {
      bool all = true;
      for (const auto& p : progress) all = all && p.ended.count(c) > 0;
      if (!all) break;
      for (const auto& p : progress) merge(out[c], p.ended.at(c));
      if (c + 1 == limit && limit < n) {
        out[c].message += " [the process group failed after this case; ranks restarted]";
      }
    }
    if (c == n) break;
    if (c == limit) {
      start = c;
      continue;
    }
    bool begun = false;
    for (const auto& p : progress) begun = begun || p.begun.count(c) > 0;
    TORCH_CHECK(begun, "opinfo sweep: a world of ", world, " ranks ended before case ", c, ":\n",
                describe_outcomes(outcomes));
    // Case c did not end on every rank: a hang (a watchdog, or the run's timeout) or a crash.
    CaseResult r;
    for (const auto& p : progress) {
      if (p.ended.count(c)) merge(r, p.ended.at(c));
    }
    bool hung = false, crashed = false;
    std::string how;
    for (int k = 0; k < world; ++k) {
      const auto& oc = outcomes[k];
      if (progress[k].hung.count(c) || oc.hung) hung = true;
      if (WIFSIGNALED(oc.status)) {
        crashed = true;
        how += c10::str(" rank ", k, " signal ", WTERMSIG(oc.status), ";");
      } else if (!progress[k].ended.count(c) && !progress[k].hung.count(c)) {
        crashed = true;
        how +=
            c10::str(" rank ", k, " exit ", WEXITSTATUS(oc.status), " ", one_line(oc.message), ";");
      }
    }
    r.forward = crashed ? Outcome::Crash : (hung ? Outcome::Hang : Outcome::Crash);
    r.message = (crashed ? "ranks ended:" + how : "no end within the case's time") +
                (r.message.empty() ? "" : " (" + r.message + ")");
    out[c] = r;
    start = c + 1;
  }
  return out;
}

std::map<std::string, std::string> load_pytorch_fails(const std::string& path) {
  std::map<std::string, std::string> out;
  std::ifstream f(path);
  TORCH_CHECK(f, "opinfo sweep: cannot open ", path);
  std::string line;
  while (std::getline(f, line)) {
    if (line.empty() || line[0] == '#') continue;
    std::istringstream in(line);
    std::string kind, key;
    in >> kind >> key;
    out[key] = kind;
  }
  return out;
}

Outcome OpSummary::worst_forward() const {
  Outcome w = Outcome::NotRun;
  for (Outcome o : forward) w = std::max(w, o);
  return w;
}

Outcome OpSummary::worst_backward() const {
  Outcome w = Outcome::NotRun;
  for (Outcome o : backward) w = std::max(w, o);
  return w;
}

std::string OpSummary::message() const {
  if (forward_message.empty() || backward_message.empty())
    return forward_message + backward_message;
  return forward_message + "; " + backward_message;
}

std::vector<OpSummary> summarize(const SampleSet& set, const std::vector<size_t>& samples,
                                 const std::vector<std::vector<CaseResult>>& per_world,
                                 const std::vector<int>& worlds) {
  const size_t layouts = layout_names().size();
  const size_t settings = per_world.size() * layouts;
  std::vector<OpSummary> ops;
  std::map<std::string, size_t> index;
  // The outcome whose message an op shows, forward and backward apart.
  std::map<std::string, std::pair<Outcome, Outcome>> shown;
  // A sample that fails on plain tensors says least about us: any other failure's message wins.
  auto rank = [](Outcome o) { return o == Outcome::Skipped ? 0 : static_cast<int>(o); };
  for (size_t i = 0; i < samples.size(); ++i) {
    const Sample& s = set.samples[samples[i]];
    auto [it, fresh] = index.emplace(s.key(), ops.size());
    if (fresh) {
      ops.push_back({s.key(), std::vector<Outcome>(settings, Outcome::NotRun),
                     std::vector<Outcome>(settings, Outcome::NotRun), "", ""});
    }
    OpSummary& op = ops[it->second];
    auto& [fwd_shown, bwd_shown] = shown[s.key()];
    for (size_t w = 0; w < per_world.size(); ++w) {
      for (size_t l = 0; l < layouts; ++l) {
        const CaseResult& r = per_world[w][i * layouts + l];
        const size_t k = w * layouts + l;
        op.forward[k] = std::max(op.forward[k], r.forward);
        op.backward[k] = std::max(op.backward[k], r.backward);
        if (r.message.empty()) continue;
        const std::string where =
            c10::str(worlds.at(w), " ranks, ", layout_names()[l], ", sample ", s.index, ": ");
        // A case's message is its forward's unless the forward passed.
        if (r.forward != Outcome::Pass && r.forward != Outcome::NotRun) {
          if (op.forward_message.empty() || rank(r.forward) > rank(fwd_shown)) {
            op.forward_message = where + r.message;
            fwd_shown = r.forward;
          }
        } else if (r.forward == Outcome::Pass && r.backward > Outcome::Pass) {
          if (op.backward_message.empty() || r.backward > bwd_shown) {
            op.backward_message = where + r.message;
            bwd_shown = r.backward;
          }
        }
      }
    }
  }
  return ops;
}

SideBySide side_by_side(const std::vector<OpSummary>& ops,
                        const std::map<std::string, std::string>& pytorch_fails) {
  SideBySide t;
  for (const auto& op : ops) {
    const auto it = pytorch_fails.find(op.key);
    const bool pytorch_skips = it != pytorch_fails.end() && it->second == "skip";
    const bool pytorch_passes = it == pytorch_fails.end();
    const Outcome f = op.worst_forward();
    const bool ours = f == Outcome::Pass;
    if (f == Outcome::Skipped) continue;  // no sample runs on plain tensors
    if (pytorch_skips) {
      ++t.pytorch_skips;
    } else if (pytorch_passes && ours) {
      ++t.both_pass;
    } else if (pytorch_passes) {
      ++t.pytorch_only;
      t.pytorch_passes_we_refuse.push_back(op.key);
    } else if (ours) {
      ++t.ours_only;
    } else {
      ++t.neither;
    }
    for (Outcome o : op.forward) {
      t.wrong += o == Outcome::Wrong;
      t.crash += o == Outcome::Crash;
      t.hang += o == Outcome::Hang;
    }
    for (Outcome o : op.backward) {
      t.bwd_crash_or_hang += o == Outcome::Crash || o == Outcome::Hang;
    }
    const Outcome b = op.worst_backward();
    t.bwd_pass += b == Outcome::Pass;
    t.bwd_wrong += b == Outcome::Wrong;
    t.bwd_refused += b == Outcome::Refused;
  }
  return t;
}

std::string markdown_table(const SampleSet& set, const std::vector<OpSummary>& ops,
                           const std::map<std::string, std::string>& pytorch_fails,
                           const std::vector<int>& worlds, const std::string& preamble) {
  const SideBySide t = side_by_side(ops, pytorch_fails);
  std::ostringstream md;
  md << preamble;
  md << "| OpInfos | PyTorch passes | PyTorch fails (xfail) | PyTorch skips |\n|---|---|---|---|\n";
  md << "| we pass | " << t.both_pass << " | " << t.ours_only << " | " << t.pytorch_skips
     << " (we pass or not) |\n";
  md << "| we do not | " << t.pytorch_only << " | " << t.neither << " | |\n\n";
  md << "Forward cases WRONG " << t.wrong << ", CRASH " << t.crash << ", HANG " << t.hang
     << ". Backward: " << t.bwd_pass << " OpInfos pass, " << t.bwd_refused << " refused, "
     << t.bwd_wrong << " wrong; backward cases CRASH or HANG " << t.bwd_crash_or_hang << ".\n\n";
  md << "Columns per world size, the layouts ";
  for (const auto& l : layout_names()) md << l << " ";
  md << "(P pass, R refused, W wrong, H hang, C crash, s fails on plain tensors too, - not run);"
        " the note is the worst failing forward case's message, then the worst backward "
        "case's.\n\n";
  md << "| OpInfo | PyTorch | forward";
  for (int w : worlds) md << " " << w << " ranks";
  md << " | backward | note |\n|---|---|---|---|---|\n";
  auto letters = [&](const std::vector<Outcome>& v) {
    std::string s;
    for (size_t k = 0; k < v.size(); ++k) {
      if (k > 0 && k % layout_names().size() == 0) s += " ";
      const char* name = outcome_name(v[k]);
      s += v[k] == Outcome::Skipped ? 's' : name[0];
    }
    return s;
  };
  for (const auto& op : ops) {
    const auto it = pytorch_fails.find(op.key);
    auto shortened = [](std::string m) {
      for (char& c : m) c = c == '|' ? '/' : c;
      return m.size() > 160 ? m.substr(0, 160) + "..." : m;
    };
    std::string note = shortened(op.forward_message);
    if (!op.backward_message.empty()) {
      note += (note.empty() ? "" : "; ") + shortened(op.backward_message);
    }
    md << "| `" << op.key << "` | " << (it == pytorch_fails.end() ? "pass" : it->second) << " | "
       << letters(op.forward) << " | " << letters(op.backward) << " | " << note << " |\n";
  }
  if (!set.left_out.empty()) {
    md << "\nOpInfos without a sample here (" << set.left_out.size() << "):\n\n";
    md << "| OpInfo | why |\n|---|---|\n";
    for (const auto& [k, why] : set.left_out) md << "| `" << k << "` | " << why << " |\n";
  }
  return md.str();
}

}  // namespace dtensor::testing::opinfo
