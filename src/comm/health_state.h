#pragma once
// Comm-internal: what the health machinery (health.h) knows about this rank's job, shared by its
// files: fingerprints.cpp records the collectives, watchdog.cpp runs the threads that listen to
// the other ranks, diagnosis.cpp explains a failed collective, last_words.cpp reports this
// rank's own end. One process-wide record, guarded by its mutexes.
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <vector>

namespace dtensor::comm::detail {

using Clock = std::chrono::steady_clock;
constexpr auto kPoll = std::chrono::milliseconds(100);  // watchdog period

struct Fingerprint {
  int64_t seq = 0;
  std::string op, sig, module;
};
// What every rank must agree on; the module path is context for the reader only.
inline std::string key_of(const Fingerprint& f) { return f.op + " " + f.sig; }
inline std::string show(const Fingerprint& f) {
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
Health& health();

std::string to_string(const std::vector<uint8_t>& v);
// `s` cut at `sep` into at most `max_parts` parts (the last keeps the rest).
std::vector<std::string> split(const std::string& s, char sep, size_t max_parts);
// A history as the text a rank writes to the store for its peers, and back.
std::string serialize(const History& h);
History deserialize(const std::string& text);
// Where rank `rank` writes its history of `group` for the job under `prefix`.
std::string history_key(const std::string& prefix, const std::string& group, int rank);
// What this rank's threads wait in now (collectives, MPI calls). Call with health().mu held.
std::vector<Wait> current_waits_locked();

// Records a peer's failure ("rank R failed: ..."), the first only: collectives no longer start,
// and those waiting end. False when one was already recorded. Holds `mu`; the caller then calls
// wake_waiters() without it.
bool record_failure_locked(int rank, const std::string& message);
// Records this rank's own failure: only collectives it has yet to start fail (a thread waiting
// in one may be diagnosing it, e.g. after Gloo's thread ended on a size mismatch). Holds `mu`.
void record_own_failure_locked(int rank, const std::string& message);
void wake_waiters();

}  // namespace dtensor::comm::detail
