#include "health.h"

#include <ATen/core/ivalue.h>
#include <ATen/core/ivalue_inl.h>
#include <c10/util/Exception.h>
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>
#include <thread>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "dtensor/comm/comm_debug_mode.h"
#include "dtensor/comm/error_message.h"
#include "dtensor/comm/failure.h"

namespace dtensor::comm {
namespace detail {
namespace {

using Clock = std::chrono::steady_clock;
constexpr size_t kHistory = 64;                         // fingerprints kept per group
constexpr auto kPoll = std::chrono::milliseconds(100);  // watchdog period
constexpr auto kMaxAnswerWait = std::chrono::milliseconds(1000);

struct Fingerprint {
  int64_t seq = 0;
  std::string op, sig, module;
};
// What every rank must agree on; the module path is context for the reader only.
std::string key_of(const Fingerprint& f) { return f.op + " " + f.sig; }
std::string show(const Fingerprint& f) {
  return key_of(f) + (f.module.empty() ? "" : " (in " + f.module + ")");
}

// A collective a rank is waiting in, on any of its groups: in an answer to a peer's question,
// so that a peer stuck behind this rank learns what this rank itself waits for.
struct Wait {
  std::string group, label;
  std::vector<int> members;
  Fingerprint fingerprint;
};

struct History {
  int64_t seq = 0;    // last sequence number issued
  bool left = false;  // the rank destroyed its process group normally
  std::deque<Fingerprint> ring;
  std::vector<Wait> waits;  // filled in answers only
  const Fingerprint* at(int64_t s) const {
    for (const auto& f : ring) {
      if (f.seq == s) return &f;
    }
    return nullptr;
  }
};

struct GroupState {
  std::vector<int> members;  // global ranks
  std::string label;         // "world", "group0[0,1] (mesh dim 1)"
  History history;
};

struct WorkContext {
  std::string group;
  int64_t seq = 0;
  std::chrono::milliseconds timeout{0};
  bool blocks = false;  // waiting blocks in an uncancellable call (an MPI request)
};

// A thread inside a BlockingSection.
struct Blocked {
  std::string what;
  WorkContext context;
  Clock::time_point deadline;
};

struct Health {
  std::mutex mu;  // guards everything below but the atomics and the watchdog's own fields
  c10::intrusive_ptr<c10d::Store> store;
  std::string prefix;
  int rank = -1;
  std::chrono::milliseconds timeout{0};
  bool check = false;
  std::map<std::string, GroupState> groups;
  std::map<const c10d::Work*, WorkContext> works;
  // Work a thread is waiting for now (wait_collective), moved here from `works`.
  std::map<const c10d::Work*, WorkContext> waiting;
  // Work without a future being waited on (Gloo send/recv): aborted when a peer fails.
  std::set<c10d::Work*> abortable;
  std::string peer_failure;
  std::atomic<bool> peer_failed{false};
  // This rank reported its own failure: it starts no further collective (those it waits in
  // end as before, on their own error or a peer's notice).
  std::string own_failure;
  std::atomic<bool> own_failed{false};
  std::atomic<bool> reported{false};
  std::atomic<bool> poisoned{false};
  // A store call failed (its host unreachable or gone): later reports skip the store rather
  // than wait for its timeout again.
  std::atomic<bool> store_lost{false};
  std::string store_where;  // "ADDR:PORT", for messages
  // Waiters sleep here; the watchdog and finished work wake them.
  std::mutex wake_mu;
  std::condition_variable wake_cv;
  std::map<uint64_t, Blocked> blocked;
  uint64_t next_blocked = 0;
  // The watchdog thread, and the guard that ends the process when a blocking call overruns
  // (separate: the watchdog may itself wait on a stalled store).
  std::thread watchdog;
  std::thread guard;
  std::mutex wd_mu;
  std::condition_variable wd_cv;
  bool stop = false;
};

// Never destroyed: the terminate handler and exit paths may still use it.
Health& health() {
  static Health* h = new Health;
  return *h;
}

std::string to_string(const std::vector<uint8_t>& v) { return std::string(v.begin(), v.end()); }

std::vector<std::string> split(const std::string& s, char sep, size_t max_parts) {
  std::vector<std::string> out;
  size_t start = 0;
  while (out.size() + 1 < max_parts) {
    size_t p = s.find(sep, start);
    if (p == std::string::npos) break;
    out.push_back(s.substr(start, p - start));
    start = p + 1;
  }
  out.push_back(s.substr(start));
  return out;
}

std::string serialize(const History& h) {
  std::ostringstream o;
  o << (h.left ? "left" : "at") << "\t" << h.seq << "\n";
  for (const auto& f : h.ring)
    o << f.seq << "\t" << f.op << "\t" << f.sig << "\t" << f.module << "\n";
  for (const auto& w : h.waits) {
    o << "waits\t" << w.group << "\t" << w.label << "\t";
    for (size_t i = 0; i < w.members.size(); ++i) o << (i ? "," : "") << w.members[i];
    const auto& f = w.fingerprint;
    o << "\t" << f.seq << "\t" << f.op << "\t" << f.sig << "\t" << f.module << "\n";
  }
  return o.str();
}

History deserialize(const std::string& text) {
  History h;
  std::istringstream in(text);
  std::string line;
  if (std::getline(in, line)) {
    auto p = split(line, '\t', 2);
    h.left = p[0] == "left";
    if (p.size() == 2) h.seq = std::stoll(p[1]);
  }
  while (std::getline(in, line)) {
    if (line.rfind("waits\t", 0) == 0) {
      auto p = split(line, '\t', 8);
      if (p.size() != 8) continue;
      Wait w{p[1], p[2], {}, {std::stoll(p[4]), p[5], p[6], p[7]}};
      for (const auto& r : split(p[3], ',', SIZE_MAX)) {
        if (!r.empty()) w.members.push_back(std::stoi(r));
      }
      h.waits.push_back(std::move(w));
      continue;
    }
    auto p = split(line, '\t', 4);
    if (p.size() != 4) continue;
    h.ring.push_back({std::stoll(p[0]), p[1], p[2], p[3]});
  }
  return h;
}

std::string history_key(const std::string& prefix, const std::string& group, int rank) {
  return prefix + "hist/" + group + "/" + std::to_string(rank);
}

// What this rank's threads wait in now (collectives, MPI calls). Call with health().mu held.
std::vector<Wait> current_waits_locked() {
  auto& h = health();
  std::vector<WorkContext> contexts;
  for (const auto& [work, c] : h.waiting) contexts.push_back(c);
  for (const auto& [id, b] : h.blocked) contexts.push_back(b.context);
  std::vector<Wait> out;
  for (const auto& c : contexts) {
    auto it = h.groups.find(c.group);
    if (it == h.groups.end()) continue;
    const Fingerprint* f = it->second.history.at(c.seq);
    out.push_back({c.group, it->second.label, it->second.members,
                   f ? *f : Fingerprint{c.seq, "collective", "", ""}});
  }
  return out;
}

void wake_waiters() {
  auto& h = health();
  { std::lock_guard<std::mutex> g(h.wake_mu); }
  h.wake_cv.notify_all();
}

// Wakes the threads waiting on work without a future; their wait then sees peer_failed.
void abort_waits_locked() {
  for (c10d::Work* w : health().abortable) {
    try {
      w->abort();
    } catch (...) {
      // Nothing else to do: the wait ends at the backend's timeout instead.
    }
  }
}

// Called with h.mu held.
void record_own_failure(int rank, const std::string& message) {
  auto& h = health();
  if (h.own_failed.load()) return;
  h.own_failure = "rank " + std::to_string(rank) + " failed: " + message;
  h.own_failed.store(true);
}

void handle_event(c10d::Store& store, const std::string& event) {
  auto& h = health();
  auto p = split(event, '\t', 3);
  if (p.size() != 3) return;
  const int from = std::stoi(p[1]);
  if (from == h.rank) return;
  if (p[0] == "fail") {
    {
      std::lock_guard<std::mutex> g(h.mu);
      if (h.peer_failed.load()) return;
      h.peer_failure = "rank " + p[1] + " failed: " + p[2];
      {
        std::lock_guard<std::mutex> w(h.wake_mu);
        h.peer_failed.store(true);
      }
      abort_waits_locked();
    }
    wake_waiters();
  } else if (p[0] == "diag") {
    // A peer's collective failed on `group`: tell it where this rank is.
    std::string text;
    {
      std::lock_guard<std::mutex> g(h.mu);
      auto it = h.groups.find(p[2]);
      if (it == h.groups.end()) return;
      History answer = it->second.history;
      answer.waits = current_waits_locked();
      text = serialize(answer);
    }
    store.set(history_key(h.prefix, p[2], h.rank), text);
  }
}

bool stopping(std::chrono::milliseconds wait) {
  auto& h = health();
  std::unique_lock<std::mutex> l(h.wd_mu);
  return h.wd_cv.wait_for(l, wait, [&] { return h.stop; });
}

void watch(std::string addr, int port, std::string prefix, std::chrono::milliseconds timeout) {
  // Its own connection: the main one may sit in a blocking wait for a long time.
  c10::intrusive_ptr<c10d::TCPStore> store;
  try {
    c10d::TCPStoreOptions o;
    o.port = static_cast<uint16_t>(port);
    o.isServer = false;
    o.waitWorkers = false;
    // The store is up (this rank just joined through it), but a loaded machine can take
    // longer than a short timeout to accept: a watchdog that gave up would answer no peer.
    o.timeout = std::max<std::chrono::milliseconds>(timeout, std::chrono::seconds(10));
    store = c10::make_intrusive<c10d::TCPStore>(addr, o);
    store->setTimeout(timeout);
  } catch (...) {
    return;
  }
  int64_t seen = 0;
  while (!stopping(kPoll)) {
    try {
      const int64_t n = store->add(prefix + "events", 0);
      for (; seen < n; ++seen) {
        const std::string key = prefix + "event/" + std::to_string(seen + 1);
        store->wait({key}, std::chrono::seconds(2));
        handle_event(*store, to_string(store->get(key)));
      }
    } catch (...) {
      return;  // the store went away: the job is over (rank 0 or the launcher exited)
    }
  }
}

[[noreturn]] void on_terminate() {
  std::string what = "std::terminate without an active exception";
  if (auto e = std::current_exception()) {
    what = "uncaught exception: " + error_message(e);
  }
  std::fprintf(stderr, "dtensor: rank %d failed: %s\n", health().rank, what.c_str());
  std::fflush(stderr);
  report_failure(what);
  // Not the previous handler: libstdc++'s prints the exception's what() again, with
  // LibTorch's stack trace, after the message above.
  std::abort();
}

// A forked child does not inherit the watchdog thread: forget it instead of joining it later.
void after_fork_in_child() {
  auto& h = health();
  new (&h.watchdog) std::thread();
  new (&h.guard) std::thread();
  new (&h.wd_mu) std::mutex();
  new (&h.mu) std::mutex();
  new (&h.wake_mu) std::mutex();
}

std::string dtype_name(const at::Tensor& t) {
  return std::string(c10::getDtypeNames(t.scalar_type()).first);
}

// Lines naming what each member of `group` reported, and the first collective where the
// members' fingerprints differ.
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

}  // namespace

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
    return failed + unreachable(c, "(" + error_message(e) + ")");
  }
  return (failed.empty() ? "" : failed + ". ") +
         compare_histories(group.label, h.rank, group.history, others, silent, waited) + behind;
}

