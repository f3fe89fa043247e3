// The parts of dtensor_train that need no ranks: tokenizer, corpus and batches, learning-rate
// schedule, metrics CSV, loss plot, progress display and option parsing.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "common/corpus.h"
#include "common/lr_schedule.h"
#include "common/options.h"
#include "common/plan_file.h"
#include "common/run_config.h"
#include "common/tokenizer.h"
#include "dtensor/tp/parse_style.h"
#include "support/temp_dir.h"
#include "train/loss_plot.h"
#include "train/metrics.h"
#include "train/progress.h"

using namespace dtensor::train;
namespace fs = std::filesystem;

using dtensor::testing::TempDir;

namespace {

int count(const std::string& text, const std::string& needle) {
  int n = 0;
  for (size_t p = text.find(needle); p != std::string::npos; p = text.find(needle, p + 1)) ++n;
  return n;
}

std::optional<TrainOptions> parse(std::vector<std::string> args, int& exit_code,
                                  std::string* err = nullptr) {
  args.insert(args.begin(), "dtensor_train");
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  std::stringstream captured;
  auto* old = std::cerr.rdbuf(captured.rdbuf());
  auto* old_out = std::cout.rdbuf(captured.rdbuf());
  auto o = parse_args(static_cast<int>(argv.size()), argv.data(), exit_code);
  std::cerr.rdbuf(old);
  std::cout.rdbuf(old_out);
  if (err) *err = captured.str();
  return o;
}

// Expects resolve_run_config to refuse `args` on `world` ranks with a message containing `what`.
void expect_error(std::vector<std::string> args, int64_t world, const std::string& what) {
  int code = -1;
  auto o = parse(args, code);
  ASSERT_TRUE(o) << args[0];
  try {
    resolve_run_config(*o, world);
    ADD_FAILURE() << "no error for " << ::testing::PrintToString(args) << " on " << world
                  << " ranks";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
  }
}

}  // namespace

TEST(TrainTokenizer, EveryByteRoundTrips) {
  ByteTokenizer tok;
  std::string all;
  for (int b = 0; b < 256; ++b) all.push_back(static_cast<char>(b));
  const auto ids = tok.encode(all);
  ASSERT_EQ(ids.size(), 256u);
  for (int b = 0; b < 256; ++b) EXPECT_EQ(ids[b], b);
  EXPECT_EQ(tok.decode(ids), all);
  EXPECT_EQ(tok.decode(tok.encode("na\xc3\xafve caf\xc3\xa9")), "na\xc3\xafve caf\xc3\xa9");
  EXPECT_EQ(tok.vocab_size(), 256);
}

TEST(TrainTokenizer, DecodeRejectsIdsOutsideTheBytes) {
  ByteTokenizer tok;
  EXPECT_THROW(tok.decode({65, 256}), std::out_of_range);
  EXPECT_THROW(tok.decode({-1}), std::out_of_range);
}

TEST(TrainCorpus, DefaultCorpusIsLargeStableVariedEnglishText) {
  const std::string& text = default_corpus();
  EXPECT_GE(text.size(), 200u * 1024);
  EXPECT_LE(text.size(), 500u * 1024);
  EXPECT_EQ(&text, &default_corpus());  // built once
  EXPECT_EQ(text.rfind("Chapter One\n\n", 0), 0u);
  for (unsigned char c : text) {
    ASSERT_TRUE(c == '\n' || (c >= 32 && c < 127)) << "unexpected byte " << int(c);
  }
  // Prose, not a repeated block: almost every paragraph is different.
  std::set<std::string> paragraphs;
  size_t total = 0;
  for (size_t start = 0; start < text.size();) {
    size_t end = text.find("\n\n", start);
    if (end == std::string::npos) end = text.size();
    if (text.compare(start, 8, "Chapter ") != 0) {
      paragraphs.insert(text.substr(start, end - start));
      ++total;
    }
    start = end + 2;
  }
  EXPECT_GT(total, 1000u);
  EXPECT_GT(paragraphs.size(), total * 99 / 100);
  // Sentences start with capitals and end with full stops (what the model learns first).
  EXPECT_GT(count(text, ". "), 2000);
}

