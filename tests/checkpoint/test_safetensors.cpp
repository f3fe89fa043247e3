// The safetensors reader and writer: bit-exact round trips of every dtype, the byte layout
// checked by an independent reader (Python's json + torch, and the `safetensors` package when
// installed), hand-made files, every malformed-file error, and atomic replacement.
//
// The Python checks run `$DTENSOR_TEST_PYTHON` (default python3) and are skipped when it
// cannot import torch (or safetensors, for the checks that need it).
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "dtensor/checkpoint/safetensors.h"
#include "support/errors.h"
#include "support/files.h"
#include "support/temp_dir.h"

namespace fs = std::filesystem;
namespace st = dtensor::checkpoint::safetensors;

using dtensor::testing::message_of;
using dtensor::testing::read_file;
using dtensor::testing::TempDir;
using dtensor::testing::write_file;

namespace {

std::string le64(uint64_t n) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>((n >> (8 * i)) & 0xFF);
  return s;
}
// A file from a header and data, with no padding (valid: readers do not require it).
std::string raw_file(const std::string& header, const std::string& data) {
  return le64(header.size()) + header + data;
}

bool same_bytes(const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() != b.scalar_type() || a.sizes() != b.sizes()) return false;
  const at::Tensor x = a.contiguous(), y = b.contiguous();
  return std::memcmp(x.const_data_ptr(), y.const_data_ptr(), x.nbytes()) == 0;
}

// Values both C++ and the Python check script can build: f(i) of the flat index i.
at::Tensor pattern(c10::ScalarType dtype, std::vector<int64_t> shape) {
  const at::Tensor i = at::arange(c10::multiply_integers(shape), at::kDouble).reshape(shape);
  if (dtype == at::kBool) return (i.fmod(3) == 0);
  if (at::isFloatingType(dtype)) return ((i - 7) * 0.25).to(dtype);
  if (dtype == at::kByte || dtype == at::kUInt16 || dtype == at::kUInt32 || dtype == at::kUInt64) {
    return i.to(at::kLong).to(dtype);
  }
  return (i - 7).to(at::kLong).to(dtype);
}

const std::vector<std::pair<c10::ScalarType, std::vector<int64_t>>> kCases = {
    {at::kFloat, {3, 5}}, {at::kDouble, {}},         {at::kHalf, {2, 3, 4}},
    {at::kBFloat16, {7}}, {at::kLong, {4, 1}},       {at::kInt, {0, 4}},
    {at::kShort, {5}},    {at::kChar, {3}},          {at::kByte, {9}},
    {at::kBool, {2, 5}},  {at::kUInt16, {3}},        {at::kUInt32, {2, 2}},
    {at::kUInt64, {1}},   {at::kFloat8_e4m3fn, {6}}, {at::kFloat8_e5m2, {2, 3}},
};

std::map<std::string, at::Tensor> pattern_tensors() {
  std::map<std::string, at::Tensor> out;
  for (const auto& [dtype, shape] : kCases) {
    out["t_" + st::dtype_name(dtype)] = pattern(dtype, shape);
  }
  return out;
}

// Reads a file as the format describes it and compares every tensor with pattern(); with
// the safetensors package installed, also loads it with safetensors.torch.load_file.
// "write PATH" writes the same tensors with safetensors.torch.save_file.
constexpr const char* kPythonCheck = R"PY(
import json, struct, sys, torch
NAMES = {"F32": torch.float32, "F64": torch.float64, "F16": torch.float16,
         "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
         "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool, "U16": torch.uint16,
         "U32": torch.uint32, "U64": torch.uint64, "F8_E4M3": torch.float8_e4m3fn,
         "F8_E5M2": torch.float8_e5m2}
SHAPES = json.loads(sys.argv[3])
def pattern(code, shape):
    n = 1
    for d in shape: n *= d
    i = torch.arange(n, dtype=torch.float64).reshape(shape)
    dt = NAMES[code]
    if dt == torch.bool: return torch.fmod(i, 3) == 0
    if dt.is_floating_point: return ((i - 7) * 0.25).to(dt)
    if code.startswith("U"): return i.to(torch.int64).to(dt)
    return (i - 7).to(torch.int64).to(dt)