// head + diagnose(c) + tail, reported to the other ranks, computed aside: a call on a store
// whose host is cut off can block without a timeout. After `wait` the message names the
// group's other members as unreachable instead.
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
    record_own_failure(health().rank, msg);
  }
  return msg;
}

// Ends the process for a thread stuck in `b`: `peer_failure` when another rank failed, else
// the timeout passed. Diagnosing and reporting use the store, which may itself be stalled (its
// host stopped), so they run aside and get the diagnosis budget; the message is printed anyway.
[[noreturn]] void end_blocked(const Blocked& b, const std::string& peer_failure) {
  const std::string tail =
      " (an MPI call cannot be cancelled, so this process exits; every rank stops when one "
      "fails)";
  std::string msg;
  if (!peer_failure.empty()) {
    msg = "dtensor: " + b.what + " stopped waiting: " + peer_failure + tail;
  } else {
    const std::string head = "dtensor: " + b.what + " did not complete within " +
                             std::to_string(b.context.timeout.count() / 1000.0) +
                             " s (DTENSOR_TIMEOUT_S): ";
    msg = bounded_diagnosis(b.context, head, tail, diagnosis_budget(b.context.timeout) + kPoll * 2);
  }
  std::fprintf(stderr, "%s\n", msg.c_str());
  std::fflush(stderr);
  // Leave the peers a few watchdog periods to read this rank's failure before the launcher
  // (mpirun) tears the job down.
  std::this_thread::sleep_for(kPoll * 3);
  std::_Exit(1);
}

