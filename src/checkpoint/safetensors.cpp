#include "dtensor/checkpoint/safetensors.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <tuple>
#include <utility>

#include "dtensor/util/atomic_file.h"

namespace dtensor::checkpoint::safetensors {

// The format stores little-endian data; we copy tensor memory as is.
static_assert(std::endian::native == std::endian::little,
              "safetensors I/O assumes a little-endian host");

namespace {

// The safetensors library refuses larger headers; so do we (a garbage length is caught here).
constexpr uint64_t kMaxHeaderSize = 100'000'000;

constexpr std::array<std::pair<c10::ScalarType, const char*>, 15> kDtypes{{
    {c10::ScalarType::Float, "F32"},
    {c10::ScalarType::Double, "F64"},
    {c10::ScalarType::Half, "F16"},
    {c10::ScalarType::BFloat16, "BF16"},
    {c10::ScalarType::Long, "I64"},
    {c10::ScalarType::Int, "I32"},
    {c10::ScalarType::Short, "I16"},
    {c10::ScalarType::Char, "I8"},
    {c10::ScalarType::Byte, "U8"},
    {c10::ScalarType::Bool, "BOOL"},
    {c10::ScalarType::UInt16, "U16"},
    {c10::ScalarType::UInt32, "U32"},
    {c10::ScalarType::UInt64, "U64"},
    {c10::ScalarType::Float8_e4m3fn, "F8_E4M3"},
    {c10::ScalarType::Float8_e5m2, "F8_E5M2"},
}};

std::string supported_names() {
  std::string s;
  for (const auto& [dtype, name] : kDtypes) s += (s.empty() ? "" : ", ") + std::string(name);
  return s;
}

std::string errno_text() { return std::strerror(errno); }

uint64_t checked_nbytes(const std::vector<int64_t>& shape, c10::ScalarType dtype,
                        const std::string& where) {
  uint64_t n = c10::elementSize(dtype);
  for (int64_t d : shape) {
    TORCH_CHECK(d >= 0, where, ": negative dimension in shape ", c10::IntArrayRef(shape));
    TORCH_CHECK(!__builtin_mul_overflow(n, static_cast<uint64_t>(d), &n), where, ": shape ",
                c10::IntArrayRef(shape), " overflows the byte count");
  }
  return n;
}

void write_all(int fd, const void* data, size_t size, uint64_t offset, bool positioned,
               const std::string& path) {
  const auto* p = static_cast<const char*>(data);
  while (size > 0) {
    const ssize_t n =
        positioned ? ::pwrite(fd, p, size, static_cast<off_t>(offset)) : ::write(fd, p, size);
    if (n < 0 && errno == EINTR) continue;
    TORCH_CHECK(n > 0, "safetensors: writing '", path, "' failed: ", errno_text());
    p += n;
    size -= static_cast<size_t>(n);
    offset += static_cast<uint64_t>(n);
  }
}

}  // namespace

std::string dtype_name(c10::ScalarType dtype) {
  for (const auto& [t, name] : kDtypes) {
    if (t == dtype) return name;
  }
  TORCH_CHECK(false, "safetensors: dtype ", dtype,
              " cannot be stored; supported dtypes: ", supported_names());
}

c10::ScalarType dtype_from_name(std::string_view name) {
  for (const auto& [t, n] : kDtypes) {
    if (name == n) return t;
  }
  TORCH_CHECK(false, "safetensors: unknown dtype \"", name, "\"; supported: ", supported_names());
}

// ---------------------------------------------------------------------------------------------
// Writer

Writer::Writer(std::string path, const std::vector<Entry>& entries, const Metadata& metadata)
    : path_(std::move(path)), tmp_path_(path_ + ".tmp-" + std::to_string(::getpid())) {
  uint64_t offset = 0;
  std::map<std::string, int> seen;
  for (const auto& e : entries) {
    TORCH_CHECK(e.name != "__metadata__" && !e.name.empty(), "safetensors: '", path_,
                "': invalid tensor name \"", e.name, "\"");
    TORCH_CHECK(seen.emplace(e.name, 0).second, "safetensors: '", path_,
                "': two tensors are named \"", e.name, "\"");
    dtype_name(e.dtype);  // throws for unsupported dtypes before anything is written
    const uint64_t n = checked_nbytes(e.shape, e.dtype, "safetensors: tensor " + e.name);
    tensors_.push_back({e.name, e.dtype, e.shape, offset, offset + n});
    offset += n;
  }
  const size_t h = header(metadata).size();
  header_size_ = (h + 7) / 8 * 8;
  fd_ = ::open(tmp_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  TORCH_CHECK(fd_ >= 0, "safetensors: cannot create '", tmp_path_, "': ", errno_text());
  // The header is written last, into the space skipped here.
  if (::lseek(fd_, static_cast<off_t>(8 + header_size_), SEEK_SET) < 0) {
    const std::string err = errno_text();
    ::close(fd_);
    fd_ = -1;
    ::unlink(tmp_path_.c_str());
    TORCH_CHECK(false, "safetensors: seeking in '", tmp_path_, "' failed: ", err);
  }
}

Writer::~Writer() {
  if (fd_ >= 0) ::close(fd_);
  if (!finished_) ::unlink(tmp_path_.c_str());
}

std::string Writer::header(const Metadata& metadata) const {
  nlohmann::ordered_json h = nlohmann::ordered_json::object();
  if (!metadata.empty()) {
    nlohmann::ordered_json m = nlohmann::ordered_json::object();
    for (const auto& [k, v] : metadata) m[k] = v;
    h["__metadata__"] = std::move(m);
  }
  for (const auto& t : tensors_) {
    h[t.name] = {
        {"dtype", dtype_name(t.dtype)}, {"shape", t.shape}, {"data_offsets", {t.begin, t.end}}};
  }
  try {
    return h.dump();
  } catch (const nlohmann::json::exception& e) {
    TORCH_CHECK(false, "safetensors: '", path_, "': names and metadata must be UTF-8: ", e.what());
  }
}

void Writer::write_bytes(const void* data, size_t size) {
  write_all(fd_, data, size, 0, /*positioned=*/false, tmp_path_);
}

void Writer::write(const at::Tensor& tensor) {
  TORCH_CHECK(!finished_ && fd_ >= 0, "safetensors: '", path_, "' is already finished");
  TORCH_CHECK(next_ < tensors_.size(), "safetensors: '", path_, "': all ", tensors_.size(),
              " declared tensors are already written");
  const TensorInfo& info = tensors_[next_];
  TORCH_CHECK(tensor.scalar_type() == info.dtype && tensor.sizes() == c10::IntArrayRef(info.shape),
              "safetensors: '", path_, "': tensor ", next_, " was declared as ", info.name, " ",
              info.dtype, c10::IntArrayRef(info.shape), " but is ", tensor.scalar_type(),
              tensor.sizes());
  at::Tensor t = tensor.device().is_cpu() ? tensor : tensor.cpu();
  t = t.contiguous();
  write_bytes(t.const_data_ptr(), static_cast<size_t>(info.nbytes()));
  ++next_;
}

void Writer::finish(const Metadata& metadata) {
  TORCH_CHECK(!finished_ && fd_ >= 0, "safetensors: '", path_, "' is already finished");
  TORCH_CHECK(next_ == tensors_.size(), "safetensors: '", path_, "': only ", next_, " of ",
              tensors_.size(), " tensors were written");
  std::string h = header(metadata);
  TORCH_CHECK(h.size() <= header_size_, "safetensors: '", path_,
              "': the final header is longer than the one reserved (", h.size(), " > ",
              header_size_, " bytes); metadata values must keep their length");
  h.resize(header_size_, ' ');
  std::string out(8, '\0');
  const uint64_t n = header_size_;
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xFFu);
  out += h;
  write_all(fd_, out.data(), out.size(), 0, /*positioned=*/true, tmp_path_);
  TORCH_CHECK(::fsync(fd_) == 0, "safetensors: flushing '", tmp_path_, "' failed: ", errno_text());
  const int rc = ::close(fd_);
  fd_ = -1;
  TORCH_CHECK(rc == 0, "safetensors: closing '", tmp_path_, "' failed: ", errno_text());
  TORCH_CHECK(::rename(tmp_path_.c_str(), path_.c_str()) == 0, "safetensors: renaming '", tmp_path_,
              "' to '", path_, "' failed: ", errno_text());
  finished_ = true;
  util::sync_directory_of(path_);  // a crash cannot lose the finished file
}

// ---------------------------------------------------------------------------------------------
// File

namespace {

struct Mapping {
  const std::byte* data = nullptr;
  uint64_t size = 0;
};

// The whole file mapped read-only; at least the 8 bytes of the header length.
Mapping map_read_only(const std::string& path, const std::string& where) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  TORCH_CHECK(fd >= 0, "cannot open ", where, ": ", errno_text());
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const std::string err = errno_text();
    ::close(fd);
    TORCH_CHECK(false, "cannot stat ", where, ": ", err);
  }
  const auto size = static_cast<uint64_t>(st.st_size);
  if (size < 8) {
    ::close(fd);
    TORCH_CHECK(false, where, " is ", size,
                " bytes long, too short to hold the 8-byte header length (truncated or not a "
                "safetensors file)");
  }
  void* m = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  const std::string err = errno_text();
  ::close(fd);
  TORCH_CHECK(m != MAP_FAILED, "cannot map ", where, ": ", err);
  return {static_cast<const std::byte*>(m), size};
}