TEST(TrainCorpus, SplitKeepsTheTailForValidation) {
  std::vector<int64_t> tokens(1000);
  for (int i = 0; i < 1000; ++i) tokens[i] = i % 256;
  const auto split = split_tokens(tokens, 0.1, 16);
  ASSERT_EQ(split.train.size(), 900u);
  ASSERT_EQ(split.val.size(), 100u);
  EXPECT_TRUE(std::equal(split.train.begin(), split.train.end(), tokens.begin()));
  EXPECT_TRUE(std::equal(split.val.begin(), split.val.end(), tokens.begin() + 900));
  // Validation gets at least one window even when the fraction is smaller.
  EXPECT_EQ(split_tokens(tokens, 0.001, 31).val.size(), 32u);
  EXPECT_THROW(split_tokens(std::vector<int64_t>(40, 1), 0.1, 31), std::runtime_error);
}

TEST(TrainCorpus, BatchesArePureFunctionsOfSeedAndStep) {
  std::vector<int64_t> tokens(5000);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int64_t>((i * 7919) % 256);
  const BatchSampler a(&tokens, 4, 32, 1234, kTrainStream);
  const BatchSampler b(&tokens, 4, 32, 1234, kTrainStream);
  const auto late = b.get(7);  // order of requests does not matter
  const auto a7 = a.get(7);
  EXPECT_TRUE(at::equal(a7.inputs, late.inputs));
  EXPECT_TRUE(at::equal(a7.targets, late.targets));
  EXPECT_FALSE(at::equal(a.get(8).inputs, a7.inputs));
  EXPECT_FALSE(at::equal(BatchSampler(&tokens, 4, 32, 99, kTrainStream).get(7).inputs, a7.inputs));
  EXPECT_FALSE(at::equal(BatchSampler(&tokens, 4, 32, 1234, kValStream).get(7).inputs, a7.inputs));
  ASSERT_EQ(a7.inputs.sizes(), (std::vector<int64_t>{4, 32}));
  ASSERT_EQ(a7.inputs.scalar_type(), at::kLong);
  // Each row is a window of the text and its targets are the next tokens.
  for (int64_t r = 0; r < 4; ++r) {
    const int64_t off = a.offset(7, r);
    ASSERT_GE(off, 0);
    ASSERT_LE(off + 33, static_cast<int64_t>(tokens.size()));
    for (int64_t t = 0; t < 32; ++t) {
      EXPECT_EQ(a7.inputs[r][t].item<int64_t>(), tokens[off + t]);
      EXPECT_EQ(a7.targets[r][t].item<int64_t>(), tokens[off + t + 1]);
    }
  }
  // Offsets cover the text: over many draws both halves are used.
  int low = 0;
  for (int64_t s = 0; s < 200; ++s) low += a.offset(s, 0) < 2500;
  EXPECT_GT(low, 60);
  EXPECT_LT(low, 140);
}

// --pack-documents: rows start at a document's start, each token carries its document, and a
// document's last token predicts nothing (target -100), so no target crosses a boundary.
TEST(TrainCorpus, PackedRowsStartAtDocumentsAndKeepTheirBoundaries) {
  EXPECT_EQ(split_documents("one\ntwo\n\n\nthree\n\n"),
            (std::vector<std::string>{"one\ntwo", "three"}));
  std::vector<std::vector<int64_t>> documents;
  for (int64_t d = 0; d < 60; ++d) documents.emplace_back(1 + (d * 7) % 13, d);  // d, d, ...
  const TokenSplit split = split_document_tokens(documents, 0.2, 16);
  ASSERT_FALSE(split.train_starts.empty());
  EXPECT_EQ(split.train_starts[0], 0);
  EXPECT_EQ(split.val_starts[0], 0);
  const BatchSampler sampler(&split.train, 4, 16, 7, kTrainStream, &split.train_starts);
  const Batch b = sampler.get(3);
  ASSERT_TRUE(b.documents.defined());
  for (int64_t r = 0; r < 4; ++r) {
    const int64_t off = sampler.offset(3, r);
    EXPECT_TRUE(std::binary_search(split.train_starts.begin(), split.train_starts.end(), off));
    for (int64_t t = 0; t < 16; ++t) {
      // Every token of document d is d: the document id follows the token's value.
      const int64_t token = b.inputs[r][t].item<int64_t>(), first = b.inputs[r][0].item<int64_t>();
      EXPECT_EQ(b.documents[r][t].item<int64_t>(), token - first);
      const int64_t next = split.train[off + t + 1];
      EXPECT_EQ(b.targets[r][t].item<int64_t>(), next == token ? next : -100);
    }
  }
  EXPECT_FALSE(BatchSampler(&split.train, 4, 16, 7, kTrainStream).get(3).documents.defined());
}