// Last words for a process that the launcher ends while a thread is blocked in an MPI call
// (mpirun sends SIGTERM to every rank once one died): which rank and collective. Written by
// BlockingSection, read by the signal handler, which may only use write(2).
char last_words[2048];
std::atomic<size_t> last_words_size{0};

void on_launcher_signal(int sig) {
  const size_t n = last_words_size.load();
  if (n > 0) (void)!::write(2, last_words, n);
  ::signal(sig, SIG_DFL);
  ::raise(sig);
}

void set_last_words(const std::string& what) {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction old {};
    if (::sigaction(SIGTERM, nullptr, &old) == 0 && old.sa_handler == SIG_DFL) {
      ::signal(SIGTERM, on_launcher_signal);
    }
  });
  const std::string text = "dtensor: " + what +
                           " was ended by the launcher (SIGTERM) inside the MPI call: another "
                           "rank died or the job was stopped (the launcher names which)\n";
  const size_t n = std::min(text.size(), sizeof(last_words));
  last_words_size.store(0);
  std::memcpy(last_words, text.data(), n);
  last_words_size.store(n);
}

void guard_blocked_calls() {
  auto& h = health();
  while (!stopping(kPoll / 2)) {
    std::optional<Blocked> stuck;
    std::string failure;
    {
      std::lock_guard<std::mutex> g(h.mu);
      const auto now = Clock::now();
      for (const auto& [id, b] : h.blocked) {
        if (h.peer_failed.load() || now >= b.deadline) {
          stuck = b;
          failure = h.peer_failed.load() ? h.peer_failure : "";
          break;
        }
      }
    }
    if (stuck) {
      h.poisoned.store(true);
      end_blocked(*stuck, failure);
    }
  }
}

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