// The header's JSON object; sets `data_offset` (8 + the header length).
nlohmann::json parse_header(const Mapping& map, const std::string& where, uint64_t& data_offset) {
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= static_cast<uint64_t>(map.data[i]) << (8 * i);
  TORCH_CHECK(n <= kMaxHeaderSize && n <= map.size - 8, where, " declares a header of ", n,
              " bytes but the file is ", map.size,
              " bytes long (truncated or not a safetensors file)");
  data_offset = 8 + n;
  const char* hb = reinterpret_cast<const char*>(map.data + 8);
  TORCH_CHECK(n > 0 && hb[0] == '{', where,
              ": the header does not start with '{' (not a safetensors file?)");
  nlohmann::json h;
  try {
    h = nlohmann::json::parse(hb, hb + n);
  } catch (const nlohmann::json::parse_error& e) {
    TORCH_CHECK(false, where, ": the header is not valid JSON (", e.what(), ")");
  }
  TORCH_CHECK(h.is_object(), where, ": the header is not a JSON object");
  return h;
}

void read_metadata(const nlohmann::json& value, const std::string& where, Metadata& out) {
  if (value.is_null()) return;
  TORCH_CHECK(value.is_object(), where, ": __metadata__ is not an object");
  for (const auto& [k, v] : value.items()) {
    TORCH_CHECK(v.is_string(), where, ": __metadata__ value of \"", k, "\" is not a string");
    out[k] = v.get<std::string>();
  }
}

