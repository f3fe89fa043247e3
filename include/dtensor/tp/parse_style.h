#pragma once
// Styles and placements as text, for configs and command lines. The syntax is the Python call
// PyTorch users write, and it reads back what ParallelStyle::repr() prints:
//   ColwiseParallel(input_layouts=Shard(1), use_local_output=False)
//   RowwiseParallel(output_layouts=(Shard(dim=1),))
//   SequenceParallel(sequence_dim=1)
//   PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None))
//   PrepareModuleInput(input_kwarg_layouts={'y': Shard(0)}, desired_input_kwarg_layouts={'y':
//   Replicate()}) PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(0))
//   PrepareModuleInputOutput(...), PairwiseParallel()
// Placements: Shard(d) / Shard(dim=d), Replicate(), Partial() / Partial(sum|avg|max|min), and the
// short forms S(d), R, P. Booleans True/False (or true/false); a single placement stands for a
// 1-tuple; [..] lists work like tuples. Errors say where the text went wrong and what was
// expected; an unknown argument is named along with the valid ones.
#include <string_view>

#include "dtensor/core/placement.h"
#include "dtensor/tp/parallel_style.h"

namespace dtensor::tp {

/// Parses a style call such as "ColwiseParallel(use_local_output=False)"; throws on bad text.
Style parse_style(std::string_view text);
/// Parses one placement: "Shard(0)", "S(0)", "Replicate()", "R", "Partial(max)", "P".
Placement parse_placement(std::string_view text);

}  // namespace dtensor::tp
