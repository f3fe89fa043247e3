// Styles as text (tp/parse_style.h): what repr() prints reads back to the same style; the
// short and keyword spellings; errors that point at the problem.
#include <gtest/gtest.h>

#include "dtensor/dtensor.h"
#include "dtensor/tp/compat.h"
#include "dtensor/tp/parse_style.h"
#include "support/errors.h"

using namespace dtensor;
using namespace dtensor::tp;

TEST(ParseStyle, ReprReadsBackToTheSameStyle) {
  const std::vector<Style> styles = {
      ColwiseParallel(),
      ColwiseParallel(
          {.input_layouts = Shard(0), .output_layouts = Replicate(), .use_local_output = false}),
      RowwiseParallel(),
      RowwiseParallel({.input_layouts = Replicate(), .output_layouts = Shard(1)}),
      SequenceParallel(),
      SequenceParallel({.sequence_dim = 0, .use_local_output = true}),
      PrepareModuleInput(),
      PrepareModuleInput({.input_layouts = Layouts{Shard(1), std::nullopt},
                          .desired_input_layouts = Layouts{Replicate(), std::nullopt},
                          .use_local_output = true}),
      PrepareModuleInput(
          {.input_kwarg_layouts = KwargLayouts{{"y", Shard(0)}, {"z", std::nullopt}},
           .desired_input_kwarg_layouts = KwargLayouts{{"y", Replicate()}, {"z", std::nullopt}}}),
      PrepareModuleOutput({.output_layouts = {Replicate()}, .desired_output_layouts = {Shard(0)}}),
      PrepareModuleOutput({.output_layouts = {Partial(), std::nullopt},
                           .desired_output_layouts = {Replicate(), std::nullopt},
                           .use_local_output = false}),
      PrepareModuleInputOutput({.input_layouts = Layouts{Replicate()},
                                .desired_input_layouts = Layouts{Shard(0)},
                                .use_local_input = true,
                                .output_layouts = {Shard(0)},
                                .desired_output_layouts = {Replicate()}}),
      PairwiseParallel(),
  };
  for (const Style& style : styles) {
    const std::string text = style.repr();
    SCOPED_TRACE(text);
    EXPECT_EQ(parse_style(text).repr(), text);
  }
  EXPECT_EQ(ColwiseParallel().repr(),
            "ColwiseParallel(input_layouts=(Replicate(),), output_layouts=(Shard(dim=-1),), "
            "use_local_output=True)");
  EXPECT_EQ(PrepareModuleInput({.input_layouts = Layouts{Shard(1), std::nullopt},
                                .desired_input_layouts = Layouts{Replicate(), std::nullopt}})
                .repr(),
            "PrepareModuleInput(input_layouts=(Shard(dim=1), None), desired_input_layouts="
            "(Replicate(), None), input_kwarg_layouts={}, desired_input_kwarg_layouts={}, "
            "use_local_output=False)");
}

