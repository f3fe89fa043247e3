#pragma once
// Comm-internal: collective fingerprints, the failure watchdog and the diagnosis a failed
// collective runs before it throws (see include/dtensor/comm/failure.h for the behaviour).
// Implemented by one file per concern: fingerprints.cpp, watchdog.cpp, diagnosis.cpp and
// last_words.cpp, over the record they share (health_state.h).
#include <ATen/core/Tensor.h>

#include <chrono>
#include <string>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "dtensor/comm/process_group.h"

namespace dtensor::comm::detail {

// Installs the terminate handler (an uncaught exception is reported as this rank's failure,
// printed once and without a stack trace) as soon as this process knows its rank: a rendezvous
// that fails is uncaught in most programs too.
void health_prepare(int rank);
// Starts watching the job whose keys live under `prefix` in `store`; `store_addr`/`store_port`
// let the watchdog open its own connection (the main one may be busy in a blocking wait).
void health_start(c10::intrusive_ptr<c10d::Store> store, std::string prefix, int rank,
                  std::string store_addr, int store_port, std::chrono::milliseconds timeout,
                  int world_size);
// Stops the watchdog. `clean`: this rank leaves normally, so it records how many collectives
// it issued on each group (a peer still waiting can then say that this rank left).
void health_stop(bool clean);
// True once a collective was abandoned: its backend may still be blocked and must not be
// destroyed (its destructor would wait for the timeout).
bool health_poisoned();

// How long a failed collective waits for the other ranks' answers before it throws. The
// backends get the configured timeout less this, so that a stalled peer ends every rank
// within the configured timeout, diagnosis included.
std::chrono::milliseconds diagnosis_budget(std::chrono::milliseconds timeout);

// Tells every watchdog of the job under `prefix` about `text` ("fail\tRANK\tmessage").
void post_event(c10d::Store& store, const std::string& prefix, const std::string& text);
// "rank R failed: ..." for the first failure another rank reported, or "".
std::string peer_failure_in_store(c10d::Store& store, const std::string& prefix, int rank);

// Throws if another rank reported a failure; `where` names what this rank was about to do.
void throw_if_peer_failed(const std::string& where);

// A fingerprint for the next collective on `pg`; returns its sequence number on the group.
// With DTENSOR_CHECK_COLLECTIVES=1 it first compares it with every member's.
int64_t begin_collective(ProcessGroup& pg, const char* op, const at::Tensor& t);
// The same for a point-to-point message from group rank `src` to group rank `dst` of `pg`:
// each direction between two ranks is a channel of its own ("<group>:0->1") whose two members
// number their messages alike, so a send and its receive get the same sequence number.
int64_t begin_p2p(ProcessGroup& pg, int src, int dst, const at::Tensor& t);
// The name of that channel.
std::string p2p_channel(ProcessGroup& pg, int src, int dst);
// "float32[8,4]".
std::string signature(const at::Tensor& t);
// Remembers which group and collective `work` belongs to, for wait_collective's messages.
// `group` is pg.name() or a p2p_channel; `blocks`: waiting on the work blocks in a call that can
// neither time out nor be cancelled (an MPI point-to-point request), see wait_collective.
void attach(const c10d::Work* work, ProcessGroup& pg, int64_t seq, const std::string& group,
            bool blocks);
// Marks the calling thread as blocked in a collective that can neither time out nor be
// cancelled (an MPI call). If it outlasts the group's timeout, or another rank reports a
// failure meanwhile, the health thread writes a message naming this rank, the collective and
// the diagnosis to stderr and ends the process: the blocked call cannot be undone.
class BlockingSection {
 public:
  // `what`: "rank R: all_reduce float32[8] ... as collective #S on group G ...".
  BlockingSection(ProcessGroup& pg, int64_t seq, std::string what);
  // The same for collective #`seq` of the group or channel named `group`.
  BlockingSection(const std::string& group, std::chrono::milliseconds timeout, int64_t seq,
                  std::string what);
  ~BlockingSection();
  BlockingSection(const BlockingSection&) = delete;
  BlockingSection& operator=(const BlockingSection&) = delete;

 private:
  uint64_t id_;
};

// Waits for `work`; on an error, a peer's failure or a timeout, throws with `what` and a
// diagnosis naming the ranks involved and the first collective where they diverge. Work without
// a future (point-to-point) is waited on directly: Gloo's is aborted when a peer fails, an MPI
// request waits inside a BlockingSection.
void wait_collective(c10d::Work& work, const std::string& what);
// For collective #`seq` of the group or channel `group` whose issue threw `e` on this rank (a
// peer's connection already closed): throws as wait_collective does, with the diagnosis.
[[noreturn]] void issue_failed(ProcessGroup& pg, int64_t seq, const std::string& group,
                               const std::string& what, const std::exception& e);

}  // namespace dtensor::comm::detail