// Events are numbered by an atomic counter so that every watchdog reads each one once.
void post_event(c10d::Store& store, const std::string& prefix, const std::string& text) {
  const int64_t k = store.add(prefix + "events", 1);
  store.set(prefix + "event/" + std::to_string(k), text);
}

std::string peer_failure_in_store(c10d::Store& store, const std::string& prefix, int rank) {
  const int64_t n = store.add(prefix + "events", 0);
  for (int64_t k = 1; k <= n; ++k) {
    const std::string key = prefix + "event/" + std::to_string(k);
    store.wait({key}, std::chrono::seconds(2));
    auto p = split(to_string(store.get(key)), '\t', 3);
    if (p.size() == 3 && p[0] == "fail" && p[1] != std::to_string(rank)) {
      return "rank " + p[1] + " failed: " + p[2];
    }
  }
  return "";
}

void health_prepare(int rank) {
  auto& h = health();
  static std::once_flag once;
  std::call_once(once, [] {
    std::set_terminate(on_terminate);
    pthread_atfork(nullptr, nullptr, after_fork_in_child);
  });
  std::lock_guard<std::mutex> g(h.mu);
  h.rank = rank;
}

void health_start(c10::intrusive_ptr<c10d::Store> store, std::string prefix, int rank,
                  std::string store_addr, int store_port, std::chrono::milliseconds timeout,
                  int world_size) {
  auto& h = health();
  health_prepare(rank);
  {
    std::lock_guard<std::mutex> g(h.mu);
    h.store = std::move(store);
    h.prefix = std::move(prefix);
    h.timeout = timeout;
    h.store_where = store_addr + ":" + std::to_string(store_port);
    h.store_lost.store(false);
    const char* check = std::getenv("DTENSOR_CHECK_COLLECTIVES");
    h.check = check && std::string(check) != "0" && *check;
    h.groups.clear();
    h.works.clear();
    h.peer_failure.clear();
    h.peer_failed.store(false);
    h.own_failure.clear();
    h.own_failed.store(false);
    h.reported.store(false);
    h.poisoned.store(false);
  }
  if (world_size > 1) {
    // A write to a dead peer's socket must fail the collective with a message, not kill this
    // rank silently with SIGPIPE (Python, and so torchrun jobs, ignore it the same way).
    struct sigaction old {};
    if (::sigaction(SIGPIPE, nullptr, &old) == 0 && old.sa_handler == SIG_DFL) {
      ::signal(SIGPIPE, SIG_IGN);
    }
    h.stop = false;
    h.watchdog = std::thread(watch, std::move(store_addr), store_port, h.prefix, timeout);
    h.guard = std::thread(guard_blocked_calls);
  }
}

