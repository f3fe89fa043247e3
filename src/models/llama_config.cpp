// LlamaConfig: presets, derived sizes, validation and a flat JSON form.
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <cctype>
#include <charconv>
#include <cmath>
#include <cstring>
#include <map>
#include <numeric>
#include <sstream>
#include <string>
#include <variant>

#include "dtensor/models/llama.h"

namespace dtensor::models {

LlamaConfig LlamaConfig::preset(const std::string& name) {
  LlamaConfig c;
  if (name == "tiny") {
    // Tests: GQA (2 KV heads for 4 query heads), every size divisible by 1, 2 and 4.
    c.vocab_size = 256;
    c.dim = 32;
    c.n_layers = 2;
    c.n_heads = 4;
    c.n_kv_heads = 2;
    c.max_seq_len = 64;
  } else if (name == "demo") {
    // ~3.1M parameters: a byte-level model that learns visibly in a minute on 2 CPU cores.
    c.vocab_size = 256;
    c.dim = 256;
    c.n_layers = 4;
    c.n_heads = 8;
    c.n_kv_heads = 4;
    c.max_seq_len = 256;
  } else if (name == "bench") {
    // ~29M parameters: big enough that matmuls, not dispatch, dominate a step.
    c.vocab_size = 4096;
    c.dim = 512;
    c.n_layers = 8;
    c.n_heads = 8;
    c.n_kv_heads = 4;
    c.multiple_of = 256;
    c.max_seq_len = 512;
  } else {
    TORCH_CHECK(false, "unknown Llama preset '", name,
                "'; presets: ", c10::Join(", ", preset_names()));
  }
  return c;
}

std::vector<std::string> LlamaConfig::preset_names() { return {"tiny", "demo", "bench"}; }

int64_t LlamaConfig::kv_heads() const { return n_kv_heads > 0 ? n_kv_heads : n_heads; }

int64_t LlamaConfig::head_dim() const { return dim / n_heads; }

int64_t LlamaConfig::hidden_dim() const {
  if (ffn_hidden_dim > 0) return ffn_hidden_dim;
  // Llama: 2/3 of 4*dim, scaled by ffn_dim_multiplier, rounded up to multiple_of.
  int64_t hidden = 2 * (4 * dim) / 3;
  if (ffn_dim_multiplier) hidden = static_cast<int64_t>(*ffn_dim_multiplier * hidden);
  return multiple_of * ((hidden + multiple_of - 1) / multiple_of);
}

int64_t LlamaConfig::num_parameters() const {
  const int64_t hd = head_dim();
  const int64_t attention = dim * n_heads * hd + 2 * dim * kv_heads() * hd + n_heads * hd * dim;
  const int64_t ffn = 3 * dim * hidden_dim();
  const int64_t block = attention + ffn + 2 * dim;
  const int64_t embed = vocab_size * dim;
  return embed + n_layers * block + dim + (tie_embeddings ? 0 : embed);
}

void LlamaConfig::validate() const {
  TORCH_CHECK(vocab_size > 0, "LlamaConfig: vocab_size must be positive, got ", vocab_size);
  TORCH_CHECK(dim > 0, "LlamaConfig: dim must be positive, got ", dim);
  TORCH_CHECK(n_layers >= 0, "LlamaConfig: n_layers must be >= 0, got ", n_layers);
  TORCH_CHECK(n_heads > 0, "LlamaConfig: n_heads must be positive, got ", n_heads);
  TORCH_CHECK(dim % n_heads == 0, "LlamaConfig: dim=", dim,
              " is not divisible by n_heads=", n_heads);
  TORCH_CHECK(head_dim() % 2 == 0, "LlamaConfig: head_dim = dim / n_heads = ", head_dim(),
              " must be even for rotary embeddings");
  TORCH_CHECK(n_kv_heads >= 0, "LlamaConfig: n_kv_heads must be >= 0 (0 means n_heads), got ",
              n_kv_heads);
  TORCH_CHECK(n_heads % kv_heads() == 0, "LlamaConfig: n_heads=", n_heads,
              " is not divisible by n_kv_heads=", kv_heads());
  TORCH_CHECK(ffn_hidden_dim >= 0, "LlamaConfig: ffn_hidden_dim must be >= 0 (0 means derived)");
  TORCH_CHECK(multiple_of > 0, "LlamaConfig: multiple_of must be positive, got ", multiple_of);
  TORCH_CHECK(!ffn_dim_multiplier || *ffn_dim_multiplier > 0,
              "LlamaConfig: ffn_dim_multiplier must be positive");
  TORCH_CHECK(hidden_dim() > 0, "LlamaConfig: the FFN hidden size must be positive");
  TORCH_CHECK(max_seq_len > 0, "LlamaConfig: max_seq_len must be positive, got ", max_seq_len);
  TORCH_CHECK(norm_eps > 0, "LlamaConfig: norm_eps must be positive, got ", norm_eps);
  TORCH_CHECK(rope_theta > 0, "LlamaConfig: rope_theta must be positive, got ", rope_theta);
}

std::vector<int64_t> LlamaConfig::valid_tp_degrees() const {
  std::vector<int64_t> out;
  const int64_t g = std::gcd(n_heads, hidden_dim());
  for (int64_t d = 1; d <= g; ++d) {
    if (g % d == 0) out.push_back(d);
  }
  return out;
}

void LlamaConfig::validate_tp(int64_t tp) const {
  validate();
  TORCH_CHECK(tp >= 1, "tensor parallel degree must be >= 1, got ", tp);
  auto valid = [this] { return c10::Join(", ", valid_tp_degrees()); };
  // Heads are never split: each rank runs whole heads (the attention infers them from widths).
  TORCH_CHECK(n_heads % tp == 0, "n_heads=", n_heads, " is not divisible by tp=", tp,
              "; valid tp degrees: ", valid());
  // w1/w3 outputs meet w2's row-sharded weight as local tensors, which needs even shards.
  TORCH_CHECK(hidden_dim() % tp == 0, "the FFN hidden size ", hidden_dim(),
              " is not divisible by tp=", tp, "; valid tp degrees: ", valid());
}

// ---- JSON ----

namespace {

using JsonValue = std::variant<std::nullptr_t, bool, double>;

// A flat JSON object of numbers, booleans and null: all a config needs.
class FlatJsonParser {
 public:
  explicit FlatJsonParser(const std::string& s) : s_(s) {}

