// torchreplay/format_io.h: the bytes of a .trp file (Note [The .trp format] in format.h): the
// writer and reader of its plain fields, each read checked against the bytes left, and its tensor
// table (tensors and the storages they share) both ways. Private to format.cc.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "absl/status/status.h"

namespace torchreplay::format {

inline constexpr int64_t kMaxRank = 64;

// Dtypes a file holds: every one of plain elements (not quantized, not undefined).
bool Storable(c10::ScalarType t);

// Strings in a file are UTF-8 (names from Python): anything else is corruption (and would not
// survive the trip into a Python error message).
bool Utf8(std::string_view s);

// ---------------------------------------------------------------------------------- writing

class Writer {
 public:
  template <typename T>
  void Put(T v) {
    static_assert(std::is_trivially_copyable_v<T>);
    out_.append(reinterpret_cast<const char*>(&v), sizeof(T));
  }
  void Str(std::string_view s) {
    Put<uint32_t>(static_cast<uint32_t>(s.size()));
    out_.append(s);
  }
  void Ints(c10::IntArrayRef v) {
    Put<uint32_t>(static_cast<uint32_t>(v.size()));
    for (int64_t x : v) Put<int64_t>(x);
  }
  std::string& bytes() { return out_; }

 private:
  std::string out_;
};

// What cannot be written: InvalidArgument, thrown inside Serialize and turned into its status.
struct Unsupported {
  std::string what;
};

// Tensors and storages, each written once (storages shared between tensors stay shared).
class TensorTable {
 public:
  // The tensor's index in the table, added if new; Unsupported for what a file cannot hold.
  uint32_t Add(const at::Tensor& t);
  // The table: its storages' bytes, then each tensor's dtype, geometry and storage.
  void Write(Writer& w) const;

 private:
  std::vector<at::Tensor> tensors_;
  std::vector<const c10::StorageImpl*> storages_;
};

// ---------------------------------------------------------------------------------- reading

// What is wrong with the file: thrown inside Deserialize and turned into its status.
struct Bad {
  absl::StatusCode code;
  std::string what;
};

[[noreturn]] void Truncated(const char* what);

class Reader {
 public:
  explicit Reader(std::string_view bytes) : bytes_(bytes) {}

  template <typename T>
  T Get(const char* what) {
    if (bytes_.size() - pos_ < sizeof(T)) Truncated(what);
    T v;
    std::memcpy(&v, bytes_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }
  // A count of items of at least `item_bytes` each: never more than the bytes left could hold.
  uint32_t Count(const char* what, size_t item_bytes = 1) {
    const uint32_t n = Get<uint32_t>(what);
    if (static_cast<uint64_t>(n) * item_bytes > bytes_.size() - pos_) Truncated(what);
    return n;
  }
  std::string_view Bytes(uint64_t n, const char* what) {
    if (n > bytes_.size() - pos_) Truncated(what);
    std::string_view out = bytes_.substr(pos_, n);
    pos_ += n;
    return out;
  }
  std::string Str(const char* what) {
    std::string_view s = Bytes(Count(what), what);
    if (!Utf8(s)) Truncated(what);
    return std::string(s);
  }
  std::vector<int64_t> Ints(const char* what) {
    std::vector<int64_t> v(Count(what, sizeof(int64_t)));
    for (int64_t& x : v) x = Get<int64_t>(what);
    return v;
  }
  bool done() const { return pos_ == bytes_.size(); }

 private:
  std::string_view bytes_;
  size_t pos_ = 0;
};

[[noreturn]] void Corrupt(const std::string& what);

// A dtype a file may hold (Storable), else Corrupt.
c10::ScalarType ReadDtype(Reader& r);

// The tensor table TensorTable::Write wrote: every tensor checked to lie within its storage.
std::vector<at::Tensor> ReadTensors(Reader& r);

}  // namespace torchreplay::format