TEST(TrainSchedule, WarmupThenCosineToMinLr) {
  LrSchedule s{/*lr=*/1e-2, /*min_lr=*/1e-3, /*warmup=*/10, /*total_steps=*/110};
  EXPECT_DOUBLE_EQ(s.at(0), 1e-3);  // (0+1)/10 of the peak
  EXPECT_DOUBLE_EQ(s.at(4), 5e-3);
  EXPECT_DOUBLE_EQ(s.at(9), 1e-2);                      // warmup ends at the peak
  EXPECT_DOUBLE_EQ(s.at(10), 1e-2);                     // decay starts at the peak
  EXPECT_NEAR(s.at(10 + 50), (1e-2 + 1e-3) / 2, 1e-4);  // about half way down at mid-decay
  EXPECT_DOUBLE_EQ(s.at(109), 1e-3);                    // the last step reaches min_lr
  EXPECT_DOUBLE_EQ(s.at(500), 1e-3);
  for (int64_t i = 10; i < 109; ++i) EXPECT_LE(s.at(i + 1), s.at(i)) << i;
  for (int64_t i = 0; i < 9; ++i) EXPECT_LT(s.at(i), s.at(i + 1)) << i;
}

TEST(TrainSchedule, NoWarmupStartsAtThePeak) {
  LrSchedule s{3e-3, 3e-4, 0, 5};
  EXPECT_DOUBLE_EQ(s.at(0), 3e-3);
  EXPECT_DOUBLE_EQ(s.at(4), 3e-4);
  EXPECT_DOUBLE_EQ(LrSchedule({3e-3, 3e-4, 0, 1}).at(0), 3e-3);
}

TEST(TrainMetrics, CsvRoundTripsAndResumeDropsLaterRows) {
  TempDir dir;
  const std::string path = dir.file("metrics.csv");
  std::vector<MetricsRow> rows;
  for (int64_t s = 1; s <= 5; ++s) {
    MetricsRow r;
    r.step = s;
    r.loss = static_cast<float>(5.5 / static_cast<double>(s) + 0.123456789);  // float32 values
    if (s % 2 == 0) r.val_loss = static_cast<float>(r.loss + 0.25);
    r.lr = 1e-3 * static_cast<double>(s);
    r.tokens_per_s = 1000.5 * static_cast<double>(s);
    r.step_ms = 12.25;
    r.grad_norm = static_cast<float>(0.75 / static_cast<double>(s));
    rows.push_back(r);
  }
  {
    MetricsWriter w(path);
    for (const auto& r : rows) w.write(r);
    EXPECT_EQ(w.rows().size(), 5u);
  }
  std::ifstream in(path);
  std::string header;
  std::getline(in, header);
  EXPECT_EQ(header, "step,loss,val_loss,lr,tokens_per_s,step_ms,grad_norm");
  auto back = read_metrics_csv(path);
  ASSERT_EQ(back.size(), 5u);
  for (size_t i = 0; i < 5; ++i) {
    EXPECT_EQ(back[i].step, rows[i].step);
    EXPECT_EQ(static_cast<float>(back[i].loss), static_cast<float>(rows[i].loss));  // exact
    EXPECT_EQ(back[i].val_loss.has_value(), rows[i].val_loss.has_value());
    if (rows[i].val_loss) {
      EXPECT_EQ(static_cast<float>(*back[i].val_loss), static_cast<float>(*rows[i].val_loss));
    }
    EXPECT_NEAR(back[i].lr, rows[i].lr, 1e-9);
    EXPECT_EQ(static_cast<float>(back[i].grad_norm), static_cast<float>(rows[i].grad_norm));
  }
  {
    MetricsWriter resumed(path, /*keep_through_step=*/3);
    EXPECT_EQ(resumed.rows().size(), 3u);
    resumed.write(rows[3]);
  }
  back = read_metrics_csv(path);
  ASSERT_EQ(back.size(), 4u);
  EXPECT_EQ(back[3].step, 4);
  std::ofstream(dir.file("bad.csv")) << "step,loss\n1,2\n";
  EXPECT_THROW(read_metrics_csv(dir.file("bad.csv")), std::runtime_error);
}

