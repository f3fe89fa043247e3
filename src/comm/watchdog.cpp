// The watchdog: a thread per rank that reads the job's events from the store (a peer's failure,
// a peer's question about where this rank is) and answers them, and a guard thread that ends
// the process when a call that cannot be cancelled (an MPI call in a BlockingSection) outlasts
// its timeout or a peer fails meanwhile; starting and stopping both with the process group.
#include <c10/util/Exception.h>
#include <pthread.h>
#include <signal.h>

#include <cstdlib>
#include <exception>
#include <optional>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "health.h"
#include "health_state.h"
#include "last_words.h"

namespace dtensor::comm::detail {

void record_own_failure_locked(int rank, const std::string& message) {
  auto& h = health();
  if (h.own_failed.load()) return;
  h.own_failure = "rank " + std::to_string(rank) + " failed: " + message;
  h.own_failed.store(true);
}

namespace {

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

}  // namespace

void wake_waiters() {
  auto& h = health();
  { std::lock_guard<std::mutex> g(h.wake_mu); }
  h.wake_cv.notify_all();
}

bool record_failure_locked(int rank, const std::string& message) {
  auto& h = health();
  if (h.peer_failed.load()) return false;
  h.peer_failure = "rank " + std::to_string(rank) + " failed: " + message;
  {
    std::lock_guard<std::mutex> w(h.wake_mu);
    h.peer_failed.store(true);
  }
  abort_waits_locked();
  return true;
}

namespace {

void handle_event(c10d::Store& store, const std::string& event) {
  auto& h = health();
  auto p = split(event, '\t', 3);
  if (p.size() != 3) return;
  const int from = std::stoi(p[1]);
  if (from == h.rank) return;
  if (p[0] == "fail") {
    {
      std::lock_guard<std::mutex> g(h.mu);
      if (!record_failure_locked(from, p[2])) return;
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

// A forked child does not inherit the watchdog thread: forget it instead of joining it later.
void after_fork_in_child() {
  auto& h = health();
  new (&h.watchdog) std::thread();
  new (&h.guard) std::thread();
  new (&h.wd_mu) std::mutex();
  new (&h.mu) std::mutex();
  new (&h.wake_mu) std::mutex();
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
  if (h.blocked.empty()) clear_last_words();
}

}  // namespace dtensor::comm::detail