  std::map<std::string, JsonValue> parse() {
    std::map<std::string, JsonValue> out;
    expect('{');
    if (peek() == '}') {
      ++i_;
    } else {
      while (true) {
        std::string key = string();
        expect(':');
        TORCH_CHECK(out.emplace(key, value()).second, "LlamaConfig JSON: duplicate key '", key,
                    "'");
        const char c = next();
        if (c == '}') break;
        TORCH_CHECK(c == ',', "LlamaConfig JSON: expected ',' or '}' at offset ", i_ - 1);
      }
    }
    skip_ws();
    TORCH_CHECK(i_ == s_.size(), "LlamaConfig JSON: trailing characters at offset ", i_);
    return out;
  }

 private:
  void skip_ws() {
    while (i_ < s_.size() && std::isspace(static_cast<unsigned char>(s_[i_]))) ++i_;
  }
  char peek() {
    skip_ws();
    TORCH_CHECK(i_ < s_.size(), "LlamaConfig JSON: unexpected end of input");
    return s_[i_];
  }
  char next() {
    const char c = peek();
    ++i_;
    return c;
  }
  void expect(char c) {
    TORCH_CHECK(next() == c, "LlamaConfig JSON: expected '", c, "' at offset ", i_ - 1);
  }
  std::string string() {
    expect('"');
    const size_t end = s_.find('"', i_);
    TORCH_CHECK(end != std::string::npos, "LlamaConfig JSON: unterminated string");
    std::string out = s_.substr(i_, end - i_);
    i_ = end + 1;
    return out;
  }
  JsonValue value() {
    const char c = peek();
    for (const auto& [word, v] :
         {std::pair<const char*, JsonValue>{"true", true}, {"false", false}, {"null", nullptr}}) {
      if (s_.compare(i_, std::strlen(word), word) == 0) {
        i_ += std::strlen(word);
        return v;
      }
    }
    TORCH_CHECK(c == '-' || std::isdigit(static_cast<unsigned char>(c)),
                "LlamaConfig JSON: expected a number, true, false or null at offset ", i_);
    size_t used = 0;
    const double d = std::stod(s_.substr(i_), &used);
    i_ += used;
    return d;
  }

