#include "last_words.h"

#include <c10/util/Exception.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <mutex>
#include <thread>

#include "diagnosis.h"
#include "dtensor/comm/failure.h"
#include "dtensor/util/error_message.h"
#include "health.h"

namespace dtensor::comm {
namespace detail {
namespace {

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

}  // namespace

[[noreturn]] void on_terminate() {
  std::string what = "std::terminate without an active exception";
  if (auto e = std::current_exception()) {
    what = "uncaught exception: " + util::error_message(e);
  }
  std::fprintf(stderr, "dtensor: rank %d failed: %s\n", health().rank, what.c_str());
  std::fflush(stderr);
  report_failure(what);
  // Not the previous handler: libstdc++'s prints the exception's what() again, with
  // LibTorch's stack trace, after the message above.
  std::abort();
}

// Diagnosing and reporting use the store, which may itself be stalled (its
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

void clear_last_words() { last_words_size.store(0); }

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
    if (store) detail::record_own_failure_locked(rank, message);
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
