#pragma once
// Splits the output of `mpirun --tag-output` back into the ranks' own streams, so MPI ranks get
// the same "[rank R] " lines (and progress bars redrawn in place) as ranks dtrun forks itself.
#include <cstddef>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "line_writer.h"

namespace dtrun {

// mpirun starts every chunk a rank wrote with a tag "[job,rank]<stdout>:" (or <stderr>,
// <stddiag>) and passes the chunk on as it is: tags can come mid-line, and a pipe read can end
// inside one. Untagged text is mpirun's own and is written without a prefix.
class TaggedOutput {
 public:
  TaggedOutput(int nproc, bool prefix);

  // Bytes read from mpirun's stdout (`stream` 0) or stderr (1).
  void feed(int stream, const char* data, size_t size);
  // End of mpirun's `stream`: writes what is left.
  void finish(int stream);
  // The error line rank `rank` ended with, held back (LineWriter::hold_errors_of).
  std::optional<RankError> take_held_error(int rank) {
    return ranks_[2 * rank + 1]->take_held_error();
  }

 private:
  struct Parser {
    std::string carry;  // the start of a tag cut off by the last read
    LineWriter* target = nullptr;
  };
  // Length of the tag at `text[0..]`: > 0 a whole tag (rank and stream set), 0 none,
  // -1 the text ends inside what may still become one.
  static long match_tag(const std::string& text, size_t at, int* rank, int* stream);

  int nproc_;
  std::vector<std::unique_ptr<LineWriter>> ranks_;  // rank r: [2r] stdout, [2r+1] stderr
  LineWriter launcher_out_, launcher_err_;
  Parser parsers_[2];
};

}  // namespace dtrun
