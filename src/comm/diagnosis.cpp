// Diagnosis of a failed collective (diagnosis.h), and the waits that run it: wait_collective
// and issue_failed (health.h).
#include "diagnosis.h"

#include <ATen/core/ivalue.h>
#include <ATen/core/ivalue_inl.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <optional>
#include <set>
#include <thread>

#include "dtensor/comm/failure.h"
#include "dtensor/util/error_message.h"
#include "health.h"

namespace dtensor::comm::detail {
namespace {

constexpr auto kMaxAnswerWait = std::chrono::milliseconds(1000);

}  // namespace

std::string compare_histories(const std::string& label, int self, const History& mine,
                              const std::map<int, History>& others, const std::vector<int>& silent,
                              std::chrono::milliseconds waited) {
  std::map<int, const History*> all{{self, &mine}};
  for (const auto& [r, h] : others) all[r] = &h;
  int64_t lo = INT64_MAX, hi = 0;
  for (const auto& [r, h] : all) {
    if (!h->ring.empty()) lo = std::min(lo, h->ring.front().seq);
    hi = std::max(hi, h->seq);
  }
  std::ostringstream o;
  for (int64_t s = lo; s <= hi; ++s) {
    std::set<std::string> keys;
    for (const auto& [r, h] : all) {
      if (const auto* f = h->at(s)) keys.insert(key_of(*f));
    }
    if (keys.size() <= 1) continue;
    o << "ranks diverge at collective #" << s << " on group " << label << ":";
    const char* sep = " ";
    for (const auto& [r, h] : all) {
      const auto* f = h->at(s);
      o << sep << "rank " << r << " " << (f ? show(*f) : "(not issued)");
      sep = ", ";
    }
    o << ". ";
    break;
  }
  const Fingerprint* cur = mine.ring.empty() ? nullptr : &mine.ring.back();
  const std::string here = cur ? "#" + std::to_string(cur->seq) + " " + show(*cur) : "none";
  for (const auto& [r, h] : others) {
    if (h.left) {
      o << "rank " << r << " left (destroyed its process group) after " << h.seq
        << " collectives on group " << label << " while rank " << self << " is in " << here << ". ";
    } else if (h.seq < mine.seq) {
      o << "rank " << r << " has issued only " << h.seq << " collectives on group " << label
        << " while rank " << self << " waits in " << here
        << " (it skipped one, or is still busy before it). ";
    } else if (h.seq > mine.seq) {
      o << "rank " << r << " is already at collective #" << h.seq << " on group " << label
        << " while rank " << self << " is in " << here << " (rank " << self << " skipped one?). ";
    }
  }
  for (int r : silent) {
    o << "rank " << r << " did not answer within " << waited.count() / 1000.0
      << " s (stopped, killed, or busy outside collectives). ";
  }
  std::string text = o.str();
  if (text.empty()) {
    text = "all ranks of group " + label + " are in " + here + ". ";
  }
  return text;
}

std::chrono::milliseconds diagnosis_budget(std::chrono::milliseconds timeout) {
  return std::min<std::chrono::milliseconds>(kMaxAnswerWait, std::max(timeout / 3, kPoll * 3));
}

namespace {

// For a failed collective whose store did not answer either (`how`): the store's host is
// unreachable from here, and the peers the collective waited for are beyond it or wait for a
// rank beyond it (a TP peer on this host stuck in an FSDP collective across the dead link);
// without the store this rank cannot tell which. Later reports skip the store.
std::string unreachable(const WorkContext& c, const std::string& how) {
  auto& h = health();
  h.store_lost.store(true);
  std::string peers, label = c.group;
  {
    std::lock_guard<std::mutex> g(h.mu);
    if (auto it = h.groups.find(c.group); it != h.groups.end()) {
      label = it->second.label;
      for (int r : it->second.members) {
        if (r != h.rank) peers += (peers.empty() ? "" : ", ") + std::to_string(r);
      }
    }
  }
  return "rank(s) " + peers + " of group " + label + " stopped answering rank " +
         std::to_string(h.rank) + ", and the store at " + h.store_where +
         " did not answer either " + how + ": the network to the store's host is down, or that " +
         "host stopped; rank(s) " + peers + " are beyond it or wait for a rank beyond it. ";
}

// The histories that `members` of `group` (all but this rank) wrote to the store in answer to
// a "diag" event, each waited for until `deadline`; the others go to `silent`.
void collect_answers(c10d::Store& store, const std::string& group, const std::vector<int>& members,
                     Clock::time_point deadline, std::map<int, History>* answers,
                     std::vector<int>* silent) {
  auto& h = health();
  for (int r : members) {
    if (r == h.rank) continue;
    const std::string key = history_key(h.prefix, group, r);
    bool have = store.check({key});
    while (!have && Clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      have = store.check({key});
    }
    if (have) {
      (*answers)[r] = deserialize(to_string(store.get(key)));
    } else {
      silent->push_back(r);
    }
  }
}

// Names the collective `w` that rank `r` waits in and asks the other members of its group why
// it does not complete (this rank answers for itself), by `deadline` or 0.3 s from now.
std::string follow_wait(c10d::Store& store, int r, const Wait& w, Clock::time_point deadline,
                        std::set<std::string>* asked) {
  auto& h = health();
  History waiter;
  waiter.seq = w.fingerprint.seq;
  waiter.ring.push_back(w.fingerprint);
  std::map<int, History> answers;
  std::vector<int> silent, ask;
  for (int m : w.members) {
    if (m != r && m != h.rank) ask.push_back(m);
  }
  if (std::find(w.members.begin(), w.members.end(), h.rank) != w.members.end()) {
    std::lock_guard<std::mutex> g(h.mu);
    if (auto it = h.groups.find(w.group); it != h.groups.end())
      answers[h.rank] = it->second.history;
  }
  if (!ask.empty() && asked->insert(w.group).second) {
    post_event(store, h.prefix, "diag\t" + std::to_string(h.rank) + "\t" + w.group);
  }
  const auto start = Clock::now();
  collect_answers(store, w.group, ask, std::max(deadline, start + kPoll * 3), &answers, &silent);
  const auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start);
  return "rank " + std::to_string(r) + " is itself waiting in collective #" +
         std::to_string(w.fingerprint.seq) + " " + show(w.fingerprint) + " on group " + w.label +
         ": " + compare_histories(w.label, r, waiter, answers, silent, waited);
}

// A peer behind this rank on the failed group is often itself waiting in a collective on
// another group (a cross-host FSDP group whose link is down, while this rank waits in a TP
// group on its own host): follows it there, so the message points at the rank that is really
// missing.
std::string explain_waits(c10d::Store& store, const std::string& failed_group, int64_t my_seq,
                          const std::map<int, History>& others, Clock::time_point deadline) {
  std::string out;
  std::set<std::string> asked;
  for (const auto& [r, theirs] : others) {
    if (theirs.left || theirs.seq >= my_seq) continue;
    const auto w = std::find_if(theirs.waits.begin(), theirs.waits.end(),
                                [&](const Wait& x) { return x.group != failed_group; });
    if (w != theirs.waits.end()) out += follow_wait(store, r, *w, deadline, &asked);
  }
  return out;
}

// Asks the group's members where they are and names the problem. Called with a failed
// collective, so the group is unusable anyway; bounded by kMaxAnswerWait.
std::string diagnose(const WorkContext& c) {
  auto& h = health();
  c10::intrusive_ptr<c10d::Store> store;
  GroupState group;
  {
    std::lock_guard<std::mutex> g(h.mu);
    store = h.store;
    auto it = h.groups.find(c.group);
    if (!store || it == h.groups.end()) return "";
    group = it->second;
  }
  auto waited = diagnosis_budget(c.timeout);
  std::map<int, History> others;
  std::vector<int> silent;
  std::string failed, behind;
  try {
    // A rank that reported its own failure explains the rest: do not wait for answers.
    failed = peer_failure_in_store(*store, h.prefix, h.rank);
    if (!failed.empty()) waited = std::chrono::milliseconds(0);
    store->set(history_key(h.prefix, c.group, h.rank), serialize(group.history));
    post_event(*store, h.prefix, "diag\t" + std::to_string(h.rank) + "\t" + c.group);
    const auto deadline = Clock::now() + waited;
    collect_answers(*store, c.group, group.members, deadline, &others, &silent);
    if (waited.count() == 0) silent.clear();
    if (failed.empty()) {
      behind = explain_waits(*store, c.group, group.history.seq, others, deadline);
    }
  } catch (const std::exception& e) {
    return failed + unreachable(c, "(" + util::error_message(e) + ")");
  }
  return (failed.empty() ? "" : failed + ". ") +
         compare_histories(group.label, h.rank, group.history, others, silent, waited) + behind;
}

}  // namespace

