// The fingerprint of every collective and point-to-point message this rank issues (op, shape,
// dtype, module), numbered per group, and with DTENSOR_CHECK_COLLECTIVES=1 compared with every
// member's before it is issued.
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <functional>
#include <map>
#include <thread>

#include "diagnosis.h"
#include "dtensor/comm/comm_debug_mode.h"
#include "dtensor/comm/failure.h"
#include "health.h"
#include "health_state.h"

namespace dtensor::comm::detail {
namespace {

constexpr size_t kHistory = 64;  // fingerprints kept per group

std::string dtype_name(const at::Tensor& t) {
  return std::string(c10::getDtypeNames(t.scalar_type()).first);
}

}  // namespace

std::string signature(const at::Tensor& t) {
  std::string s = dtype_name(t) + "[";
  for (int64_t d = 0; d < t.dim(); ++d) s += (d ? "," : "") + std::to_string(t.size(d));
  return s + "]";
}

namespace {

// DTENSOR_CHECK_COLLECTIVES: every member of the group (or channel) `name` publishes its
// fingerprint `f` of the collective it is about to issue and compares it with the others';
// throws, naming the first difference or the silent members, when they do not all agree.
void check_with_members(c10d::Store& store, const std::string& name,
                        const std::vector<int>& members, const std::string& label,
                        std::chrono::milliseconds timeout, const Fingerprint& f,
                        const std::string& where) {
  auto& h = health();
  const std::string base = h.prefix + "check/" + name + "/" + std::to_string(f.seq) + "/";
  store.set(base + std::to_string(h.rank), f.op + "\t" + f.sig + "\t" + f.module);
  const auto deadline = Clock::now() + timeout;
  std::map<int, History> others;
  std::vector<int> silent;
  bool differ = false;
  for (int r : members) {
    if (r == h.rank) continue;
    const std::string key = base + std::to_string(r);
    while (!store.check({key}) && Clock::now() < deadline && !h.peer_failed.load()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    throw_if_peer_failed(where);
    if (!store.check({key})) {
      silent.push_back(r);
      continue;
    }
    auto p = split(to_string(store.get(key)), '\t', 3);
    Fingerprint theirs{f.seq, p[0], p.size() > 1 ? p[1] : "", p.size() > 2 ? p[2] : ""};
    differ = differ || key_of(theirs) != key_of(f);
    History one;
    one.seq = f.seq;
    one.ring.push_back(theirs);
    others[r] = std::move(one);
  }
  if (!differ && silent.empty()) return;
  History mine;
  mine.seq = f.seq;
  mine.ring.push_back(f);
  const std::string why = compare_histories(label, h.rank, mine, others, silent, timeout);
  const std::string msg = "dtensor: rank " + std::to_string(h.rank) +
                          ": DTENSOR_CHECK_COLLECTIVES found a mismatch before issuing " + show(f) +
                          " as collective #" + std::to_string(f.seq) + " on group " + label + ": " +
                          why + "Every rank must issue the same collectives in the same order.";
  report_failure(msg);
  TORCH_CHECK(false, msg);
}

// begin_collective on the group or p2p channel `name` over `members` (global ranks). `shown`:
// what a message says this rank was about to do (`seq` filled in), by default
// "<op> <signature> (collective #<seq> on group <name>)".
int64_t begin_on(const std::string& name, const std::vector<int>& group_members,
                 const std::string& group_label, std::chrono::milliseconds timeout, const char* op,
                 const at::Tensor& t,
                 const std::function<std::string(int64_t seq)>& shown = nullptr) {
  auto& h = health();
  Fingerprint f{0, op, signature(t), ModuleScope::current()};
  c10::intrusive_ptr<c10d::Store> store;
  std::vector<int> members;
  std::string label;
  {
    std::lock_guard<std::mutex> g(h.mu);
    auto [it, fresh] = h.groups.try_emplace(name);
    auto& gs = it->second;
    if (fresh) {
      gs.members = group_members;
      gs.label = group_label;
    }
    f.seq = ++gs.history.seq;
    gs.history.ring.push_back(f);
    if (gs.history.ring.size() > kHistory) gs.history.ring.pop_front();
    if (h.check) {
      store = h.store;
      members = gs.members;
      label = gs.label;
    }
  }
  const std::string where = shown ? shown(f.seq)
                                  : std::string(op) + " " + f.sig + " (collective #" +
                                        std::to_string(f.seq) + " on group " + name + ")";
  throw_if_peer_failed(where);
  if (store) check_with_members(*store, name, members, label, timeout, f, where);
  return f.seq;
}

std::string group_label(ProcessGroup& pg) {
  std::string label = pg.name();
  if (pg.mesh_dim() >= 0) label += " (mesh dim " + std::to_string(pg.mesh_dim()) + ")";
  return label;
}

}  // namespace

int64_t begin_collective(ProcessGroup& pg, const char* op, const at::Tensor& t) {
  return begin_on(pg.name(), pg.global_ranks(), group_label(pg), pg.timeout(), op, t);
}

std::string p2p_channel(ProcessGroup& pg, int src, int dst) {
  return pg.name() + ":" + std::to_string(src) + "->" + std::to_string(dst);
}

int64_t begin_p2p(ProcessGroup& pg, int src, int dst, const at::Tensor& t) {
  const std::string channel = p2p_channel(pg, src, dst);
  // One fingerprint for both ends ("p2p float64[2,8,32]"), so a send and its receive compare
  // equal and a shape mismatch shows in the diagnosis.
  // A message says which end this rank is: "recv float64[2,8,32] from global rank 4 (message
  // #3 on channel group0[0,4]:1->0)".
  const bool sending = pg.rank() == src;
  const std::string shown = std::string(sending ? "send " : "recv ") + signature(t) +
                            (sending ? " to" : " from") + " global rank " +
                            std::to_string(pg.global_rank(sending ? dst : src));
  return begin_on(
      channel, {pg.global_rank(src), pg.global_rank(dst)},
      channel + " (of " + group_label(pg) + ")", pg.timeout(), "p2p", t, [&](int64_t seq) {
        return shown + " (message #" + std::to_string(seq) + " on channel " + channel + ")";
      });
}

void attach(const c10d::Work* work, ProcessGroup& pg, int64_t seq, const std::string& group,
            bool blocks) {
  auto& h = health();
  std::lock_guard<std::mutex> g(h.mu);
  h.works[work] = WorkContext{group, seq, pg.timeout(), blocks};
}

}  // namespace dtensor::comm::detail