  const std::string& s_;
  size_t i_ = 0;
};

int64_t as_int(const std::string& key, const JsonValue& v) {
  const double* d = std::get_if<double>(&v);
  TORCH_CHECK(d && std::floor(*d) == *d, "LlamaConfig JSON: '", key, "' must be an integer");
  return static_cast<int64_t>(*d);
}

double as_double(const std::string& key, const JsonValue& v) {
  const double* d = std::get_if<double>(&v);
  TORCH_CHECK(d, "LlamaConfig JSON: '", key, "' must be a number");
  return *d;
}

std::string number(double d) {
  std::ostringstream os;
  os.precision(17);
  os << d;
  return os.str();
}

}  // namespace

LlamaConfig LlamaConfig::from_json(const std::string& json) {
  LlamaConfig c;
  for (const auto& [key, v] : FlatJsonParser(json).parse()) {
    if (key == "vocab_size") {
      c.vocab_size = as_int(key, v);
    } else if (key == "dim") {
      c.dim = as_int(key, v);
    } else if (key == "n_layers") {
      c.n_layers = as_int(key, v);
    } else if (key == "n_heads") {
      c.n_heads = as_int(key, v);
    } else if (key == "n_kv_heads") {
      c.n_kv_heads = std::holds_alternative<std::nullptr_t>(v) ? 0 : as_int(key, v);
    } else if (key == "ffn_hidden_dim") {
      c.ffn_hidden_dim = std::holds_alternative<std::nullptr_t>(v) ? 0 : as_int(key, v);
    } else if (key == "multiple_of") {
      c.multiple_of = as_int(key, v);
    } else if (key == "ffn_dim_multiplier") {
      if (std::holds_alternative<std::nullptr_t>(v)) {
        c.ffn_dim_multiplier.reset();
      } else {
        c.ffn_dim_multiplier = as_double(key, v);
      }
    } else if (key == "max_seq_len") {
      c.max_seq_len = as_int(key, v);
    } else if (key == "norm_eps") {
      c.norm_eps = as_double(key, v);
    } else if (key == "rope_theta") {
      c.rope_theta = as_double(key, v);
    } else if (key == "tie_embeddings") {
      const bool* b = std::get_if<bool>(&v);
      TORCH_CHECK(b, "LlamaConfig JSON: 'tie_embeddings' must be true or false");
      c.tie_embeddings = *b;
    } else {
      TORCH_CHECK(false, "LlamaConfig JSON: unknown key '", key, "'");
    }
  }
  c.validate();
  return c;
}

std::string LlamaConfig::to_json() const {
  std::ostringstream os;
  os << "{\"vocab_size\": " << vocab_size << ", \"dim\": " << dim << ", \"n_layers\": " << n_layers
     << ", \"n_heads\": " << n_heads << ", \"n_kv_heads\": " << kv_heads()
     << ", \"ffn_hidden_dim\": " << hidden_dim() << ", \"multiple_of\": " << multiple_of
     << ", \"ffn_dim_multiplier\": "
     << (ffn_dim_multiplier ? number(*ffn_dim_multiplier) : std::string("null"))
     << ", \"max_seq_len\": " << max_seq_len << ", \"norm_eps\": " << number(norm_eps)
     << ", \"rope_theta\": " << number(rope_theta)
     << ", \"tie_embeddings\": " << (tie_embeddings ? "true" : "false") << "}";
  return os.str();
}

}  // namespace dtensor::models
