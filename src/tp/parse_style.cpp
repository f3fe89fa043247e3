// Text form of styles: a small recursive-descent reader for the Python call syntax.
#include "dtensor/tp/parse_style.h"

#include <c10/util/Exception.h>

#include <cctype>
#include <functional>
#include <map>
#include <set>

#include "dtensor/tp/compat.h"
#include "dtensor/tp/styles.h"

namespace dtensor::tp {
namespace {

struct Value {
  enum class Kind { None, Bool, Int, Placement, Tuple, Dict } kind = Kind::None;
  bool b = false;
  int64_t i = 0;
  dtensor::Placement p;
  std::vector<Value> items;                            // Tuple
  std::vector<std::pair<std::string, Value>> entries;  // Dict
  std::string text;                                    // the source, for messages
};

class Parser {
 public:
  explicit Parser(std::string_view text) : text_(text) {}

  Style style() {
    const std::string name = identifier("a style name such as ColwiseParallel");
    expect('(');
    std::vector<std::pair<std::string, Value>> args;
    skip_space();
    while (peek() != ')') {
      const std::string arg = identifier("an argument name");
      expect('=');
      args.emplace_back(arg, value());
      if (!accept(',')) break;
      skip_space();
    }
    expect(')');
    end();
    return build(name, args);
  }

  Placement placement_only() {
    Value v = value();
    end();
    if (v.kind != Value::Kind::Placement) fail_at(0, "expected a placement", kPlacementForms);
    return v.p;
  }

 private:
  static constexpr const char* kPlacementForms =
      "Shard(<dim>), Replicate() or Partial([sum|avg|max|min])";

  [[noreturn]] void fail_at(size_t pos, const std::string& what,
                            const std::string& expected) const {
    TORCH_CHECK(false, "parse_style: ", what, " at position ", pos, " of \"", text_, "\"",
                expected.empty() ? "" : "; expected " + expected);
  }

  void skip_space() {
    while (pos_ < text_.size() && std::isspace(static_cast<unsigned char>(text_[pos_]))) ++pos_;
  }
  char peek() {
    skip_space();
    return pos_ < text_.size() ? text_[pos_] : '\0';
  }
  bool accept(char c) {
    if (peek() != c) return false;
    ++pos_;
    return true;
  }
  void expect(char c) {
    if (!accept(c)) {
      fail_at(pos_,
              pos_ < text_.size() ? "unexpected '" + std::string(1, text_[pos_]) + "'"
                                  : std::string("unexpected end"),
              "'" + std::string(1, c) + "'");
    }
  }
  void end() {
    if (peek() != '\0') fail_at(pos_, "unexpected text after the end", "");
  }

  std::string identifier(const std::string& what) {
    skip_space();
    const size_t start = pos_;
    while (pos_ < text_.size() &&
           (std::isalnum(static_cast<unsigned char>(text_[pos_])) || text_[pos_] == '_'))
      ++pos_;
    if (pos_ == start || std::isdigit(static_cast<unsigned char>(text_[start])))
      fail_at(start, "missing name", what);
    return std::string(text_.substr(start, pos_ - start));
  }

  int64_t integer() {
    skip_space();
    const size_t start = pos_;
    if (pos_ < text_.size() && (text_[pos_] == '-' || text_[pos_] == '+')) ++pos_;
    const size_t digits = pos_;
    while (pos_ < text_.size() && std::isdigit(static_cast<unsigned char>(text_[pos_]))) ++pos_;
    if (pos_ == digits) fail_at(start, "not an integer", "an integer");
    return std::stoll(std::string(text_.substr(start, pos_ - start)));
  }

  std::string quoted_or_name(const std::string& what) {
    const char q = peek();
    if (q != '\'' && q != '"') return identifier(what);
    const size_t start = ++pos_;
    while (pos_ < text_.size() && text_[pos_] != q) ++pos_;
    if (pos_ >= text_.size()) fail_at(start - 1, "unterminated string", "a closing quote");
    return std::string(text_.substr(start, pos_++ - start));
  }