TEST(ParseStyle, AcceptsPythonKeywordAndShortSpellings) {
  auto colwise = parse_style("ColwiseParallel(input_layouts=Shard(1), use_local_output=False)");
  auto* c = dynamic_cast<ColwiseParallel*>(colwise.ptr().get());
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(c->input_layout(), Shard(1));
  EXPECT_EQ(c->output_layout(), Shard(-1));
  EXPECT_FALSE(c->options().use_local_output);

  auto rowwise = parse_style("  RowwiseParallel( output_layouts = S(0) , input_layouts=R, ) ");
  auto* r = dynamic_cast<RowwiseParallel*>(rowwise.ptr().get());
  ASSERT_NE(r, nullptr);
  EXPECT_EQ(r->output_layout(), Shard(0));
  EXPECT_EQ(r->input_layout(), Replicate());
  EXPECT_TRUE(r->options().use_local_output);

  auto prepare = parse_style(
      "PrepareModuleInput(input_layouts=[S(1), None], desired_input_layouts=(Replicate(), None), "
      "input_kwarg_layouts={\"y\": Shard(dim=0), z: P(sum)}, "
      "desired_input_kwarg_layouts={'y': R, 'z': R}, use_local_output=true)");
  auto* p = dynamic_cast<PrepareModuleInput*>(prepare.ptr().get());
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(*p->options().input_layouts, (Layouts{Shard(1), std::nullopt}));
  EXPECT_EQ(p->options().input_kwarg_layouts->at("y"), Shard(0));
  EXPECT_EQ(p->options().input_kwarg_layouts->at("z"), Partial());
  EXPECT_TRUE(p->options().use_local_output);

  auto output = parse_style(
      "PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(0))");
  auto* o = dynamic_cast<PrepareModuleOutput*>(output.ptr().get());
  ASSERT_NE(o, nullptr);
  EXPECT_EQ(o->options().output_layouts, (Layouts{Replicate()}));

  EXPECT_EQ(parse_placement("Shard(-1)"), Shard(-1));
  EXPECT_EQ(parse_placement("Partial(max)"), Partial(ReduceOp::Max));
  EXPECT_EQ(parse_placement("Partial(reduce_op='avg')"), Partial(ReduceOp::Avg));
  EXPECT_EQ(parse_placement(" R "), Replicate());
}

TEST(ParseStyle, ErrorsNameTheProblem) {
  EXPECT_ERROR(parse_style("ColwiseParallel(foo=1, use_local_output=False, bar=R)"), c10::Error,
               "ColwiseParallel got unknown style arguments: foo, bar (valid arguments: "
               "input_layouts, output_layouts, use_local_output)");
  EXPECT_ERROR(parse_style("SequenceParallel(sequence_dims=1)"), c10::Error,
               "valid arguments: sequence_dim, use_local_output");
  EXPECT_ERROR(parse_style("PairwiseParallel(use_local=True)"), c10::Error,
               "(valid arguments: none)");
  EXPECT_ERROR(parse_style("ColwiseParallel(input_layouts=Shard(x))"), c10::Error,
               "bad placement Shard: the dim must be an integer at position 30",
               "expected Shard(<dim>), Replicate() or Partial([sum|avg|max|min])");
  EXPECT_ERROR(parse_style("RowwiseParallel(output_layouts=Replicat())"), c10::Error,
               "unknown value 'Replicat'");
  EXPECT_ERROR(parse_placement("Partial(mean)"), c10::Error, "unknown reduce op 'mean'");
  EXPECT_ERROR(parse_style("ColwiseParallel(use_local_output=1)"), c10::Error,
               "ColwiseParallel argument use_local_output=1 is not True or False");
  EXPECT_ERROR(parse_style("ColwiseParallel(input_layouts=(Shard(0), Shard(1)))"), c10::Error,
               "is not a placement (or a 1-tuple of one)");
  EXPECT_ERROR(parse_style("FooParallel()"), c10::Error, "unknown style 'FooParallel'");
  EXPECT_ERROR(parse_style("ColwiseParallel()x"), c10::Error, "unexpected text after the end");
  EXPECT_ERROR(parse_style("ColwiseParallel(use_local_output=True"), c10::Error, "unexpected end");
  EXPECT_ERROR(parse_style("PrepareModuleOutput(output_layouts=R)"), c10::Error,
               "PrepareModuleOutput requires the argument desired_output_layouts");
  EXPECT_ERROR(parse_style("SequenceParallel(use_local_output=True, use_local_output=False)"),
               c10::Error, "got argument 'use_local_output' twice");
  // The styles' own checks still apply.
  EXPECT_ERROR(parse_style("PrepareModuleInput(input_layouts=(Shard(0),), "
                           "desired_input_layouts=(Replicate(), None))"),
               c10::Error, "input_layouts and desired_input_layouts should have same length!");
}
