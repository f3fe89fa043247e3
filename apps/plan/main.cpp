// dtensor_plan: will a training layout fit, which collectives will it issue, how long will a
// step take? It simulates one rank of each distinct class of the layout's world on the meta
// device, through the same Trainer dtensor_train runs. See --help and docs/PLANNING.md.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <iomanip>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "common/cli.h"
#include "dtensor/models/hf_checkpoint.h"
#include "dtensor/util/error_message.h"
#include "estimate.h"
#include "published_models.h"

namespace {

using dtensor::plan::Hardware;
using dtensor::plan::Layout;
using dtensor::plan::Plan;

const char* const kUsage = R"help(usage: dtensor_plan [options]

Plans a training run (of a preset, a config or a Hugging Face config.json) before launching it:
builds the model on the meta device (no weights, no memory), applies the layout with the same
calls dtensor_train makes (apply_tensor_parallel, apply_ac, fully_shard, pipeline stages and
schedule) and runs one training step as one representative rank of each distinct class (each
pipeline stage) of a simulated world, whose collectives complete at once and are recorded.
Prints the layout's validity (with the fix), memory per rank, every collective of a step per
(op, mesh dim, phase), and an estimated step time. See docs/PLANNING.md for the model and what
is not simulated.

Model (one of):
  --model NAME           llama3-8b | llama3-70b | llama3-405b (Meta's shapes), or the
                         mixtures of experts qwen3-30b-a3b | qwen3-235b-a22b | mixtral-8x7b |
                         gpt-oss-120b (their published config.json; routing taken as
                         uniform: the meta device has no router values), or
  --preset NAME          dtensor_train's presets: tiny | demo | bench (default demo)
  --config PATH          a DecoderConfig JSON file (as dtensor_train --config)
  --hf-config PATH       a Hugging Face config.json (or its folder); no weights are read
  --seq-len N            sequence length (default: the model's)
  --batch N              global batch in sequences (default: dp x microbatches)

Layout (as dtensor_train takes it):
  --world-size N         ranks (default: tp x dp x pp)
  --tp N                 tensor parallel degree (default: world / (dp x pp))
  --dp-shard N           FSDP degree (fully_shard over N ranks)
  --dp N                 plain data parallel degree
  --pp N                 pipeline stages
  --schedule S           gpipe | 1f1b | interleaved (default 1f1b)
  --virtual-stages V     stages per rank with --schedule interleaved (default 2)
  --microbatches M       per step (default pp)
  --ac MODE              none | full | selective (default none)
  --ac-recompute-collectives
                         the recompute issues the TP collectives again (as dtensor_train)
  --mixed-precision P    none | bf16 (FSDP: bfloat16 compute, float32 reduce)
  --dtype T              float32 | float64 (parameters; default float32)
  --no-sequence-parallel
  --plan PATH            a TP plan file instead of the built-in one (as dtensor_train --plan)
  --search               rank every valid (dp, tp, pp) split of --world-size instead
  --compare-ac           also simulate the layout without activation checkpointing (with
                         --ac full when --ac none) and print both peaks

Hardware (the estimate's constants; defaults: H100 SXM, NVLink 4 inside a node of 8,
InfiniBand NDR 400 Gb/s per GPU across nodes):
  --device-memory GIB    memory per GPU (default 80); a plan over it is refused
  --bf16-tflops X        dense bfloat16 peak (default 989)
  --fp32-tflops X        dense TF32 peak for float32 runs (default 494)
  --mfu LOW,HIGH         achieved share of peak, the estimate's range (default 0.3,0.5)
  --intra-gbps X         NVLink bandwidth per GPU in GB/s (default 450)
  --inter-gbps X         InfiniBand bandwidth per GPU in GB/s (default 50)
  --intra-latency-us X   (default 3)
  --inter-latency-us X   (default 10)
  --gpus-per-node N      (default 8)

Output:
  --json                 the plan as JSON on stdout
  --progress MODE        auto | bar | none (auto: a bar on a terminal after 1 s)
  -h, --help             print this help

Exit status: 0 valid, 3 refused (the reasons and their fixes are printed), 2 usage error.
)help";

struct Cli {
  Layout layout;
  Hardware hw;
  std::string model, hf_config;
  std::optional<int64_t> world_size, batch, tp;
  std::string mfu = "0.3,0.5";
  bool json = false, search = false, no_sp = false, compare_ac = false;
  std::string progress = "auto";
};

// Meta's published shapes of Llama 3 / 3.1 (params.json): dim, layers, heads, KV heads, FFN.
void apply_model(const std::string& name, dtensor::train::TrainOptions& o) {
  struct Shape {
    int64_t dim, layers, heads, kv, ffn, vocab;
  };
  Shape s{};
  if (name == "llama3-8b")
    s = {4096, 32, 32, 8, 14336, 128256};
  else if (name == "llama3-70b")
    s = {8192, 80, 64, 8, 28672, 128256};
  else if (name == "llama3-405b")
    s = {16384, 126, 128, 8, 53248, 128256};
  o.dim = s.dim;
  o.layers = s.layers;
  o.heads = s.heads;
  o.kv_heads = s.kv;
  o.ffn_dim = s.ffn;
  o.vocab = s.vocab;
  if (!o.seq_len) o.seq_len = 8192;
}

// The model of a Hugging Face config.json (`path` names the file or its folder).
dtensor::models::DecoderConfig config_from_hf(const std::string& path) {
  namespace fs = std::filesystem;
  const fs::path p(path);
  const std::string dir = fs::is_directory(p) ? p.string() : p.parent_path().string();
  return dtensor::models::read_hf_config(dir.empty() ? "." : dir).config;
}

std::string gib(int64_t bytes) {
  std::ostringstream s;
  s << std::fixed << std::setprecision(2) << static_cast<double>(bytes) / (1 << 30) << " GiB";
  return s.str();
}

std::string human_bytes(int64_t b) {
  std::ostringstream s;
  s << std::fixed << std::setprecision(1);
  const double v = static_cast<double>(b);
  if (v >= 1 << 30)
    s << v / (1 << 30) << " GiB";
  else if (v >= 1 << 20)
    s << v / (1 << 20) << " MiB";
  else if (v >= 1 << 10)
    s << v / (1 << 10) << " KiB";
  else
    s << b << " B";
  return s.str();
}

std::string seconds(double s) {
  std::ostringstream o;
  o << std::fixed << std::setprecision(2);
  if (s >= 1) {
    o << s << " s";
  } else if (s >= 1e-3) {
    o << s * 1e3 << " ms";
  } else {
    o << s * 1e6 << " us";
  }
  return o.str();
}

std::string layout_name(const dtensor::train::RunConfig& c) {
  std::ostringstream s;
  s << (c.fsdp ? "dp_shard " : "dp ") << c.dp << " x tp " << c.tp << " x pp " << c.pp;
  return s.str();
}

nlohmann::ordered_json to_json(const Plan& p) {
  using nlohmann::ordered_json;
  ordered_json j;
  j["valid"] = p.refusals.empty();
  j["refusals"] = p.refusals;
  j["warnings"] = p.warnings;
  if (p.config.world_size > 0 && !p.ranks.empty()) {
    j["layout"] = {{"world_size", p.config.world_size},
                   {"dp", p.config.dp},
                   {"fsdp", p.config.fsdp},
                   {"tp", p.config.tp},
                   {"pp", p.config.pp},
                   {"schedule", p.config.pp_schedule},
                   {"microbatches", p.config.microbatches},
                   {"ac", p.config.ac},
                   {"ac_recompute_collectives", !p.config.ac_replay_collectives},
                   {"mixed_precision", p.config.bf16 ? "bf16" : "none"},
                   {"batch", p.config.batch_size},
                   {"seq_len", p.config.seq_len}};
    j["model"] = nlohmann::json::parse(p.config.model.to_json());
  }
  ordered_json ranks = ordered_json::array();
  for (const auto& r : p.ranks) {
    ordered_json jr;
    jr["rank"] = r.sim.who.rank;
    jr["class"] = r.sim.who.label;
    jr["coordinate"] = r.sim.who.coordinate;
    const auto& st = r.sim.step;
    jr["memory_bytes"] = {{"parameters", st.state.parameters},
                          {"gradients", st.state.gradients},
                          {"optimizer", st.state.optimizer},
                          {"step_start", st.start_bytes},
                          {"forward_backward_peak", st.fb_peak_bytes},
                          {"optimizer_step_peak", st.opt_peak_bytes},
                          {"peak", r.peak_bytes}};
    ordered_json ledger = ordered_json::array();
    for (const auto& row : r.ledger)
      ledger.push_back({{"op", row.op},
                        {"mesh_dim", row.dim},
                        {"phase", row.phase},
                        {"count", row.count},
                        {"bytes", row.bytes},
                        {"seconds", row.seconds}});
    jr["ledger"] = ledger;
    jr["total_count"] = r.total_count;
    jr["total_bytes"] = r.total_bytes;
    jr["flops"] = r.flops;
    jr["comm_exposed_s"] = r.comm_exposed_s;
    jr["comm_overlappable_s"] = r.comm_overlappable_s;
    jr["step_s"] = {r.step_low_s, r.step_high_s};
    ranks.push_back(jr);
  }
  j["ranks"] = ranks;
  j["not_simulated"] = p.not_simulated;
  if (!p.ranks.empty()) {
    j["step_s"] = {p.step_low_s, p.step_high_s};
    j["peak_bytes"] = p.peak_bytes;
  }
  j["simulation_s"] = p.sim_seconds;
  return j;
}

void print_plan(const Plan& p, const Hardware& hw, std::ostream& out) {
  const auto& c = p.config;
  out << "validity: " << (p.refusals.empty() ? "ok" : "REFUSED") << "\n";
  for (const auto& r : p.refusals) out << "  refused: " << r << "\n";
  for (const auto& w : p.warnings) out << "  warning: " << w << "\n";
  if (p.ranks.empty()) return;
  out << "layout: " << c.world_size << " ranks = " << layout_name(c);
  if (c.pp > 1) out << ", " << c.pp_schedule << " with " << c.microbatches << " micro-batches";
  out << ", ac " << c.ac << (c.ac_replay_collectives ? "" : " (collectives re-issued in backward)")
      << (c.bf16 ? ", bf16 mixed precision" : "") << ", batch " << c.batch_size << " x "
      << c.seq_len << " tokens\n";
  out << "model: " << c.model.num_parameters() << " parameters (dim " << c.model.dim << ", "
      << c.model.n_layers << " layers, " << c.model.n_heads << " heads, " << c.model.kv_heads()
      << " KV heads, FFN " << c.model.hidden_dim() << ", vocab " << c.model.vocab_size << ")\n\n";
  out << "memory per rank (the meta device's allocator: bytes of live tensors in a steady-state "
         "step)\n";
  out << "  class           params      grads       AdamW       start       peak        "
         "(peak - start: activations, gathered FSDP buffers, transients)\n";
  for (const auto& r : p.ranks) {
    const auto& s = r.sim.step;
    out << "  " << std::left << std::setw(16) << r.sim.who.label << std::setw(12)
        << gib(s.state.parameters) << std::setw(12) << gib(s.state.gradients) << std::setw(12)
        << gib(s.state.optimizer) << std::setw(12) << gib(s.start_bytes) << std::setw(12)
        << gib(r.peak_bytes) << gib(r.peak_bytes - s.start_bytes) << "\n";
  }
  out << "\ncollectives per step (bytes: this rank's input, CommDebugMode's convention)\n";
  for (const auto& r : p.ranks) {
    out << "  " << r.sim.who.label << " (rank " << r.sim.who.rank << "): " << r.total_count
        << " collectives, " << human_bytes(r.total_bytes) << "\n";
    out << "    op                      dim  phase       count   bytes       est. time\n";
    for (const auto& row : r.ledger) {
      out << "    " << std::left << std::setw(24) << row.op << std::setw(5) << row.dim
          << std::setw(12) << row.phase << std::setw(8) << row.count << std::setw(12)
          << human_bytes(row.bytes) << seconds(row.seconds) << "\n";
    }
  }
  out << "\nnot simulated (they read values; a real step also issues these):\n";
  for (const auto& n : p.not_simulated) out << "  - " << n << "\n";
  out << "\nestimated step time: " << seconds(p.step_low_s) << " .. " << seconds(p.step_high_s)
      << "\n  model: compute = FLOPs / (peak x MFU " << hw.mfu_high << " .. " << hw.mfu_low
      << ") x (M + pp - 1) / M; collectives by ring alpha-beta (NVLink " << hw.intra_gbps
      << " GB/s, " << hw.intra_latency_us << " us inside a node of " << hw.gpus_per_node
      << "; InfiniBand " << hw.inter_gbps << " GB/s, " << hw.inter_latency_us
      << " us across); low: FSDP and pipeline messages hidden under compute, high: nothing "
         "overlapped; TP collectives are never overlapped\n";
  for (const auto& r : p.ranks) {
    out << "  " << std::left << std::setw(16) << r.sim.who.label << std::fixed
        << std::setprecision(1) << r.flops / 1e12 << " TFLOP, exposed comm "
        << seconds(r.comm_exposed_s) << ", overlappable comm " << seconds(r.comm_overlappable_s)
        << ", step " << seconds(r.step_low_s) << " .. " << seconds(r.step_high_s) << "\n";
  }
  out << "\nsimulated " << p.ranks.size() << " representative rank(s) of " << c.world_size << " in "
      << seconds(p.sim_seconds) << "\n";
}

// The command line's options, into `cli` (and its layout's TrainOptions).
void add_options(CLI::App& app, Cli& cli) {
  auto& o = cli.layout.options;
  app.add_option("--model", cli.model)->check(dtensor::cli::one_of([] {
    std::vector<std::string> names = {"llama3-8b", "llama3-70b", "llama3-405b"};
    for (const auto& n : dtensor::plan::published_moe_models()) names.push_back(n);
    return names;
  }()));
  app.add_option("--preset", o.preset)->check(dtensor::cli::one_of({"tiny", "demo", "bench"}));
  app.add_option("--config", o.config_path)->check(dtensor::cli::non_empty());
  app.add_option("--hf-config", cli.hf_config)->check(dtensor::cli::non_empty());
  app.add_option_function<int64_t>("--seq-len", [&](int64_t v) { o.seq_len = v; })
      ->check(dtensor::cli::integer(1));
  app.add_option_function<int64_t>("--batch", [&](int64_t v) { cli.batch = v; })
      ->check(dtensor::cli::integer(1));
  app.add_option_function<int64_t>("--world-size", [&](int64_t v) { cli.world_size = v; })
      ->check(dtensor::cli::integer(1));
  app.add_option_function<int64_t>("--tp", [&](int64_t v) { cli.tp = v; })
      ->check(dtensor::cli::integer(1));
  app.add_option("--dp-shard", o.dp_shard)->check(dtensor::cli::integer(1));
  app.add_option("--dp", o.dp)->check(dtensor::cli::integer(1));
  app.add_option("--pp", o.pp)->check(dtensor::cli::integer(1));
  app.add_option_function<std::string>("--schedule", [&](const std::string& v) { o.schedule = v; })
      ->check(dtensor::cli::one_of({"gpipe", "1f1b", "interleaved"}));
  app.add_option_function<int64_t>("--virtual-stages", [&](int64_t v) { o.virtual_stages = v; })
      ->check(dtensor::cli::integer(1));
  app.add_option_function<int64_t>("--microbatches", [&](int64_t v) { o.microbatches = v; })
      ->check(dtensor::cli::integer(1));
  app.add_option("--ac", o.ac)->check(dtensor::cli::one_of({"none", "full", "selective"}));
  app.add_flag("--ac-recompute-collectives", o.ac_recompute_collectives);
  app.add_option("--mixed-precision", o.mixed_precision)
      ->check(dtensor::cli::one_of({"none", "bf16"}));
  app.add_option("--dtype", o.dtype)->check(dtensor::cli::one_of({"float32", "float64"}));
  app.add_flag("--no-sequence-parallel", cli.no_sp);
  app.add_option("--plan", o.plan_path)->check(dtensor::cli::non_empty());
  app.add_flag("--search", cli.search);
  app.add_flag("--compare-ac", cli.compare_ac);
  app.add_option("--device-memory", cli.hw.device_memory_gib)
      ->check(dtensor::cli::number(0, 1e9, true));
  app.add_option("--bf16-tflops", cli.hw.bf16_tflops)->check(dtensor::cli::number(0, 1e9, true));
  app.add_option("--fp32-tflops", cli.hw.fp32_tflops)->check(dtensor::cli::number(0, 1e9, true));
  app.add_option("--mfu", cli.mfu);
  app.add_option("--intra-gbps", cli.hw.intra_gbps)->check(dtensor::cli::number(0, 1e9, true));
  app.add_option("--inter-gbps", cli.hw.inter_gbps)->check(dtensor::cli::number(0, 1e9, true));
  app.add_option("--intra-latency-us", cli.hw.intra_latency_us)->check(dtensor::cli::number(0));
  app.add_option("--inter-latency-us", cli.hw.inter_latency_us)->check(dtensor::cli::number(0));
  app.add_option("--gpus-per-node", cli.hw.gpus_per_node)->check(dtensor::cli::integer(1));
  app.add_flag("--json", cli.json);
  app.add_option("--progress", cli.progress)->check(dtensor::cli::one_of({"auto", "bar", "none"}));
}

// --mfu LOW,HIGH into the hardware's range; an error message for a bad value.
std::optional<std::string> parse_mfu(Cli& cli) {
  const auto comma = cli.mfu.find(',');
  try {
    cli.hw.mfu_low = std::stod(cli.mfu.substr(0, comma));
    cli.hw.mfu_high =
        comma == std::string::npos ? cli.hw.mfu_low : std::stod(cli.mfu.substr(comma + 1));
  } catch (...) {
    return "--mfu expects LOW,HIGH, got '" + cli.mfu + "'";
  }
  if (!(cli.hw.mfu_low > 0 && cli.hw.mfu_low <= cli.hw.mfu_high && cli.hw.mfu_high <= 1))
    return "--mfu expects 0 < LOW <= HIGH <= 1, got '" + cli.mfu + "'";
  return std::nullopt;
}

// The layout of `cli` split dp x tp x pp.
Layout layout_for(const Cli& cli, int64_t dp, int64_t tp, int64_t pp) {
  const auto& o = cli.layout.options;
  Layout l = cli.layout;
  l.world_size = dp * tp * pp;
  l.tp = tp;
  l.options.pp = pp;
  if (o.dp > 1 && o.dp_shard == 1) {
    l.options.dp = dp;
  } else {
    l.options.dp_shard = dp;
    l.options.dp = 1;
  }
  if (pp == 1) {
    l.options.schedule.reset();
    l.options.virtual_stages.reset();
    l.options.microbatches.reset();
  }
  const int64_t m = l.options.microbatches.value_or(pp);
  l.options.batch_size = cli.batch.value_or(dp * m);
  return l;
}

// The layouts to plan: every split of --world-size with --search, else the one given.
std::vector<Layout> layouts_of(const Cli& cli) {
  const auto& o = cli.layout.options;
  std::vector<Layout> layouts;
  if (cli.search) {
    for (auto [dp, tp, pp] : dtensor::plan::splits_of(*cli.world_size)) {
      Layout l = layout_for(cli, dp, tp, pp);
      // FSDP's mixed precision applies to the splits that shard; the others search in float32.
      if (dp == 1 && l.options.mixed_precision == "bf16") l.options.mixed_precision = "none";
      layouts.push_back(l);
    }
    return layouts;
  }
  const int64_t dp = o.dp * o.dp_shard;
  const int64_t pp = o.pp;
  const int64_t world = cli.world_size.value_or(cli.tp.value_or(1) * dp * pp);
  const int64_t tp = cli.tp.value_or(world / std::max<int64_t>(1, dp * pp));
  Layout l = layout_for(cli, dp, tp, pp);
  // Both data-parallel degrees as given (layout_for folds them into one, for --search): the
  // library refuses what it does not compose in the trainer's words.
  l.options.dp = o.dp;
  l.options.dp_shard = o.dp_shard;
  l.world_size = world;
  l.tp = cli.tp;
  layouts.push_back(l);
  return layouts;
}

// One plan per layout, with a progress bar on stderr (--progress) once it takes a second.
std::vector<Plan> plan_all(const Cli& cli, const std::vector<Layout>& layouts) {
  const bool tty = ::isatty(STDERR_FILENO);
  const bool bar = cli.progress == "bar" || (cli.progress == "auto" && tty);
  const auto start = std::chrono::steady_clock::now();
  int64_t layouts_done = 0;
  auto progress = [&](int64_t done, int64_t total, const std::string& label) {
    const double t =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (!bar || t < 1.0) return;
    const int width = 30;
    const int filled = static_cast<int>(width * done / std::max<int64_t>(1, total));
    std::cerr << "\r[" << std::string(filled, '#') << std::string(width - filled, '.') << "] "
              << "layout " << layouts_done + 1 << "/" << layouts.size() << ", " << label
              << " simulated (" << done << "/" << total << "), " << std::fixed
              << std::setprecision(1) << t << " s   " << std::flush;
  };
  std::vector<Plan> plans;
  for (const Layout& l : layouts) {
    plans.push_back(dtensor::plan::make_plan(l, cli.hw, progress));
    ++layouts_done;
  }
  if (bar && std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() >= 1.0)
    std::cerr << "\n";
  return plans;
}

// --search: the valid splits, fastest first, then the refused ones with their first reason.
int report_search(const Cli& cli, const std::vector<Layout>& layouts,
                  const std::vector<Plan>& plans) {
  std::vector<const Plan*> valid;
  for (const auto& p : plans)
    if (p.refusals.empty()) valid.push_back(&p);
  std::stable_sort(valid.begin(), valid.end(),
                   [](const Plan* a, const Plan* b) { return a->step_high_s < b->step_high_s; });
  if (cli.json) {
    nlohmann::ordered_json j = nlohmann::ordered_json::array();
    for (const auto* p : valid) j.push_back(to_json(*p));
    for (const auto& p : plans)
      if (!p.refusals.empty()) j.push_back(to_json(p));
    std::cout << j.dump(2) << "\n";
  } else {
    std::cout << "valid splits of " << *cli.world_size << " ranks, fastest first (step time "
              << "range; peak memory per rank):\n";
    int i = 0;
    for (const auto* p : valid)
      std::cout << "  " << ++i << ". " << std::left << std::setw(32) << layout_name(p->config)
                << seconds(p->step_low_s) << " .. " << seconds(p->step_high_s) << "   "
                << gib(p->peak_bytes) << "\n";
    std::cout << "refused:\n";
    for (size_t k = 0; k < plans.size(); ++k) {
      if (plans[k].refusals.empty()) continue;
      const Layout& l = layouts[k];
      std::cout << "  dp " << std::max(l.options.dp, l.options.dp_shard) << " x tp "
                << l.tp.value_or(0) << " x pp " << l.options.pp << ": " << plans[k].refusals.front()
                << "\n";
    }
  }
  return valid.empty() ? 3 : 0;
}

// One layout's plan, and with --compare-ac the peaks of the same layout with the other AC mode.
int report_one(const Cli& cli, const Layout& layout, const Plan& p) {
  std::optional<Plan> other;
  if (cli.compare_ac) {
    Layout l = layout;
    l.options.ac = l.options.ac == "none" ? "full" : "none";
    other = dtensor::plan::make_plan(l, cli.hw);
  }
  if (cli.json) {
    auto j = to_json(p);
    if (other) j["compare_ac"] = to_json(*other);
    std::cout << j.dump(2) << "\n";
  } else {
    print_plan(p, cli.hw, std::cout);
    if (other && !other->ranks.empty()) {
      std::cout << "\npeak per rank with --ac " << p.config.ac << " vs --ac " << other->config.ac
                << ":\n";
      for (size_t i = 0; i < p.ranks.size() && i < other->ranks.size(); ++i)
        std::cout << "  " << std::left << std::setw(16) << p.ranks[i].sim.who.label
                  << gib(p.ranks[i].peak_bytes) << " vs " << gib(other->ranks[i].peak_bytes)
                  << "\n";
    } else if (other) {
      std::cout << "\n--ac " << other->config.ac << ": "
                << (other->refusals.empty() ? "" : other->refusals.front()) << "\n";
    }
  }
  return p.refusals.empty() ? 0 : 3;
}

}  // namespace

int main(int argc, char** argv) {
  Cli cli;
  auto& o = cli.layout.options;
  o.ac = "none";
  CLI::App app("dtensor_plan");
  add_options(app, cli);
  if (auto code = dtensor::cli::parse(app, argc, argv, kUsage)) return *code;
  if (auto bad = parse_mfu(cli)) return dtensor::cli::usage_error(app, *bad);
  try {
    if (cli.model.rfind("llama3-", 0) == 0) {
      apply_model(cli.model, o);
    } else if (!cli.model.empty()) {
      o.model_config = dtensor::plan::published_moe_model(cli.model);
      if (!o.seq_len) o.seq_len = 4096;
    }
    if (!cli.hf_config.empty()) o.model_config = config_from_hf(cli.hf_config);
  } catch (const std::exception& e) {
    std::cerr << "dtensor_plan: " << dtensor::util::error_message(e) << "\n";
    return 2;
  }
  o.sequence_parallel = !cli.no_sp;
  o.grad_clip = 1.0;
  if (cli.search && !cli.world_size)
    return dtensor::cli::usage_error(app, "--search needs --world-size N");
  const std::vector<Layout> layouts = layouts_of(cli);
  const std::vector<Plan> plans = plan_all(cli, layouts);
  return cli.search ? report_search(cli, layouts, plans)
                    : report_one(cli, layouts.front(), plans.front());
}
