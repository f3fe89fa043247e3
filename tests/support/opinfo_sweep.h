#pragma once
// The OpInfo sweep (docs/OPINFO.md): every sample of tests/ops/opinfo/ replayed on DTensors laid
// out Shard(0), Replicate and Shard(-1) over forked ranks, compared with the same calls on plain
// tensors, forward and backward, and classified PASS / REFUSED / WRONG / HANG / CRASH. A world of
// ranks that crashes, hangs or loses its group is restarted after the case that broke it, so
// one case's failure is that case's outcome and not the next one's.
#include <string>
#include <vector>

#include "support/opinfo_replay.h"

namespace dtensor::testing::opinfo {

/// Ordered from best to worst, so that an op's outcome is the max over its samples and layouts.
/// NotRun: no backward (no derivative, nothing requires grad, or the forward failed); Skipped:
/// the replay fails on plain tensors too (not a DTensor outcome).
enum class Outcome : int { NotRun = 0, Skipped, Pass, Refused, Wrong, Hang, Crash };
/// "-", "skip", "PASS", "REFUSED", "WRONG", "HANG", "CRASH".
const char* outcome_name(Outcome o);

/// The layouts every tensor input takes, in this order (a 0-d input stays Replicate).
inline const std::vector<std::string>& layout_names() {
  static const std::vector<std::string> names = {"S(0)", "R", "S(-1)"};
  return names;
}

/// One sample on one layout at one world size.
struct CaseResult {
  Outcome forward = Outcome::NotRun;
  Outcome backward = Outcome::NotRun;
  bool altered = false;  ///< the negative control changed an element of the result
  std::string message;   ///< why, for anything but PASS
};

struct SweepOptions {
  /// Change one element of each case's first DTensor result (on every rank holding some of it)
  /// before comparing: a comparison that works reports every such case WRONG.
  bool negative_control = false;
  double case_timeout_s = 60;  ///< a case running longer is a HANG
};

/// Runs `samples` (indices into set.samples) on `world` forked ranks, each sample on every
/// layout: results[i * layouts + l] for the i-th sample of `samples` and layout l.
std::vector<CaseResult> sweep(const SampleSet& set, const std::vector<size_t>& samples, int world,
                              const SweepOptions& options = {});

/// PyTorch's list of OpInfos its DTensor sweep expects to fail or skips
/// (tests/ops/opinfo/pytorch_dtensor_fails.txt): OpInfo key -> "xfail" or "skip".
std::map<std::string, std::string> load_pytorch_fails(const std::string& path);

/// Per OpInfo: the worst forward and backward outcome over its samples, for each world size and
/// layout, and the messages of its worst forward case and of its worst backward case (each
/// naming the world size and layout it ran on).
struct OpSummary {
  std::string key;
  std::vector<Outcome> forward;   ///< per (world, layout)
  std::vector<Outcome> backward;  ///< per (world, layout)
  std::string forward_message;    ///< empty when every forward passed
  std::string backward_message;   ///< empty when every backward that ran passed
  Outcome worst_forward() const;
  Outcome worst_backward() const;
  /// The forward's message, then the backward's: a refused forward is never hidden behind a
  /// worse backward elsewhere.
  std::string message() const;
};

/// One summary per OpInfo of `samples`, in first-seen order, from the per-world results
/// (`per_world[w]` as sweep() returned them for world `worlds[w]`).
std::vector<OpSummary> summarize(const SampleSet& set, const std::vector<size_t>& samples,
                                 const std::vector<std::vector<CaseResult>>& per_world,
                                 const std::vector<int>& worlds);

/// Totals and the table, as docs/OPINFO.md shows them.
struct SideBySide {
  int both_pass = 0, pytorch_only = 0, ours_only = 0, neither = 0, pytorch_skips = 0;
  int wrong = 0, crash = 0, hang = 0;                 ///< forward cases
  int bwd_pass = 0, bwd_wrong = 0, bwd_refused = 0;   ///< ops with a backward run
  int bwd_crash_or_hang = 0;                          ///< backward cases
  std::vector<std::string> pytorch_passes_we_refuse;  ///< OpInfo keys
};
SideBySide side_by_side(const std::vector<OpSummary>& ops,
                        const std::map<std::string, std::string>& pytorch_fails);
/// The markdown page: the totals, then one row per OpInfo (and the OpInfos left out).
std::string markdown_table(const SampleSet& set, const std::vector<OpSummary>& ops,
                           const std::map<std::string, std::string>& pytorch_fails,
                           const std::vector<int>& worlds, const std::string& preamble);

}  // namespace dtensor::testing::opinfo