void health_stop(bool clean) {
  auto& h = health();
  {
    std::lock_guard<std::mutex> l(h.wd_mu);
    h.stop = true;
  }
  h.wd_cv.notify_all();
  // A watchdog blocked on a store whose host is cut off may never return: leave it behind.
  const bool lost = h.store_lost.load();
  for (std::thread* t : {&h.watchdog, &h.guard}) {
    if (t->joinable()) lost ? t->detach() : t->join();
  }
  std::lock_guard<std::mutex> g(h.mu);
  if (clean && h.store && !h.poisoned.load()) {
    for (auto& [name, group] : h.groups) {
      group.history.left = true;
      try {
        h.store->set(history_key(h.prefix, name, h.rank), serialize(group.history));
      } catch (...) {
        break;  // the store is gone: nobody is left to ask
      }
    }
  }
  h.store.reset();
  h.groups.clear();
  h.works.clear();
}

bool health_poisoned() { return health().poisoned.load(); }

void throw_if_peer_failed(const std::string& where) {
  auto& h = health();
  if (!h.peer_failed.load() && !h.own_failed.load()) return;
  std::string failure;
  {
    std::lock_guard<std::mutex> g(h.mu);
    failure = h.peer_failed.load() ? h.peer_failure : h.own_failure;
  }
  TORCH_CHECK(false, "dtensor: rank ", h.rank, ": ", where, " not started: ", failure,
              " (every rank stops when one fails)");
}

std::string signature(const at::Tensor& t) {
  std::string s = dtype_name(t) + "[";
  for (int64_t d = 0; d < t.dim(); ++d) s += (d ? "," : "") + std::to_string(t.size(d));
  return s + "]";
}

