// Residual dropout: masks keyed by the element's place in the global batch (the same whatever
// rows a rank holds), fresh draws without a key, and dropout only in training.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "dtensor/core/api.h"
#include "dtensor/core/random.h"
#include "dtensor/models/residual_dropout.h"
#include "dtensor/models/transformer.h"
#include "support/distributed.h"
#include "support/errors.h"

using namespace dtensor;
using namespace dtensor::models;
using namespace dtensor::testing;

namespace {

at::Tensor ones(int64_t rows) { return at::ones({rows, 8, 16}); }

}  // namespace

TEST(ResidualDropout, AKeyedMaskDependsOnlyOnTheElementsPlaceInTheGlobalBatch) {
  const double p = 0.25;
  at::Tensor whole;
  {
    DropoutKeyScope key({.seed = 7, .first_row = 0, .global_rows = 4});
    whole = residual_dropout(ones(4), p, /*layer=*/1, /*site=*/0);
  }
  // Kept elements are scaled by 1 / (1 - p), the others are 0; about p of them dropped.
  const at::Tensor kept = whole.ne(0);
  EXPECT_TRUE(
      at::equal(whole.masked_select(kept), at::full({kept.sum().item<int64_t>()}, 4.0 / 3)));
  const double dropped = 1 - kept.to(at::kDouble).mean().item<double>();
  EXPECT_GT(dropped, 0.19);
  EXPECT_LT(dropped, 0.31);
  // Rows 2 and 3 alone (a second dp rank, a batch segment, a micro-batch) draw the same mask.
  {
    DropoutKeyScope key({.seed = 7, .first_row = 0, .global_rows = 4});
    key.set_first_row(2);
    EXPECT_TRUE(at::equal(residual_dropout(ones(2), p, 1, 0), whole.narrow(0, 2, 2)));
  }
  // Another block, site or step key draws another mask.
  auto draw = [&](uint64_t seed, int64_t layer, int64_t site) {
    DropoutKeyScope key({.seed = seed, .first_row = 0, .global_rows = 4});
    return residual_dropout(ones(4), p, layer, site);
  };
  EXPECT_TRUE(at::equal(draw(7, 1, 0), whole));
  EXPECT_FALSE(at::equal(draw(7, 0, 0), whole));
  EXPECT_FALSE(at::equal(draw(7, 1, 1), whole));
  EXPECT_FALSE(at::equal(draw(8, 1, 0), whole));
  // The input's values pass through the kept elements.
  const at::Tensor x = at::randn({4, 8, 16});
  EXPECT_TRUE(at::equal(draw(7, 1, 0).ne(0), kept));
  {
    DropoutKeyScope key({.seed = 7, .first_row = 0, .global_rows = 4});
    EXPECT_TRUE(at::allclose(residual_dropout(x, p, 1, 0), x * whole));
  }
}

TEST(ResidualDropout, WithoutAKeyEachCallDrawsFromTheLibrarysStream) {
  dtensor::manual_seed(3);
  const at::Tensor a = residual_dropout(ones(2), 0.5, 0, 0);
  const at::Tensor b = residual_dropout(ones(2), 0.5, 0, 0);
  EXPECT_FALSE(at::equal(a, b));
  dtensor::manual_seed(3);
  EXPECT_TRUE(at::equal(residual_dropout(ones(2), 0.5, 0, 0), a));
  EXPECT_TRUE(at::equal(residual_dropout(ones(2), 0.0, 0, 0), ones(2)));
}

TEST(ResidualDropout, RefusesBadInput) {
  EXPECT_ERROR(residual_dropout(ones(2), 1.0, 0, 0), c10::Error, "p must be in [0, 1)");
  EXPECT_ERROR(residual_dropout(at::ones({4, 4}), 0.1, 0, 0), c10::Error, "(batch, sequence, dim)");
  EXPECT_ERROR(DropoutKeyScope({.seed = 1, .first_row = 4, .global_rows = 4}), c10::Error,
               "first_row 4 is not a row of a batch of 4");
  DropoutKeyScope key({.seed = 1, .first_row = 2, .global_rows = 4});
  EXPECT_ERROR(residual_dropout(ones(3), 0.1, 0, 0), c10::Error,
               "3 rows from row 2 does not fit the key's 4 rows");
}

TEST(ResidualDropout, BlocksDropOutInTrainingOnly) {
  DecoderConfig c = DecoderConfig::preset("tiny");
  c.dropout = 0.2;
  Transformer dropping(c);
  c.dropout = 0;
  Transformer plain(c);
  dropping->init_weights(5);
  plain->init_weights(5);
  const at::Tensor tokens = at::randint(0, 256, {2, 16}, at::kLong);
  DropoutKeyScope key({.seed = 9, .first_row = 0, .global_rows = 2});
  const at::Tensor trained = dropping->forward(tokens);
  EXPECT_TRUE(at::equal(dropping->forward(tokens), trained)) << "the key fixes the masks";
  EXPECT_FALSE(at::allclose(trained, plain->forward(tokens)));
  dropping->eval();
  EXPECT_TRUE(at::equal(dropping->forward(tokens), plain->forward(tokens)));
}

TEST(ResidualDropout, SequenceParallelTrainingIsRefused) {
  run_ranks(1, [](int) {
    DecoderConfig c = DecoderConfig::preset("tiny");
    c.dropout = 0.1;
    Transformer model(c);
    apply_tensor_parallel(*model, init_device_mesh("cpu", {1}, {"tp"}));
    const at::Tensor tokens = at::zeros({1, 8}, at::kLong);
    EXPECT_ERROR(model->forward(tokens), c10::Error,
                 "residual dropout keys its masks by whole sequences");
    model->eval();
    EXPECT_NO_THROW(model->forward(tokens));
  });
}