TEST(TrainPlot, SvgHasOneTrainingLineAndAValidationDotPerEvaluation) {
  std::vector<MetricsRow> rows;
  for (int64_t s = 1; s <= 40; ++s) {
    MetricsRow r;
    r.step = s;
    r.loss = 5.0 * std::exp(-0.05 * static_cast<double>(s)) + 1.0;
    if (s % 10 == 0) r.val_loss = r.loss + 0.1;
    rows.push_back(r);
  }
  const std::string svg = loss_curve_svg(rows, "loss <TP=2> & more");
  EXPECT_EQ(svg.rfind("<svg xmlns=\"http://www.w3.org/2000/svg\"", 0), 0u);
  EXPECT_NE(svg.find("</svg>"), std::string::npos);
  EXPECT_NE(svg.find("loss &lt;TP=2&gt; &amp; more"), std::string::npos);
  EXPECT_EQ(count(svg, "<polyline"), 1);
  // 4 evaluation dots and one in the legend.
  EXPECT_EQ(count(svg, "<circle"), 5);
  std::smatch m;
  ASSERT_TRUE(std::regex_search(svg, m, std::regex("points=\"([^\"]*)\"")));
  EXPECT_EQ(count(m[1].str(), ","), 40);
  // Nothing fetched from elsewhere.
  EXPECT_EQ(svg.find("href"), std::string::npos);
  // A NaN loss breaks the line instead of poisoning the axes.
  rows[20].loss = std::numeric_limits<double>::quiet_NaN();
  const std::string broken = loss_curve_svg(rows, "t");
  EXPECT_EQ(count(broken, "<polyline"), 2);
  EXPECT_EQ(broken.find("nan"), std::string::npos);
  EXPECT_NE(loss_curve_svg({}, "t").find("no finite loss"), std::string::npos);
}

TEST(TrainPlot, TicksAreRoundAndCoverTheRange) {
  const auto t = nice_ticks(1.83, 5.61, 6);
  ASSERT_GE(t.size(), 4u);
  EXPECT_LE(t.front(), 2.0 + 1e-9);
  EXPECT_GE(t.back(), 5.0 - 1e-9);
  const double step = t[1] - t[0];
  for (size_t i = 1; i < t.size(); ++i) EXPECT_NEAR(t[i] - t[i - 1], step, 1e-9);
  const double mantissa = step / std::pow(10.0, std::floor(std::log10(step)));
  EXPECT_TRUE(std::abs(mantissa - 1) < 1e-9 || std::abs(mantissa - 2) < 1e-9 ||
              std::abs(mantissa - 5) < 1e-9)
      << step;
}

TEST(TrainProgress, FormatsDurationsAndRates) {
  EXPECT_EQ(format_duration(7), "0:07");
  EXPECT_EQ(format_duration(245), "4:05");
  EXPECT_EQ(format_duration(3723), "1:02:03");
  EXPECT_EQ(format_duration(std::numeric_limits<double>::infinity()), "?");
  EXPECT_EQ(format_count(950), "950");
  EXPECT_EQ(format_count(12500), "12.5k");
  EXPECT_EQ(format_count(3.1e6), "3.10M");
  const std::string line = format_progress({45, 200, 2.31404, 12500, 2.9e-3, 31});
  EXPECT_NE(line.find(" 45/200"), std::string::npos) << line;
  EXPECT_NE(line.find("loss 2.3140"), std::string::npos) << line;
  EXPECT_NE(line.find("12.5k tok/s"), std::string::npos) << line;
  EXPECT_NE(line.find("lr 2.90e-03"), std::string::npos) << line;
  EXPECT_NE(line.find("ETA 0:31"), std::string::npos) << line;
}

