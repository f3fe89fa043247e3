#pragma once
// Recording and replaying the results of collectives, so that a forward pass can be recomputed
// without communicating again (activation checkpointing, dtensor/ac/checkpoint.h).
//
// While a RecordCollectives is alive on a thread, every collective that thread issues through
// dtensor/comm/collectives.h completes before it returns (an *_async one too) and a copy of its
// result is appended to the tape. While a ReplayCollectives is alive, collectives do not
// communicate and are not counted by CommDebugMode: each returns a copy of the next recorded
// result, after checking that it is the same collective (type, arguments, input dtype and
// shape, group); a different one throws naming both and the tape's owner.
// Recorders nest: the results of a replay are recorded by the recorders opened after it.
#include <ATen/core/Tensor.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace dtensor::comm {

/// The collectives one recorded region issued, in issue order.
class CollectiveTape {
 public:
  /// One collective: its description ("all_gather_into_tensor dim 1 of float64[2,4,32] on group
  /// tp") and a private copy of its result.
  struct Entry {
    std::string what;
    at::Tensor result;
  };
  /// Recorded collectives, in issue order.
  const std::vector<Entry>& entries() const { return entries_; }
  /// Bytes held by the recorded results.
  int64_t bytes() const;
  /// Forgets every entry.
  void clear() { entries_.clear(); }
  /// Appends one entry (used by the comm layer).
  void push(std::string what, at::Tensor result);

 private:
  std::vector<Entry> entries_;
};

/// Whether this thread records or replays collectives now (a RecordCollectives or
/// ReplayCollectives is alive): code that may issue collectives early must then not.
bool collectives_taped();

/// Records the collectives this thread issues into `tape` until destroyed.
class RecordCollectives {
 public:
  explicit RecordCollectives(CollectiveTape& tape);
  ~RecordCollectives();
  RecordCollectives(const RecordCollectives&) = delete;
  RecordCollectives& operator=(const RecordCollectives&) = delete;
};

/// Replays `tape` to the collectives this thread issues until destroyed; `owner` names the
/// region in errors ("the recompute of checkpointed module 'layers.0'").
class ReplayCollectives {
 public:
  ReplayCollectives(const CollectiveTape& tape, std::string owner);
  ~ReplayCollectives();
  ReplayCollectives(const ReplayCollectives&) = delete;
  ReplayCollectives& operator=(const ReplayCollectives&) = delete;
  /// Throws unless every recorded collective was replayed.
  void finish() const;
  /// Collectives replayed so far.
  size_t replayed() const;
};

}  // namespace dtensor::comm