std::string bounded_diagnosis(const WorkContext& c, const std::string& head,
                              const std::string& tail, std::chrono::milliseconds wait) {
  auto result = std::make_shared<std::pair<std::mutex, std::string>>();
  auto done = std::make_shared<std::atomic<bool>>(false);
  std::thread([c, head, tail, result, done] {
    const std::string full = head + diagnose(c) + tail;
    report_failure(full);
    {
      std::lock_guard<std::mutex> g(result->first);
      result->second = full;
    }
    done->store(true);
  }).detach();
  const auto until = Clock::now() + wait;
  while (!done->load() && Clock::now() < until) std::this_thread::sleep_for(kPoll / 5);
  std::lock_guard<std::mutex> g(result->first);
  if (done->load()) return result->second;
  const std::string msg =
      head + unreachable(c, "within " + c10::str(wait.count() / 1000.0) + " s (no diagnosis)") +
      tail;
  // The report is still on its way: this rank's next collective must fail already.
  {
    std::lock_guard<std::mutex> l(health().mu);
    record_own_failure_locked(health().rank, msg);
  }
  return msg;
}

namespace {

// The context of `w`, which a thread starts waiting for: peers that diagnose their own failure
// ask what this rank waits in (current_waits_locked) until stop_waiting(w).
WorkContext start_waiting(const c10d::Work* w) {
  auto& h = health();
  std::lock_guard<std::mutex> g(h.mu);
  auto it = h.works.find(w);
  if (it == h.works.end()) return {};
  WorkContext c = it->second;
  h.waiting.emplace(w, c);
  h.works.erase(it);
  return c;
}

void stop_waiting(const c10d::Work* w) {
  auto& h = health();
  std::lock_guard<std::mutex> g(h.mu);
  h.waiting.erase(w);
}

}  // namespace