TEST(TrainProgress, PlainLinesWithoutATerminalAndRedrawsOnOne) {
  std::ostringstream plain;
  {
    ProgressBar bar(plain, /*tty=*/false, /*every=*/5);
    for (int64_t s = 1; s <= 12; ++s) bar.update({s, 12, 1.0, 100, 1e-3, 1});
  }
  // Step 1, every 5th and the last; no carriage returns to garble a log.
  EXPECT_EQ(count(plain.str(), "\n"), 4);
  EXPECT_EQ(plain.str().find('\r'), std::string::npos);
  EXPECT_NE(plain.str().find("step 12/12"), std::string::npos) << plain.str();

  std::ostringstream tty;
  {
    ProgressBar bar(tty, /*tty=*/true, 5);
    bar.update({1, 2, 1.0, 100, 1e-3, 1});
    bar.message("hello");
    bar.update({2, 2, 0.5, 100, 1e-3, 0});
  }
  EXPECT_NE(tty.str().find('\r'), std::string::npos);
  EXPECT_NE(tty.str().find("hello\033[K\n"), std::string::npos) << tty.str();
  EXPECT_NE(tty.str().find("[########################] 2/2"), std::string::npos) << tty.str();
  EXPECT_EQ(tty.str().back(), '\n');
  // Every draw ends with a carriage return, never starts with one: a line relay such as dtrun
  // forwards it at once, behind its rank prefix.
  EXPECT_NE(tty.str().rfind("\033[K\r\n"), std::string::npos) << tty.str();
  EXPECT_NE(tty.str().front(), '\r');
}

TEST(TrainOptions, ParsesEveryKindOfOption) {
  int code = -1;
  auto o = parse({"--preset", "tiny", "--steps=7", "--lr", "1e-3", "--no-loss-parallel", "--dtype",
                  "float64", "--resume", "--verify-tp1", "--seq-len", "64"},
                 code);
  ASSERT_TRUE(o.has_value());
  EXPECT_EQ(o->preset, "tiny");
  EXPECT_EQ(o->steps, 7);
  EXPECT_EQ(o->lr, 1e-3);
  EXPECT_FALSE(o->loss_parallel);
  EXPECT_TRUE(o->sequence_parallel);
  EXPECT_EQ(o->dtype, "float64");
  EXPECT_EQ(o->resume, "auto");  // a flag follows: no value given
  EXPECT_TRUE(o->verify_tp1);
  EXPECT_EQ(o->seq_len, 64);
  EXPECT_EQ(o->progress, "auto");
  EXPECT_EQ(o->ac, "none");
  o = parse({"--ac", "selective"}, code);
  ASSERT_TRUE(o.has_value());
  EXPECT_EQ(o->ac, "selective");
  o = parse({"--progress", "bar"}, code);
  ASSERT_TRUE(o.has_value());
  EXPECT_EQ(o->progress, "bar");
  o = parse({"--resume", "runs/x/checkpoints/step_00000003.safetensors"}, code);
  ASSERT_TRUE(o.has_value());
  EXPECT_EQ(o->resume, "runs/x/checkpoints/step_00000003.safetensors");
  // Given twice, an option takes its last value (a script's default, then the user's).
  o = parse({"--steps", "3", "--preset", "tiny", "--steps", "4"}, code);
  ASSERT_TRUE(o.has_value());
  EXPECT_EQ(o->steps, 4);
}

TEST(TrainOptions, RejectsUnknownFlagsAndBadValuesClearly) {
  struct Case {
    std::vector<std::string> args;
    std::string message;
  };
  const std::vector<Case> cases = {
      {{"--stpes", "3"}, "unknown option '--stpes'"},
      {{"--steps"}, "--steps needs a value"},
      {{"--steps", "three"}, "--steps expects an integer, got 'three'"},
      {{"--steps", "0"}, "--steps must be at least 1"},
      {{"--lr", "-1"}, "--lr must be in"},
      {{"--lr", "nan"}, "--lr expects a number"},
      {{"--preset", "huge"}, "--preset expects one of tiny, tiny-moe, demo, bench, got 'huge'"},
      {{"--dtype", "half"}, "--dtype expects one of float32, float64"},
      {{"--progress", "fancy"}, "--progress expects one of auto, bar, lines"},
      {{"--ac", "some"}, "--ac expects one of none, full, selective, got 'some'"},
      {{"--vocab", "100"}, "--vocab must be at least 256"},
      {{"--verify-tp1=yes"}, "--verify-tp1 takes no value"},
      {{"--lr", "1e-3", "--min-lr", "1e-2"}, "--min-lr"},
  };
  for (const auto& c : cases) {
    int code = -1;
    std::string err;
    EXPECT_FALSE(parse(c.args, code, &err).has_value()) << c.args[0];
    EXPECT_EQ(code, 2);
    EXPECT_NE(err.find(c.message), std::string::npos) << "got: " << err;
  }
  int code = -1;
  std::string out;
  EXPECT_FALSE(parse({"--help"}, code, &out).has_value());
  EXPECT_EQ(code, 0);
  EXPECT_NE(out.find("--verify-tp1"), std::string::npos);
}