  Value value() {
    const size_t start = (skip_space(), pos_);
    Value v = value_body();
    v.text = std::string(text_.substr(start, pos_ - start));
    return v;
  }

  Value value_body() {
    const char c = peek();
    Value v;
    if (c == '(' || c == '[') {
      const char close = c == '(' ? ')' : ']';
      ++pos_;
      bool comma = false;
      while (peek() != close) {
        v.items.push_back(value());
        if (!accept(',')) break;
        comma = true;
      }
      expect(close);
      // "(x)" is x itself, as in Python; "(x,)" and "[x]" are sequences.
      if (c == '(' && v.items.size() == 1 && !comma) return v.items[0];
      v.kind = Value::Kind::Tuple;
      return v;
    }
    if (c == '{') {
      ++pos_;
      while (peek() != '}') {
        std::string key = quoted_or_name("a keyword argument name");
        expect(':');
        v.entries.emplace_back(std::move(key), value());
        if (!accept(',')) break;
      }
      expect('}');
      v.kind = Value::Kind::Dict;
      return v;
    }
    if (c == '-' || c == '+' || std::isdigit(static_cast<unsigned char>(c))) {
      v.kind = Value::Kind::Int;
      v.i = integer();
      return v;
    }
    const size_t start = pos_;
    const std::string word = identifier("a value (None, True, False, a number or a placement)");
    if (word == "None") return v;
    if (word == "True" || word == "true" || word == "False" || word == "false") {
      v.kind = Value::Kind::Bool;
      v.b = word == "True" || word == "true";
      return v;
    }
    v.kind = Value::Kind::Placement;
    v.p = placement(word, start);
    return v;
  }

  Placement placement(const std::string& word, size_t start) {
    auto bad = [&](const std::string& what) { fail_at(start, what, kPlacementForms); };
    if (word == "R") return Replicate();
    if (word == "P" && peek() != '(') return Partial();
    if (word == "Replicate") {
      if (!accept('(') || !accept(')')) bad("bad placement Replicate (write Replicate())");
      return Replicate();
    }
    if (word == "Shard" || word == "S") {
      if (!accept('(')) bad("bad placement " + word + " (missing the dim)");
      skip_space();
      if (text_.substr(pos_, 3) == "dim") {
        pos_ += 3;
        if (!accept('=')) bad("bad placement " + word);
      }
      skip_space();
      if (pos_ >= text_.size() ||
          !(std::isdigit(static_cast<unsigned char>(text_[pos_])) || text_[pos_] == '-'))
        bad("bad placement " + word + ": the dim must be an integer");
      const int64_t dim = integer();
      if (!accept(')')) bad("bad placement " + word + ": the dim must be an integer");
      return Shard(dim);
    }
    if (word == "Partial" || word == "P") {
      if (!accept('(')) bad("bad placement Partial (write Partial())");
      ReduceOp op = ReduceOp::Sum;
      if (peek() != ')') {
        std::string name = quoted_or_name("a reduce op");
        if (name == "reduce_op" && accept('=')) name = quoted_or_name("a reduce op");
        static const std::map<std::string, ReduceOp> ops = {{"sum", ReduceOp::Sum},
                                                            {"avg", ReduceOp::Avg},
                                                            {"max", ReduceOp::Max},
                                                            {"min", ReduceOp::Min},
                                                            {"product", ReduceOp::Product}};
        auto it = ops.find(name);
        if (it == ops.end()) bad("bad placement Partial: unknown reduce op '" + name + "'");
        op = it->second;
      }
      if (!accept(')')) bad("bad placement Partial");
      return Partial(op);
    }
    fail_at(start, "unknown value '" + word + "'", kPlacementForms);
  }

  // ---- from arguments to a style ----