namespace {

std::string peer_failure_text() {
  auto& h = health();
  std::lock_guard<std::mutex> g(h.mu);
  return h.peer_failure;
}

// Waits until `work`'s future completes or a peer fails: "" in the first case, the peer's
// failure in the second; nullopt at once for a backend whose work has no future.
std::optional<std::string> wait_for_future(c10d::Work& work) {
  auto& h = health();
  auto done = std::make_shared<std::atomic<bool>>(false);
  try {
    work.getFuture()->addCallback([done](c10::ivalue::Future&) {
      {
        std::lock_guard<std::mutex> g(health().wake_mu);
        done->store(true);
      }
      health().wake_cv.notify_all();
    });
  } catch (...) {
    return std::nullopt;  // a backend without futures
  }
  std::unique_lock<std::mutex> l(h.wake_mu);
  h.wake_cv.wait(l, [&] { return done->load() || h.peer_failed.load(); });
  if (done->load()) return "";
  l.unlock();
  return peer_failure_text();
}

// Gloo send/recv (work without a future): waits on it directly, registered so that the
// watchdog aborts the wait when a peer fails. "" when it completed, else why it did not.
std::string wait_abortable(c10d::Work& work) {
  auto& h = health();
  {
    std::lock_guard<std::mutex> g(h.mu);
    h.abortable.insert(&work);
  }
  struct Unregister {
    c10d::Work* w;
    ~Unregister() {
      std::lock_guard<std::mutex> g(health().mu);
      health().abortable.erase(w);
    }
  } unregister{&work};
  bool completed = false;
  if (!h.peer_failed.load()) completed = work.wait();
  if (completed && !h.peer_failed.load()) return "";
  const std::string failure = peer_failure_text();
  return failure.empty() ? "the wait was aborted" : failure;
}

}  // namespace

void wait_collective(c10d::Work& work, const std::string& what) {
  auto& h = health();
  const WorkContext c = start_waiting(&work);
  struct StopWaiting {
    const c10d::Work* w;
    ~StopWaiting() { stop_waiting(w); }
  } stop_waiting_at_exit{&work};
  const std::optional<std::string> future_wait = wait_for_future(work);
  std::string failure = future_wait.value_or("");
  auto stop_waiting = [&] {
    h.poisoned.store(true);  // the backend is still blocked in this collective
    TORCH_CHECK(false, "dtensor: ", what, " stopped waiting: ", failure,
                " (every rank stops when one fails)");
  };
  if (!failure.empty()) stop_waiting();
  try {
    if (future_wait) {
      work.wait();
    } else if (c.blocks) {
      // An MPI request: the health thread ends the process if a peer fails meanwhile.
      BlockingSection blocked(c.group, c.timeout, c.seq, what);
      work.wait();
    } else {
      failure = wait_abortable(work);
    }
  } catch (const std::exception& e) {
    if (h.peer_failed.load()) {
      failure = peer_failure_text();
      stop_waiting();
    }
    h.poisoned.store(true);
    const std::string head = "dtensor: " + what + " failed: ";
    const std::string tail = "Backend error: " + util::error_message(e);
    if (c.group.empty()) {
      report_failure(head + tail);
      TORCH_CHECK(false, head + tail);
    }
    // Room for the answers diagnose() waits for and the store's round trips on a busy machine.
    TORCH_CHECK(false,
                bounded_diagnosis(c, head, tail,
                                  diagnosis_budget(c.timeout) * 2 + std::chrono::seconds(1)));
  }
  if (!failure.empty()) stop_waiting();
}

void issue_failed(ProcessGroup& pg, int64_t seq, const std::string& group, const std::string& what,
                  const std::exception& e) {
  auto& h = health();
  const std::string head = "dtensor: " + what + " failed: ";
  if (h.peer_failed.load()) {
    std::lock_guard<std::mutex> g(h.mu);
    TORCH_CHECK(false, head, h.peer_failure, " (every rank stops when one fails)");
  }
  const WorkContext c{group, seq, pg.timeout()};
  TORCH_CHECK(false, bounded_diagnosis(c, head, "Backend error: " + util::error_message(e),
                                       diagnosis_budget(c.timeout) * 2 + std::chrono::seconds(1)));
}

}  // namespace dtensor::comm::detail