TEST(TrainRunConfig, PresetDefaultsOverridesAndTpChecks) {
  int code = -1;
  auto o = parse({"--preset", "tiny", "--dim", "64", "--steps", "30"}, code);
  ASSERT_TRUE(o);
  auto c = resolve_run_config(*o, 2);
  EXPECT_EQ(c.model.dim, 64);
  EXPECT_EQ(c.model.n_layers, dtensor::models::DecoderConfig::preset("tiny").n_layers);
  EXPECT_EQ(c.steps, 30);
  EXPECT_EQ(c.stop_at, 30);
  EXPECT_EQ(c.schedule.warmup, 3);
  EXPECT_DOUBLE_EQ(c.schedule.min_lr, c.schedule.lr / 10);
  EXPECT_EQ(c.seq_len, c.model.max_seq_len);
  EXPECT_EQ(c.tp, 2);
  EXPECT_EQ(c.dp, 1);
  EXPECT_NE(c.to_json().find("\"tp\": 2"), std::string::npos);

  // heads split evenly: 3 ranks cannot share 4 heads.
  expect_error({"--preset", "tiny"}, 3, "valid tp degrees");
  expect_error({"--preset", "tiny", "--seq-len", "30"}, 4,
               "sequence length 30 is not divisible by tp=4");
  expect_error({"--preset", "tiny", "--dp", "3"}, 4, "dp_replicate=3 does not divide the 4 ranks");
  expect_error({"--preset", "tiny", "--batch-size", "3", "--dp", "2"}, 2,
               "the batch of 3 rows does not split over dp=2 data-parallel ranks");
  expect_error({"--preset", "tiny", "--warmup", "50"}, 1, "--warmup 50 is longer than the run");
  // --overlap-comm overlaps the built-in plan's sequence-parallel collectives only.
  expect_error({"--preset", "tiny", "--overlap-comm", "--no-sequence-parallel"}, 2,
               "overlap_comm overlaps the built-in plan's sequence-parallel all-gathers and "
               "reduce-scatters, so it needs sequence_parallel=true");
  {
    auto overlap = parse({"--preset", "tiny", "--overlap-comm"}, code);
    ASSERT_TRUE(overlap);
    EXPECT_TRUE(resolve_run_config(*overlap, 2).overlap_comm);
    EXPECT_FALSE(resolve_run_config(*o, 2).overlap_comm);
  }
  // --dropout: a probability below 1, keyed by whole sequences (no sequence parallelism).
  expect_error({"--preset", "tiny", "--dropout", "1"}, 1, "--dropout 1: a probability below 1");
  expect_error({"--preset", "tiny", "--dropout", "0.1"}, 2,
               "residual dropout keys its masks by whole sequences, but sequence parallelism "
               "gives each rank a slice of them");
  {
    auto dropping = parse({"--preset", "tiny", "--dropout", "0.1", "--no-sequence-parallel"}, code);
    ASSERT_TRUE(dropping);
    EXPECT_EQ(resolve_run_config(*dropping, 2).model.dropout, 0.1);
    EXPECT_NE(resolve_run_config(*dropping, 2).to_json().find("\"dropout\":0.1"),
              std::string::npos);
  }
  TempDir dir;
  std::ofstream(dir.file("bad.json")) << "{\"dimm\": 3}";
  expect_error({"--config", dir.file("bad.json")}, 1, "dimm");
}