def raw_bytes(t):  # flattened first: a 0-d tensor cannot be viewed as bytes
    return t.contiguous().reshape(-1).view(torch.uint8).tolist()
def same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and raw_bytes(a) == raw_bytes(b)
mode, path = sys.argv[1], sys.argv[2]
expected = {"t_" + c: pattern(c, s) for c, s in SHAPES.items()}
if mode == "write":
    from safetensors.torch import save_file
    save_file(expected, path, metadata={"written_by": "python"})
    sys.exit(0)
raw = open(path, "rb").read()
n = struct.unpack("<Q", raw[:8])[0]
assert n % 8 == 0, "header length %d is not a multiple of 8" % n
text = raw[8:8 + n].decode("utf-8")
assert text.startswith("{") and text.rstrip(" ").endswith("}"), "padding is not spaces"
header = json.loads(text)
meta = header.pop("__metadata__")
assert meta == {"purpose": "test", "empty": ""}, meta
data = raw[8 + n:]
spans = sorted(tuple(v["data_offsets"]) for v in header.values())
pos = 0
for b, e in spans:
    assert b == pos, "gap or overlap at %d" % b
    pos = e
assert pos == len(data), "data has %d bytes, tensors cover %d" % (len(data), pos)
assert set(header) == set(expected), sorted(header)
for name, info in header.items():
    b, e = info["data_offsets"]
    t = torch.frombuffer(bytearray(data[b:e]) or bytearray(1), dtype=torch.uint8)[:e - b]
    t = t.view(NAMES[info["dtype"]]).reshape(info["shape"])
    assert same(t, expected[name]), name
try:
    from safetensors import safe_open
    from safetensors.torch import load_file
except ImportError:
    print("safetensors: absent"); sys.exit(0)
loaded = load_file(path)
assert set(loaded) == set(expected)
for name, t in loaded.items():
    assert same(t, expected[name]), name
with safe_open(path, framework="pt") as f:
    assert f.metadata() == {"purpose": "test", "empty": ""}
print("safetensors: checked")
)PY";

std::string python() {
  const char* p = std::getenv("DTENSOR_TEST_PYTHON");
  return p != nullptr ? p : "python3";
}

bool python_imports(const std::string& module) {
  const std::string cmd = python() + " -c 'import " + module + "' >/dev/null 2>&1";
  return std::system(cmd.c_str()) == 0;
}

// Runs the check script; returns its exit status and fills `output`.
int run_python(const TempDir& dir, const std::string& mode, const std::string& path,
               std::string& output) {
  const std::string script = dir.file("check.py");
  write_file(script, kPythonCheck);
  std::string shapes = "{";
  for (const auto& [dtype, shape] : kCases) {
    if (shapes.size() > 1) shapes += ", ";
    shapes += "\"" + st::dtype_name(dtype) + "\": [";
    for (size_t i = 0; i < shape.size(); ++i) shapes += (i ? ", " : "") + std::to_string(shape[i]);
    shapes += "]";
  }
  shapes += "}";
  const std::string out = dir.file("python.out");
  const std::string cmd =
      python() + " " + script + " " + mode + " " + path + " '" + shapes + "' >" + out + " 2>&1";
  const int rc = std::system(cmd.c_str());
  output = read_file(out);
  return rc;
}

}  // namespace