// One tensor's header entry, checked: known dtype, non-negative shape, offsets that hold it.
TensorInfo parse_tensor_entry(const std::string& key, const nlohmann::json& value,
                              const std::string& where) {
  const std::string what = where + ", tensor \"" + key + "\"";
  TORCH_CHECK(value.is_object(), what, ": entry is not an object");
  const auto dt = value.find("dtype");
  const auto sh = value.find("shape");
  const auto off = value.find("data_offsets");
  TORCH_CHECK(dt != value.end() && dt->is_string(), what, ": missing or non-string \"dtype\"");
  TORCH_CHECK(sh != value.end() && sh->is_array(), what, ": missing or non-array \"shape\"");
  TORCH_CHECK(off != value.end() && off->is_array() && off->size() == 2, what,
              ": \"data_offsets\" must be [begin, end]");
  TensorInfo info;
  info.name = key;
  try {
    info.dtype = dtype_from_name(dt->get<std::string>());
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, what, ": ", e.msg());
  }
  for (const auto& d : *sh) {
    TORCH_CHECK(d.is_number_unsigned(), what, ": shape entries must be non-negative integers");
    TORCH_CHECK(d.get<uint64_t>() <= static_cast<uint64_t>(INT64_MAX), what,
                ": dimension too large");
    info.shape.push_back(static_cast<int64_t>(d.get<uint64_t>()));
  }
  TORCH_CHECK((*off)[0].is_number_unsigned() && (*off)[1].is_number_unsigned(), what,
              ": data_offsets must be non-negative integers");
  info.begin = (*off)[0].get<uint64_t>();
  info.end = (*off)[1].get<uint64_t>();
  TORCH_CHECK(info.begin <= info.end, what, ": data_offsets [", info.begin, ", ", info.end,
              "] end before they begin");
  const uint64_t nbytes = checked_nbytes(info.shape, info.dtype, what);
  TORCH_CHECK(info.nbytes() == nbytes, what, ": data_offsets [", info.begin, ", ", info.end,
              "] hold ", info.nbytes(), " bytes but ", dtype_name(info.dtype),
              c10::IntArrayRef(info.shape), " needs ", nbytes);
  return info;
}