  [[noreturn]] static void bad_arg(const std::string& style, const std::string& arg, const Value& v,
                                   const std::string& expected) {
    TORCH_CHECK(false, "parse_style: ", style, " argument ", arg, "=", v.text, " is not ",
                expected);
  }
  static bool as_bool(const std::string& style, const std::string& arg, const Value& v) {
    if (v.kind != Value::Kind::Bool) bad_arg(style, arg, v, "True or False");
    return v.b;
  }
  static int64_t as_int(const std::string& style, const std::string& arg, const Value& v) {
    if (v.kind != Value::Kind::Int) bad_arg(style, arg, v, "an integer");
    return v.i;
  }
  static std::optional<Placement> as_layout_or_none(const std::string& style,
                                                    const std::string& arg, const Value& v) {
    if (v.kind == Value::Kind::None) return std::nullopt;
    if (v.kind == Value::Kind::Placement) return v.p;
    bad_arg(style, arg, v, "a placement or None");
  }
  // Colwise/Rowwise take one placement (PyTorch prints it as a 1-tuple).
  static std::optional<Placement> as_single(const std::string& style, const std::string& arg,
                                            const Value& v) {
    if (v.kind == Value::Kind::Tuple && v.items.size() == 1 &&
        v.items[0].kind == Value::Kind::Placement)
      return v.items[0].p;
    if (v.kind == Value::Kind::None || v.kind == Value::Kind::Placement)
      return as_layout_or_none(style, arg, v);
    bad_arg(style, arg, v, "a placement (or a 1-tuple of one)");
  }
  static Layouts as_layouts(const std::string& style, const std::string& arg, const Value& v) {
    if (v.kind == Value::Kind::Placement) return {v.p};
    if (v.kind != Value::Kind::Tuple)
      bad_arg(style, arg, v, "a placement or a tuple of placements/None");
    Layouts out;
    for (const Value& item : v.items) out.push_back(as_layout_or_none(style, arg, item));
    return out;
  }
  static std::optional<Layouts> as_optional_layouts(const std::string& style,
                                                    const std::string& arg, const Value& v) {
    if (v.kind == Value::Kind::None) return std::nullopt;
    return as_layouts(style, arg, v);
  }
  static std::optional<KwargLayouts> as_kwarg_layouts(const std::string& style,
                                                      const std::string& arg, const Value& v) {
    if (v.kind == Value::Kind::None) return std::nullopt;
    if (v.kind != Value::Kind::Dict) bad_arg(style, arg, v, "a dict {'name': placement}");
    KwargLayouts out;
    for (const auto& [key, item] : v.entries) out[key] = as_layout_or_none(style, arg, item);
    return out;
  }