namespace {

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
  if (!store) return f.seq;
  // DTENSOR_CHECK_COLLECTIVES: every member publishes its fingerprint and compares.
  const std::string base = h.prefix + "check/" + name + "/" + std::to_string(f.seq) + "/";
  store->set(base + std::to_string(h.rank), f.op + "\t" + f.sig + "\t" + f.module);
  const auto deadline = Clock::now() + timeout;
  std::map<int, History> others;
  std::vector<int> silent;
  bool differ = false;
  for (int r : members) {
    if (r == h.rank) continue;
    const std::string key = base + std::to_string(r);
    while (!store->check({key}) && Clock::now() < deadline && !h.peer_failed.load()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    throw_if_peer_failed(where);
    if (!store->check({key})) {
      silent.push_back(r);
      continue;
    }
    auto p = split(to_string(store->get(key)), '\t', 3);
    Fingerprint theirs{f.seq, p[0], p.size() > 1 ? p[1] : "", p.size() > 2 ? p[2] : ""};
    differ = differ || key_of(theirs) != key_of(f);
    History one;
    one.seq = f.seq;
    one.ring.push_back(theirs);
    others[r] = std::move(one);
  }
  if (!differ && silent.empty()) return f.seq;
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

BlockingSection::BlockingSection(ProcessGroup& pg, int64_t seq, std::string what)
    : BlockingSection(pg.name(), pg.timeout(), seq, std::move(what)) {}

BlockingSection::BlockingSection(const std::string& group, std::chrono::milliseconds timeout,
                                 int64_t seq, std::string what) {
  auto& h = health();
  // Room after the deadline for the diagnosis, the report and the peers to read it.
  const auto reserve = diagnosis_budget(timeout) + kPoll * 6;
  const auto now = Clock::now();
  const auto deadline = timeout > reserve ? now + timeout - reserve : now;
  std::lock_guard<std::mutex> g(h.mu);
  set_last_words(what);
  id_ = h.next_blocked++;
  h.blocked.emplace(id_, Blocked{std::move(what), WorkContext{group, seq, timeout}, deadline});
}

BlockingSection::~BlockingSection() {
  auto& h = health();
  std::lock_guard<std::mutex> g(h.mu);
  h.blocked.erase(id_);
  if (h.blocked.empty()) last_words_size.store(0);
}

void wait_collective(c10d::Work& work, const std::string& what) {
  auto& h = health();
  const WorkContext c = start_waiting(&work);
  struct StopWaiting {
    const c10d::Work* w;
    ~StopWaiting() { stop_waiting(w); }
  } stop_waiting_at_exit{&work};
  auto done = std::make_shared<std::atomic<bool>>(false);
  bool waitable = true;
  try {
    work.getFuture()->addCallback([done](c10::ivalue::Future&) {
      {
        std::lock_guard<std::mutex> g(health().wake_mu);
        done->store(true);
      }
      health().wake_cv.notify_all();
    });
  } catch (...) {
    waitable = false;  // a backend without futures: plain wait() below
  }
  std::string failure;
  auto peer_failure = [&] {
    std::lock_guard<std::mutex> g(h.mu);
    return h.peer_failure;
  };
  if (waitable) {
    std::unique_lock<std::mutex> l(h.wake_mu);
    h.wake_cv.wait(l, [&] { return done->load() || h.peer_failed.load(); });
    if (!done->load()) {
      l.unlock();
      failure = peer_failure();
    }
  }
  auto stop_waiting = [&] {
    h.poisoned.store(true);  // the backend is still blocked in this collective
    TORCH_CHECK(false, "dtensor: ", what, " stopped waiting: ", failure,
                " (every rank stops when one fails)");
  };
  if (!failure.empty()) stop_waiting();
  try {
    if (waitable) {
      work.wait();
    } else if (c.blocks) {
      // An MPI request: the health thread ends the process if a peer fails meanwhile.
      BlockingSection blocked(c.group, c.timeout, c.seq, what);
      work.wait();
    } else {
      // Gloo send/recv: the watchdog aborts the wait when a peer fails.
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
      if (!completed || h.peer_failed.load()) {
        failure = peer_failure();
        if (failure.empty()) failure = "the wait was aborted";
      }
    }
  } catch (const std::exception& e) {
    if (h.peer_failed.load()) {
      failure = peer_failure();
      stop_waiting();
    }
    h.poisoned.store(true);
    const std::string head = "dtensor: " + what + " failed: ";
    const std::string tail = "Backend error: " + error_message(e);
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
  TORCH_CHECK(false, bounded_diagnosis(c, head, "Backend error: " + error_message(e),
                                       diagnosis_budget(c.timeout) * 2 + std::chrono::seconds(1)));
}

}  // namespace detail

void report_failure(const std::string& message) {
  auto& h = detail::health();
  c10::intrusive_ptr<c10d::Store> store;
  std::string prefix;
  int rank = -1;
  std::vector<std::pair<std::string, std::string>> histories;
  {
    // try_lock: the terminate handler may run on a thread that holds the lock.
    std::unique_lock<std::mutex> g(h.mu, std::defer_lock);
    for (int i = 0; i < 200 && !g.try_lock(); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    if (!g.owns_lock()) return;
    store = h.store;
    prefix = h.prefix;
    rank = h.rank;
    // This rank's next collective fails too, whenever the peers hear of it: else it could run
    // among ranks that have not polled the store yet, and the notice end a later, unrelated
    // collective instead (which one depended on the watchdog's timing).
    if (store) detail::record_own_failure(rank, message);
    for (const auto& [name, group] : h.groups) {
      histories.emplace_back(detail::history_key(prefix, name, rank),
                             detail::serialize(group.history));
    }
  }
  if (!store || h.store_lost.load() || h.reported.exchange(true)) return;
  try {
    // Where this rank stopped, for the peers' diagnosis (it will not answer their questions).
    for (const auto& [key, text] : histories) store->set(key, text);
    detail::post_event(*store, prefix, "fail\t" + std::to_string(rank) + "\t" + message);
  } catch (...) {
    // The store is gone: the peers learn from their broken connections instead.
  }
}

}  // namespace dtensor::comm