// Sorts `tensors` into file order and checks that they cover the data exactly: no gap, no
// overlap, no truncation, no trailing bytes.
void check_data_layout(std::vector<TensorInfo>& tensors, uint64_t file_size, uint64_t data_offset,
                       const std::string& where) {
  std::sort(tensors.begin(), tensors.end(), [](const TensorInfo& a, const TensorInfo& b) {
    return std::tie(a.begin, a.end) < std::tie(b.begin, b.end);
  });
  uint64_t expected = 0;
  for (const auto& t : tensors) {
    TORCH_CHECK(t.begin == expected, where, ": tensor \"", t.name, "\" starts at data offset ",
                t.begin, " but the previous tensor ends at ", expected,
                t.begin > expected ? " (a gap)" : " (they overlap)");
    expected = t.end;
  }
  const uint64_t data_size = file_size - data_offset;
  TORCH_CHECK(expected <= data_size, where, " is truncated: its header describes ", expected,
              " bytes of tensor data but the file holds ", data_size, " (", file_size,
              " bytes in all; expected ", data_offset + expected, ")");
  TORCH_CHECK(expected == data_size, where, " has ", data_size - expected,
              " bytes after the last tensor's data (corrupt or not a safetensors file)");
}

}  // namespace

File::File(const std::string& path) : path_(path) {
  const std::string where = "safetensors file '" + path + "'";
  const Mapping mapping = map_read_only(path, where);
  map_ = mapping.data;
  size_ = mapping.size;
  try {
    const nlohmann::json header = parse_header(mapping, where, data_offset_);
    for (const auto& [key, value] : header.items()) {
      if (key == "__metadata__") {
        read_metadata(value, where, metadata_);
      } else {
        tensors_.push_back(parse_tensor_entry(key, value, where));
      }
    }
    check_data_layout(tensors_, size_, data_offset_, where);
    for (size_t i = 0; i < tensors_.size(); ++i) index_[tensors_[i].name] = i;
  } catch (...) {
    ::munmap(const_cast<std::byte*>(map_), size_);
    map_ = nullptr;
    throw;
  }
}

File::~File() {
  if (map_ != nullptr) ::munmap(const_cast<std::byte*>(map_), size_);
}

const TensorInfo* File::find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

const TensorInfo& File::at(const std::string& name) const {
  const TensorInfo* info = find(name);
  TORCH_CHECK(info != nullptr, "safetensors file '", path_, "' has no tensor \"", name, "\"");
  return *info;
}

std::span<const std::byte> File::bytes(const TensorInfo& info) const {
  return {map_ + data_offset_ + info.begin, static_cast<size_t>(info.nbytes())};
}