TEST(Safetensors, RoundTripsEveryDtypeBitForBit) {
  TempDir dir;
  auto tensors = pattern_tensors();
  tensors["non_contiguous"] = at::randn({4, 6}).t();
  tensors["nan_and_inf"] = at::tensor({NAN, INFINITY, -INFINITY, -0.0f});
  const std::string path = dir.file("all.safetensors");
  st::save_file(tensors, path, {{"purpose", "test"}, {"empty", ""}});
  const auto loaded = st::load_file(path);
  ASSERT_EQ(loaded.size(), tensors.size());
  for (const auto& [name, t] : tensors) {
    ASSERT_TRUE(loaded.count(name)) << name;
    EXPECT_TRUE(same_bytes(loaded.at(name), t)) << name;
  }
  st::File f(path);
  EXPECT_EQ(f.metadata(), (st::Metadata{{"purpose", "test"}, {"empty", ""}}));
  EXPECT_EQ(f.data_offset() % 8, 0u);
  EXPECT_EQ(f.find("absent"), nullptr);
  // view() aliases the mapping when aligned and copies otherwise: same values either way.
  for (const auto& info : f.tensors()) EXPECT_TRUE(same_bytes(f.view(info), tensors[info.name]));
}

TEST(Safetensors, SliceReadsOnlyTheBlockOfEveryShape) {
  TempDir dir;
  const at::Tensor t = at::arange(2 * 3 * 4 * 5, at::kDouble).reshape({2, 3, 4, 5}).to(at::kHalf);
  const std::string path = dir.file("t.safetensors");
  st::save_file({{"t", t}, {"scalar", at::scalar_tensor(2.5, at::kDouble)}}, path);
  st::File f(path);
  const auto& info = f.at("t");
  struct Block {
    std::vector<int64_t> offset, size;
  };
  for (const Block& b : std::vector<Block>{{{0, 0, 0, 0}, {2, 3, 4, 5}},   // whole: one run
                                           {{1, 0, 0, 0}, {1, 3, 4, 5}},   // rows: one run
                                           {{0, 1, 0, 0}, {2, 2, 4, 5}},   // one run per row
                                           {{0, 0, 0, 2}, {2, 3, 4, 3}},   // columns
                                           {{1, 2, 1, 1}, {1, 1, 2, 3}},   // a corner
                                           {{0, 3, 0, 0}, {2, 0, 4, 5}}})  // empty
  {
    at::Tensor expected = t;
    for (int64_t d = 0; d < 4; ++d) expected = expected.narrow(d, b.offset[d], b.size[d]);
    const at::Tensor got = f.slice(info, b.offset, b.size);
    EXPECT_TRUE(same_bytes(got, expected))
        << c10::IntArrayRef(b.offset) << c10::IntArrayRef(b.size);
  }
  EXPECT_EQ(f.slice(f.at("scalar"), {}, {}).item<double>(), 2.5);
  try {
    f.slice(info, {0, 0, 0, 3}, {2, 3, 4, 3});
    ADD_FAILURE() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("tensor \"t\": slice offset [0, 0, 0, 3] size "
                                         "[2, 3, 4, 3] is outside its shape [2, 3, 4, 5]"),
              std::string::npos)
        << e.what();
  }
}

TEST(Safetensors, LayoutFollowsTheFormatAndLoadsInPython) {
  if (!python_imports("torch")) GTEST_SKIP() << python() << " cannot import torch";
  TempDir dir;
  const std::string path = dir.file("py.safetensors");
  st::save_file(pattern_tensors(), path, {{"purpose", "test"}, {"empty", ""}});
  std::string out;
  EXPECT_EQ(run_python(dir, "check", path, out), 0) << out;
  std::printf("[python] %s", out.c_str());
}

TEST(Safetensors, ReadsFilesWrittenByPythonSafetensors) {
  if (!python_imports("safetensors")) GTEST_SKIP() << python() << " cannot import safetensors";
  TempDir dir;
  const std::string path = dir.file("from_python.safetensors");
  std::string out;
  ASSERT_EQ(run_python(dir, "write", path, out), 0) << out;
  st::File f(path);
  EXPECT_EQ(f.metadata().at("written_by"), "python");
  const auto expected = pattern_tensors();
  ASSERT_EQ(f.tensors().size(), expected.size());
  for (const auto& [name, t] : expected) EXPECT_TRUE(same_bytes(f.tensor(name), t)) << name;
}