TEST(TrainPlanFile, TheShippedPlanParsesInFileOrder) {
  int code = -1;
  const std::string path = std::string(DTENSOR_TRAIN_PLANS) + "/llama_tp.json";
  auto o = parse({"--plan", path}, code);
  ASSERT_TRUE(o.has_value());
  EXPECT_EQ(o->plan_path, path);
  const PlanFile file = read_plan_file(o->plan_path);
  ASSERT_EQ(file.plan.size(), 14u);
  EXPECT_EQ(file.plan.front().first, "tok_embeddings");
  EXPECT_EQ(file.plan[2].first, "output");
  EXPECT_EQ(file.plan.back().first, "layers.*.feed_forward.w3");
  EXPECT_TRUE(file.sequence_parallel);
  // What a style prints reads back to the same style.
  for (const auto& [key, style] : file.plan) {
    EXPECT_EQ(dtensor::tp::parse_style(style.repr()).repr(), style.repr()) << key;
  }
  const auto config = resolve_run_config(*o, 2);
  ASSERT_TRUE(config.plan.has_value());
  EXPECT_EQ(config.plan->plan.size(), 14u);
}

// --pp N --schedule S --microbatches M: world = pp x tp; combinations the pipeline trainer does
// not implement are refused naming the option.
TEST(TrainRunConfig, ContextParallelLayoutAndRefusals) {
  int code = -1;
  auto o = parse({"--preset", "tiny", "--cp", "2", "--cp-rotate", "allgather", "--pack-documents",
                  "--seq-len", "32"},
                 code);
  ASSERT_TRUE(o);
  const RunConfig c = resolve_run_config(*o, 4);
  EXPECT_EQ(c.cp, 2);
  EXPECT_EQ(c.tp, 2);
  EXPECT_EQ(c.cp_rotate, "all_gather");
  EXPECT_TRUE(c.pack_documents);
  EXPECT_EQ(c.parallel_dims().cp, 2);
  EXPECT_NE(c.to_json().find("\"cp\": 2, \"cp_rotate\": \"all_gather\""), std::string::npos);
  expect_error({"--preset", "tiny", "--cp", "4", "--seq-len", "3"}, 4,
               "the sequence of 3 tokens is shorter than cp=4");
  expect_error({"--preset", "tiny", "--cp-rotate", "ring"}, 2, "--cp-rotate says how");
  expect_error({"--preset", "tiny", "--pack-documents"}, 2, "--pack-documents attends within");
  expect_error({"--preset", "tiny", "--cp", "2", "--dp", "2"}, 4,
               "context parallelism (cp=2) with dp_replicate=2 x cp=2 is not built yet");
  expect_error({"--preset", "tiny", "--cp", "2", "--dp-shard", "2"}, 4,
               "--cp with --dp-shard is not built into dtensor_train yet");
  expect_error({"--preset", "tiny-moe", "--cp", "2"}, 2,
               "context parallelism (cp=2) with mixture-of-experts layers is not built yet");
  expect_error({"--preset", "tiny", "--cp", "2", "--seq-len", "36"}, 4,
               "needs a sequence length divisible by 2 x cp x tp = 8");
  expect_error({"--preset", "tiny", "--cp", "2", "--pack-documents", "--verify-tp1"}, 2,
               "--verify-tp1 runs plain attention on one device");
}