  static Style build(const std::string& name,
                     const std::vector<std::pair<std::string, Value>>& args) {
    // Per argument name: stores its value (the name is passed on for error messages).
    std::map<std::string, std::function<void(const std::string&, const Value&)>> setters;
    std::function<Style()> make;
    std::vector<std::string> required;

    ColwiseParallelOptions colwise;
    RowwiseParallelOptions rowwise;
    SequenceParallelOptions sequence;
    PrepareModuleInputOutputOptions prepare;  // the superset of the three Prepare* styles
    bool use_local_input_output = false;      // PrepareModuleInput's use_local_output

    const std::string& s = name;
    if (name == "ColwiseParallel" || name == "RowwiseParallel") {
      const bool col = name == "ColwiseParallel";
      setters["input_layouts"] = [&](const std::string& arg, const Value& v) {
        (col ? colwise.input_layouts : rowwise.input_layouts) = as_single(s, arg, v);
      };
      setters["output_layouts"] = [&](const std::string& arg, const Value& v) {
        (col ? colwise.output_layouts : rowwise.output_layouts) = as_single(s, arg, v);
      };
      setters["use_local_output"] = [&](const std::string& arg, const Value& v) {
        (col ? colwise.use_local_output : rowwise.use_local_output) = as_bool(s, arg, v);
      };
      make = [&, col]() -> Style {
        if (col) return ColwiseParallel(colwise);
        return RowwiseParallel(rowwise);
      };
    } else if (name == "SequenceParallel") {
      setters["sequence_dim"] = [&](const std::string& arg, const Value& v) {
        sequence.sequence_dim = as_int(s, arg, v);
      };
      setters["use_local_output"] = [&](const std::string& arg, const Value& v) {
        sequence.use_local_output = as_bool(s, arg, v);
      };
      make = [&]() -> Style { return SequenceParallel(sequence); };
    } else if (name == "PrepareModuleInput" || name == "PrepareModuleInputOutput" ||
               name == "PrepareModuleOutput") {
      const bool in = name != "PrepareModuleOutput";
      const bool out = name != "PrepareModuleInput";
      if (in) {
        setters["input_layouts"] = [&](const std::string& arg, const Value& v) {
          prepare.input_layouts = as_optional_layouts(s, arg, v);
        };
        setters["desired_input_layouts"] = [&](const std::string& arg, const Value& v) {
          prepare.desired_input_layouts = as_optional_layouts(s, arg, v);
        };
        setters["input_kwarg_layouts"] = [&](const std::string& arg, const Value& v) {
          prepare.input_kwarg_layouts = as_kwarg_layouts(s, arg, v);
        };
        setters["desired_input_kwarg_layouts"] = [&](const std::string& arg, const Value& v) {
          prepare.desired_input_kwarg_layouts = as_kwarg_layouts(s, arg, v);
        };
      }
      if (out) {
        setters["output_layouts"] = [&](const std::string& arg, const Value& v) {
          prepare.output_layouts = as_layouts(s, arg, v);
        };
        setters["desired_output_layouts"] = [&](const std::string& arg, const Value& v) {
          prepare.desired_output_layouts = as_layouts(s, arg, v);
        };
        required = {"output_layouts", "desired_output_layouts"};
      }
      if (in && out) {
        setters["use_local_input"] = [&](const std::string& arg, const Value& v) {
          prepare.use_local_input = as_bool(s, arg, v);
        };
      }
      setters["use_local_output"] = [&](const std::string& arg, const Value& v) {
        if (in && !out)
          use_local_input_output = as_bool(s, arg, v);
        else
          prepare.use_local_output = as_bool(s, arg, v);
      };
      make = [&, in, out]() -> Style {
        if (in && out) return PrepareModuleInputOutput(prepare);
        if (out)
          return PrepareModuleOutput({.output_layouts = prepare.output_layouts,
                                      .desired_output_layouts = prepare.desired_output_layouts,
                                      .use_local_output = prepare.use_local_output});
        return PrepareModuleInput(
            {.input_layouts = prepare.input_layouts,
             .desired_input_layouts = prepare.desired_input_layouts,
             .input_kwarg_layouts = prepare.input_kwarg_layouts,
             .desired_input_kwarg_layouts = prepare.desired_input_kwarg_layouts,
             .use_local_output = use_local_input_output});
      };
    } else if (name == "PairwiseParallel") {
      make = []() -> Style { return PairwiseParallel(); };
    } else {
      TORCH_CHECK(false, "parse_style: unknown style '", name,
                  "'; the styles are ColwiseParallel, RowwiseParallel, SequenceParallel, "
                  "PrepareModuleInput, PrepareModuleOutput, PrepareModuleInputOutput and "
                  "PairwiseParallel");
    }

    std::vector<std::string> unknown;
    std::set<std::string> seen;
    for (const auto& [arg, v] : args) {
      if (!setters.count(arg)) unknown.push_back(arg);
      TORCH_CHECK(seen.insert(arg).second, "parse_style: ", name, " got argument '", arg,
                  "' twice");
    }
    if (!unknown.empty()) {
      std::vector<std::string> valid;
      for (const auto& [arg, setter] : setters) valid.push_back(arg);
      TORCH_CHECK(
          false, "parse_style: ", name, " got unknown style arguments: ", c10::Join(", ", unknown),
          " (valid arguments: ", valid.empty() ? std::string("none") : c10::Join(", ", valid), ")");
    }
    for (const std::string& arg : required)
      TORCH_CHECK(seen.count(arg), "parse_style: ", name, " requires the argument ", arg);
    for (const auto& [arg, v] : args) setters.at(arg)(arg, v);
    return make();
  }

  std::string_view text_;
  size_t pos_ = 0;
};

}  // namespace

Style parse_style(std::string_view text) { return Parser(text).style(); }

Placement parse_placement(std::string_view text) { return Parser(text).placement_only(); }

}  // namespace dtensor::tp