TEST(Safetensors, ReadsAHandMadeFileWithUnsortedEntriesAndNoPadding) {
  TempDir dir;
  const std::string path = dir.file("hand.safetensors");
  // b's data comes first although the header lists it second; 0-d and empty tensors.
  const std::string header = R"({"a":{"dtype":"I32","shape":[2],"data_offsets":[8,16]},)"
                             R"("b":{"dtype":"F64","shape":[],"data_offsets":[0,8]},)"
                             R"("e":{"dtype":"F32","shape":[0,3],"data_offsets":[16,16]},)"
                             R"("__metadata__":{"k":"v"}})";
  ASSERT_NE(header.size() % 8, 0u);
  const double b = 2.5;
  const int32_t a[2] = {-3, 7};
  std::string data(16, '\0');
  std::memcpy(data.data(), &b, 8);
  std::memcpy(data.data() + 8, a, 8);
  write_file(path, raw_file(header, data));
  st::File f(path);
  ASSERT_EQ(f.tensors().size(), 3u);
  EXPECT_EQ(f.tensors()[0].name, "b");  // file order
  EXPECT_EQ(f.metadata().at("k"), "v");
  EXPECT_TRUE(same_bytes(f.tensor("a"), at::tensor({-3, 7}, at::kInt)));
  EXPECT_TRUE(same_bytes(f.tensor("b"), at::scalar_tensor(2.5, at::kDouble)));
  EXPECT_TRUE(same_bytes(f.tensor("e"), at::empty({0, 3})));
  EXPECT_NE(message_of([&] { f.at("zz"); }).find("has no tensor \"zz\""), std::string::npos);
}

// Hugging Face writes {"format": "pt"} into every file; the reader takes any string entries.
TEST(Safetensors, ReadsAPlainFileWhoseMetadataIsFormatPt) {
  TempDir dir;
  const std::string path = dir.file("hf.safetensors");
  const std::string header = R"({"__metadata__":{"format":"pt"},)"
                             R"("w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  const float w[2] = {1.5f, -2.0f};
  write_file(path, raw_file(header, std::string(reinterpret_cast<const char*>(w), 8)));
  st::File f(path);
  EXPECT_EQ(f.metadata(), (st::Metadata{{"format", "pt"}}));
  EXPECT_TRUE(same_bytes(f.tensor("w"), at::tensor({1.5f, -2.0f})));
  const auto all = st::load_file(path);
  ASSERT_EQ(all.size(), 1u);
  EXPECT_TRUE(same_bytes(all.at("w"), at::tensor({1.5f, -2.0f})));
}

TEST(Safetensors, MalformedFilesGiveErrorsNamingTheFileAndTheProblem) {
  TempDir dir;
  const std::string good = R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  const std::string data8(8, '\1');
  struct Case {
    std::string label, bytes, expected;
  };
  const std::vector<Case> cases = {
      {"empty file", "", "too short to hold the 8-byte header length"},
      {"four bytes", "abcd", "too short"},
      {"header longer than the file", le64(1000) + "{}", "declares a header of 1000 bytes"},
      {"absurd header length", le64(uint64_t(1) << 62) + "{}", "declares a header of"},
      {"not JSON", raw_file("{not json}", ""), "not valid JSON"},
      {"not starting with {", raw_file("[1, 2]", ""), "does not start with '{'"},
      {"unknown dtype", raw_file(R"({"x":{"dtype":"Q7","shape":[1],"data_offsets":[0,1]}})", "a"),
       "unknown dtype \"Q7\""},
      {"negative dimension",
       raw_file(R"({"x":{"dtype":"U8","shape":[-1],"data_offsets":[0,1]}})", "a"),
       "non-negative integers"},
      {"offsets that do not fit the shape",
       raw_file(R"({"x":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", data8),
       "hold 8 bytes but F32[3] needs 12"},
      {"a gap", raw_file(R"({"x":{"dtype":"U8","shape":[4],"data_offsets":[4,8]}})", data8),
       "(a gap)"},
      {"overlapping tensors",
       raw_file(R"({"x":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},)"
                R"("y":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}})",
                data8),
       "(they overlap)"},
      {"truncated data", raw_file(good, data8.substr(0, 5)), "is truncated"},
      {"trailing bytes", raw_file(good, data8 + "xy"), "2 bytes after the last tensor"},
      {"metadata value not a string", raw_file(R"({"__metadata__":{"k":1}})", ""),
       "is not a string"},
      {"missing data_offsets", raw_file(R"({"x":{"dtype":"U8","shape":[1]}})", "a"),
       "\"data_offsets\" must be [begin, end]"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.label);
    const std::string path = dir.file("bad.safetensors");
    write_file(path, c.bytes);
    const std::string err = message_of([&] { st::File f(path); });
    EXPECT_NE(err.find(path), std::string::npos) << err;
    EXPECT_NE(err.find(c.expected), std::string::npos) << err;
  }
  write_file(dir.file("ok.safetensors"), raw_file(good, data8));
  EXPECT_NO_THROW(st::File(dir.file("ok.safetensors")));
  EXPECT_NE(message_of([&] { st::File(dir.file("absent.safetensors")); }).find("cannot open"),
            std::string::npos);
}