at::Tensor File::tensor(const TensorInfo& info) const {
  at::Tensor t = at::empty(info.shape, at::TensorOptions().dtype(info.dtype));
  const auto b = bytes(info);
  if (!b.empty()) std::memcpy(t.mutable_data_ptr(), b.data(), b.size());
  return t;
}

at::Tensor File::view(const TensorInfo& info) const {
  const auto b = bytes(info);
  const auto addr = reinterpret_cast<uintptr_t>(b.data());
  if (addr % c10::elementSize(info.dtype) != 0) return tensor(info);
  // The mapping is read-only: callers copy out of the view, never write into it.
  return at::from_blob(const_cast<std::byte*>(b.data()), info.shape,
                       at::TensorOptions().dtype(info.dtype));
}

at::Tensor File::slice(const TensorInfo& info, c10::IntArrayRef offset,
                       c10::IntArrayRef size) const {
  const int64_t ndim = static_cast<int64_t>(info.shape.size());
  TORCH_CHECK(
      static_cast<int64_t>(offset.size()) == ndim && static_cast<int64_t>(size.size()) == ndim,
      "safetensors file '", path_, "', tensor \"", info.name, "\": a slice of a ", ndim,
      "-d tensor needs ", ndim, " offsets and sizes, got ", offset, " and ", size);
  for (int64_t d = 0; d < ndim; ++d) {
    TORCH_CHECK(offset[d] >= 0 && size[d] >= 0 && offset[d] + size[d] <= info.shape[d],
                "safetensors file '", path_, "', tensor \"", info.name, "\": slice offset ", offset,
                " size ", size, " is outside its shape ", c10::IntArrayRef(info.shape));
  }
  at::Tensor out = at::empty(size, at::TensorOptions().dtype(info.dtype));
  if (out.numel() == 0) return out;
  // The innermost dims the block spans whole form contiguous runs; `k` is the last cut dim.
  const size_t elem = c10::elementSize(info.dtype);
  int64_t k = ndim - 1;
  size_t run = elem;
  while (k >= 0 && size[k] == info.shape[k]) run *= static_cast<size_t>(info.shape[k--]);
  if (k >= 0) run *= static_cast<size_t>(size[k]);
  // Byte strides of the whole tensor.
  std::vector<size_t> stride(static_cast<size_t>(ndim), elem);
  for (int64_t d = ndim - 2; d >= 0; --d) stride[d] = stride[d + 1] * info.shape[d + 1];
  const std::byte* base = map_ + data_offset_ + info.begin;
  auto* dst = static_cast<std::byte*>(out.mutable_data_ptr());
  // Walk the block's index over dims [0, k) (odometer order), one run per step.
  std::vector<int64_t> index(static_cast<size_t>(std::max<int64_t>(k, 0)), 0);
  while (true) {
    size_t src = 0;
    for (int64_t d = 0; d < k; ++d) src += (offset[d] + index[d]) * stride[d];
    if (k >= 0) src += offset[k] * stride[k];
    std::memcpy(dst, base + src, run);
    dst += run;
    int64_t d = k - 1;
    while (d >= 0 && ++index[d] == size[d]) index[d--] = 0;
    if (d < 0) break;
  }
  return out;
}

// ---------------------------------------------------------------------------------------------

void save_file(const std::map<std::string, at::Tensor>& tensors, const std::string& path,
               const Metadata& metadata) {
  std::vector<Writer::Entry> entries;
  for (const auto& [name, t] : tensors) {
    entries.push_back({name, t.scalar_type(), t.sizes().vec()});
  }
  Writer w(path, entries, metadata);
  for (const auto& [name, t] : tensors) w.write(t);
  w.finish(metadata);
}

std::map<std::string, at::Tensor> load_file(const std::string& path) {
  File f(path);
  std::map<std::string, at::Tensor> out;
  for (const auto& info : f.tensors()) out.emplace(info.name, f.tensor(info));
  return out;
}

}  // namespace dtensor::checkpoint::safetensors
