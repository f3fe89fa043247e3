// Strategy selection by redistribution cost (docs/ARCHITECTURE.md, "Strategy choice") and OpCall
// helpers.
#include <c10/util/Exception.h>

#include <cmath>
#include <limits>
#include <sstream>

#include "dtensor/dispatch/op_call.h"

namespace dtensor::dispatch {
namespace {

// Intra-host link model from PyTorch's cost model: µs.
constexpr double kBandwidthGBs = 87.7;
constexpr double kHopLatencyUs = 0.6;
constexpr double kBaseLatencyUs = 6.6;

double allgather_cost(double gb, int64_t n) {
  return kBaseLatencyUs + (n - 1) * kHopLatencyUs + gb * (n - 1) / n / kBandwidthGBs * 1e6;
}
double allreduce_cost(double gb, int64_t n) {
  return kBaseLatencyUs + 2 * (n - 1) * kHopLatencyUs + gb * 2 * (n - 1) / n / kBandwidthGBs * 1e6;
}
double reduce_scatter_cost(double gb, int64_t n) { return allgather_cost(gb, n); }

bool same(c10::ArrayRef<Placement> a, c10::ArrayRef<Placement> b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin());
}

}  // namespace

double redistribute_cost(const DTensorSpec& src, c10::ArrayRef<Placement> dst) {
  if (same(src.placements(), dst)) return 0.0;
  if (src.is_replicated()) return 0.0;  // replicas can take any layout locally
  int64_t numel = 1;
  for (auto s : src.shape()) numel *= s;
  double gb = static_cast<double>(numel) * c10::elementSize(src.dtype()) / src.num_shards() /
              (1024.0 * 1024.0 * 1024.0);
  double cost = 0.0;
  for (size_t i = 0; i < dst.size(); ++i) {
    const Placement& cur = src.placements()[i];
    const Placement& tgt = dst[i];
    if (cur == tgt) continue;
    const int64_t n = src.mesh().size(static_cast<int64_t>(i));
    if (cur.is_shard() && tgt.is_replicate()) {
      gb *= n;
      cost += allgather_cost(gb, n);
    } else if (cur.is_shard() && tgt.is_shard()) {
      cost += allgather_cost(gb, n) + 1.0;
    } else if (cur.is_partial() && tgt.is_replicate()) {
      cost += allreduce_cost(gb, n);
    } else if (cur.is_partial() && tgt.is_shard()) {
      cost += reduce_scatter_cost(gb, n);
      gb /= n;
    } else if (cur.is_shard() && tgt.is_partial()) {
      return std::numeric_limits<double>::infinity();
    }
  }
  return cost;
}

Decision choose(const OpCall& call, const std::vector<Strategy>& candidates) {
  TORCH_CHECK(!candidates.empty(), call.name(), ": no sharding strategy fits inputs ",
              call.placements_str());
  size_t best = 0;
  double best_cost = std::numeric_limits<double>::infinity();
  std::vector<double> costs;
  for (size_t c = 0; c < candidates.size(); ++c) {
    double cost = 0;
    for (size_t i = 0; i < call.num_inputs(); ++i) {
      if (!call.inputs()[i].spec || candidates[c].inputs[i].empty()) continue;
      cost += redistribute_cost(call.input(i), candidates[c].inputs[i]);
    }
    costs.push_back(cost);
    if (cost < best_cost) {
      best_cost = cost;
      best = c;
    }
  }
  TORCH_CHECK(std::isfinite(best_cost), call.name(),
              ": every sharding strategy needs an "
              "impossible redistribution of inputs ",
              call.placements_str());
  // Among zero-cost candidates prefer one that needs no redistribution at all.
  if (best_cost == 0.0) {
    for (size_t c = 0; c < candidates.size(); ++c) {
      if (costs[c] != 0.0) continue;
      bool none = true;
      for (size_t i = 0; i < call.num_inputs() && none; ++i) {
        if (!call.inputs()[i].spec || candidates[c].inputs[i].empty()) continue;
        none = same(call.input(i).placements(), candidates[c].inputs[i]);
      }
      if (none) {
        best = c;
        break;
      }
    }
  }
  const Strategy& s = candidates[best];
  Decision d;
  d.inputs = s.inputs;
  size_t k = 0;
  for (int64_t r = 0; r < call.num_returns(); ++r) {
    const auto& t = call.schema().returns()[r].type();
    const bool tensorish =
        t->kind() == c10::TypeKind::TensorType || t->kind() == c10::TypeKind::ListType;
    if (tensorish && k < s.outputs.size()) {
      d.outputs.push_back(s.outputs[k++]);
    } else {
      d.outputs.push_back(std::nullopt);
    }
  }
  return d;
}

std::string OpCall::name() const {
  const auto& n = op_.operator_name();
  return n.overload_name.empty() ? n.name : n.name + "." + n.overload_name;
}

int64_t OpCall::int_arg(size_t i, int64_t dflt) const {
  if (i >= args_.size() || args_[i].isNone()) return dflt;
  return args_[i].toInt();
}

bool OpCall::bool_arg(size_t i, bool dflt) const {
  if (i >= args_.size() || args_[i].isNone()) return dflt;
  return args_[i].toBool();
}

std::vector<int64_t> OpCall::int_list_arg(size_t i) const {
  if (i >= args_.size() || args_[i].isNone()) return {};
  return args_[i].toIntVector();
}

std::optional<std::vector<int64_t>> OpCall::opt_int_list_arg(size_t i) const {
  if (i >= args_.size() || args_[i].isNone()) return std::nullopt;
  return args_[i].toIntVector();
}

std::string OpCall::placements_str() const {
  std::ostringstream os;
  for (size_t i = 0; i < inputs_.size(); ++i) {
    if (i) os << ", ";
    if (!inputs_[i].spec) {
      os << "None";
      continue;
    }
    os << to_string(inputs_[i].spec->placements()) << c10::IntArrayRef(inputs_[i].spec->shape());
  }
  return os.str();
}

}  // namespace dtensor::dispatch
