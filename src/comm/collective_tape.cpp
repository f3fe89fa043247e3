#include "dtensor/comm/collective_tape.h"

#include <c10/util/Exception.h>

#include "tape.h"

namespace dtensor::comm {
namespace {

// One open recorder or replay; innermost last.
struct Frame {
  CollectiveTape* record = nullptr;
  const CollectiveTape* replay = nullptr;
  size_t cursor = 0;
  std::string owner;
};
thread_local std::vector<Frame> t_frames;

}  // namespace

int64_t CollectiveTape::bytes() const {
  int64_t n = 0;
  for (const auto& e : entries_)
    if (e.result.defined()) n += e.result.numel() * static_cast<int64_t>(e.result.element_size());
  return n;
}

void CollectiveTape::push(std::string what, at::Tensor result) {
  entries_.push_back({std::move(what), std::move(result)});
}

RecordCollectives::RecordCollectives(CollectiveTape& tape) {
  t_frames.push_back({&tape, nullptr, 0, {}});
}
RecordCollectives::~RecordCollectives() { t_frames.pop_back(); }

ReplayCollectives::ReplayCollectives(const CollectiveTape& tape, std::string owner) {
  t_frames.push_back({nullptr, &tape, 0, std::move(owner)});
}
ReplayCollectives::~ReplayCollectives() { t_frames.pop_back(); }

size_t ReplayCollectives::replayed() const { return t_frames.back().cursor; }

void ReplayCollectives::finish() const {
  const Frame& f = t_frames.back();
  const auto& entries = f.replay->entries();
  TORCH_CHECK(f.cursor == entries.size(), "dtensor: ", f.owner, " issued ", f.cursor,
              " collective(s), but the forward it recomputes issued ", entries.size(),
              "; the first one missing is #", f.cursor + 1, ": ", entries[f.cursor].what,
              ". A recomputed forward must run the same collectives as the original: make its "
              "behaviour depend only on its inputs, or do not checkpoint it.");
}

namespace detail {

bool tape_open() { return !t_frames.empty(); }

at::Tensor taped(const std::string& what, const std::function<at::Tensor()>& issue) {
  // The innermost replay supplies the result; recorders opened after it keep a copy.
  ptrdiff_t replay = -1;
  for (ptrdiff_t i = static_cast<ptrdiff_t>(t_frames.size()) - 1; i >= 0; --i) {
    if (t_frames[i].replay) {
      replay = i;
      break;
    }
  }
  at::Tensor result;
  if (replay >= 0) {
    Frame& f = t_frames[replay];
    const auto& entries = f.replay->entries();
    const size_t n = f.cursor + 1;
    TORCH_CHECK(f.cursor < entries.size(), "dtensor: ", f.owner, " issued collective #", n, " (",
                what, "), but the forward it recomputes issued only ", entries.size(),
                ". A recomputed forward must run the same collectives as the original: make its "
                "behaviour depend only on its inputs, or do not checkpoint it.");
    const auto& entry = entries[f.cursor];
    TORCH_CHECK(entry.what == what, "dtensor: ", f.owner, " issued collective #", n, " as ", what,
                ", but the forward it recomputes issued ", entry.what,
                ". A recomputed forward must run the same collectives as the original: make its "
                "behaviour depend only on its inputs, or do not checkpoint it.");
    ++f.cursor;
    result = entry.result.clone();  // the caller may write into it; the tape stays intact
  } else {
    // The collective itself runs with the tape hidden, so it communicates.
    std::vector<Frame> open;
    open.swap(t_frames);
    try {
      result = issue();
    } catch (...) {
      t_frames.swap(open);
      throw;
    }
    t_frames.swap(open);
  }
  for (size_t i = static_cast<size_t>(replay + 1); i < t_frames.size(); ++i)
    if (t_frames[i].record) t_frames[i].record->push(what, result.clone());
  return result;
}

}  // namespace detail

bool collectives_taped() { return detail::tape_open(); }

}  // namespace dtensor::comm