TEST(Safetensors, AnUnfinishedWriterLeavesThePreviousFileAndNoTemporary) {
  TempDir dir;
  const std::string path = dir.file("model.safetensors");
  st::save_file({{"w", at::ones({4})}}, path);
  const std::string before = read_file(path);
  {
    st::Writer w(path, {{"w", at::kFloat, {4}}, {"v", at::kFloat, {2}}}, {});
    w.write(at::zeros({4}));
    EXPECT_TRUE(fs::exists(w.temporary_path()));
    // Declared order, dtype and shape are enforced.
    EXPECT_NE(message_of([&] { w.write(at::zeros({3})); }).find("declared as v"),
              std::string::npos);
    EXPECT_NE(message_of([&] { w.finish({}); }).find("only 1 of 2 tensors"), std::string::npos);
  }  // destroyed unfinished, as when an exception unwinds a save
  EXPECT_EQ(read_file(path), before);
  EXPECT_EQ(dir.entries(), std::vector<std::string>{"model.safetensors"});

  st::Writer w(path, {{"w", at::kFloat, {4}}}, {{"sum", "00000000"}});
  w.write(at::full({4}, 2.0f));
  EXPECT_EQ(read_file(path), before);  // still the old file until finish()
  w.finish({{"sum", "12345678"}});
  EXPECT_TRUE(same_bytes(st::load_file(path).at("w"), at::full({4}, 2.0f)));
  EXPECT_EQ(st::File(path).metadata().at("sum"), "12345678");
  EXPECT_EQ(dir.entries(), std::vector<std::string>{"model.safetensors"});
}

TEST(Safetensors, FinalMetadataMustFitTheReservedHeader) {
  TempDir dir;
  const std::string path = dir.file("m.safetensors");
  st::Writer w(path, {{"x", at::kFloat, {1}}}, {{"k", "ab"}});
  w.write(at::ones({1}));
  const std::string err = message_of([&] { w.finish({{"k", std::string(100, 'z')}}); });
  EXPECT_NE(err.find("longer than the one reserved"), std::string::npos) << err;
  EXPECT_FALSE(fs::exists(path));
}

TEST(Safetensors, RejectsDtypesTheFormatCannotHold) {
  const std::string err = message_of([] { st::dtype_name(at::kComplexFloat); });
  EXPECT_NE(err.find("cannot be stored"), std::string::npos) << err;
  EXPECT_NE(err.find("BF16"), std::string::npos) << err;
  TempDir dir;
  EXPECT_THROW(st::save_file({{"c", at::ones({2}, at::kComplexFloat)}}, dir.file("c.st")),
               c10::Error);
  EXPECT_TRUE(dir.entries().empty());
}