TEST(TrainRunConfig, PipelineLayoutAndRefusals) {
  int code = -1;
  auto o =
      parse({"--preset", "tiny", "--pp", "2", "--schedule", "gpipe", "--microbatches", "4"}, code);
  ASSERT_TRUE(o);
  auto c = resolve_run_config(*o, 4);
  EXPECT_EQ(c.pp, 2);
  EXPECT_EQ(c.tp, 2);
  EXPECT_EQ(c.dp, 1);
  EXPECT_EQ(c.pp_schedule, "gpipe");
  EXPECT_EQ(c.microbatches, 4);
  EXPECT_FALSE(c.sequence_parallel);  // activations cross the stages replicated
  EXPECT_DOUBLE_EQ(c.bubble_formula(), 1.0 / 5);
  EXPECT_NE(c.to_json().find("\"pp\": 2, \"pp_schedule\": \"gpipe\", \"microbatches\": 4"),
            std::string::npos)
      << c.to_json();
  // Defaults: 1F1B with as many micro-batches as stages.
  o = parse({"--preset", "tiny", "--pp", "2"}, code);
  ASSERT_TRUE(o);
  c = resolve_run_config(*o, 2);
  EXPECT_EQ(c.pp_schedule, "1f1b");
  EXPECT_EQ(c.microbatches, 2);
  EXPECT_EQ(c.tp, 1);

  // With --dp-shard: a pp x dp_shard x tp mesh.
  o = parse({"--preset", "tiny", "--pp", "2", "--dp-shard", "2"}, code);
  ASSERT_TRUE(o);
  c = resolve_run_config(*o, 8);
  EXPECT_EQ(c.pp, 2);
  EXPECT_EQ(c.dp, 2);
  EXPECT_TRUE(c.fsdp);
  EXPECT_EQ(c.tp, 2);
  // With --dp: a pp x dp x tp mesh, the stages replicated (built: parity in the library's
  // tests/models/test_transformer_stage.cpp).
  o = parse({"--preset", "tiny", "--pp", "2", "--dp", "2"}, code);
  ASSERT_TRUE(o);
  c = resolve_run_config(*o, 4);
  EXPECT_EQ(c.pp, 2);
  EXPECT_EQ(c.dp, 2);
  EXPECT_FALSE(c.fsdp);
  EXPECT_EQ(c.tp, 1);
  expect_error({"--preset", "tiny", "--pp", "2", "--dp-shard", "3"}, 8,
               "pp=2 x dp_shard=3 = 6 does not divide the 8 ranks");
  expect_error({"--preset", "tiny", "--pp", "2", "--microbatches", "3"}, 2,
               "the batch of 4 rows does not split into microbatches=3 equal micro-batches");
  expect_error({"--preset", "tiny", "--pp", "4"}, 4, "the model has 2 layers");
  expect_error({"--preset", "tiny", "--pp", "3"}, 4, "pp=3 does not divide the 4 ranks");
  expect_error({"--preset", "tiny", "--pp", "2", "--plan",
                std::string(DTENSOR_TRAIN_PLANS) + "/llama_tp.json"},
               2, "a custom tensor-parallel plan (tp_plan) does not apply to pipeline parallelism");
  expect_error({"--preset", "tiny", "--pp", "2", "--overlap-comm"}, 2,
               "overlap_comm does not apply to pipeline parallelism (pp=2)");
  expect_error({"--preset", "tiny", "--microbatches", "2"}, 2, "add --pp N");
  // Interleaved: v stages per rank (default 2), the formula (pp - 1) / (v M + pp - 1).
  o = parse({"--preset", "tiny", "--layers", "4", "--pp", "2", "--schedule", "interleaved",
             "--microbatches", "4"},
            code);
  ASSERT_TRUE(o);
  c = resolve_run_config(*o, 2);
  EXPECT_EQ(c.pp_schedule, "interleaved");
  EXPECT_EQ(c.virtual_stages, 2);
  EXPECT_DOUBLE_EQ(c.bubble_formula(), 1.0 / 9);
  EXPECT_EQ(one_device(c).virtual_stages, 1);
  expect_error({"--preset", "tiny", "--pp", "2", "--schedule", "interleaved"}, 2,
               "the model has 2 layers for 4 stages (virtual_stages=2)");
  expect_error({"--preset", "tiny", "--pp", "2", "--virtual-stages", "2"}, 2,
               "--virtual-stages applies to --schedule interleaved");
  expect_error({"--preset", "tiny", "--layers", "4", "--pp", "2", "--schedule", "interleaved",
                "--batch-size", "10", "--microbatches", "5"},
               2, "use microbatches a multiple of 2 or below 4");
  EXPECT_FALSE(parse({"--pp", "2", "--schedule", "zigzag"}, code));
  EXPECT_EQ(code, 2);
}

TEST(TrainProgress, ShowsTheMeasuredBubbleNextToTheFormula) {
  ProgressState s{3, 10, 2.5, 1000, 1e-3, 5};
  EXPECT_EQ(format_progress(s).find("bubble"), std::string::npos);
  s.bubble = 0.3125;
  s.bubble_formula = 1.0 / 3;
  const std::string line = format_progress(s);
  EXPECT_NE(line.find("bubble 31% (formula 33%)"), std::string::npos) << line;
}
