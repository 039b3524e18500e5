// torchreplay/format_io.h: the bytes of a .trp file (Note [The .trp format] in format.h): the
// writer and reader of its plain fields, each read checked against the bytes left, its tensor
// table (tensors and the storages they share) both ways, and the two directions a section's
// description is walked in (Out, In). Private to format.cc.
#pragma once

#include <ATen/core/Tensor.h>

#include <climits>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

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
  uint32_t size() const { return static_cast<uint32_t>(tensors_.size()); }

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

// ---------------------------------------------------------------------------------- directions

// The two directions a section's description (Note [One description per section] in format.cc)
// is walked in: Out writes each field, In reads it, checks it (Check, the bounded Num) and
// stores it. Their methods take the same arguments, so one description serves both.
class Out {
 public:
  static constexpr bool kWriting = true;
  Out(Writer& w, TensorTable& tensors) : w_(w), tensors_(tensors) {}
  template <class Wire, class T>
  void Num(T& v, const char*) {
    w_.Put<Wire>(static_cast<Wire>(v));
  }
  template <class Wire, class T>
  void Num(T& v, const char*, int64_t, int64_t, const char*) {
    w_.Put<Wire>(static_cast<Wire>(v));
  }
  void Str(std::string& s, const char*) { w_.Str(s); }
  template <class V>
  void Count(V& v, const char*, size_t = 1) {
    w_.Put<uint32_t>(static_cast<uint32_t>(v.size()));
  }
  void Bound(uint32_t& n, const char*) { w_.Put<uint32_t>(n); }
  void Dtype(c10::ScalarType& d, const char* what) {
    if (!Storable(d)) throw Unsupported{absl::StrCat(what, " of dtype ", c10::toString(d))};
    w_.Put<int8_t>(static_cast<int8_t>(d));
  }
  // Its index in the tensor table; after Seal, only a tensor already there (the table is written).
  void Tensor(at::Tensor& t) {
    const uint32_t i = tensors_.Add(t);
    if (i >= sealed_at_) throw Unsupported{"a tensor outside the program's tensor table"};
    w_.Put<uint32_t>(i);
  }
  void Seal(uint32_t table_size) { sealed_at_ = table_size; }
  void Check(bool, const char*) {}

 private:
  Writer& w_;
  TensorTable& tensors_;
  uint32_t sealed_at_ = UINT32_MAX;
};

class In {
 public:
  static constexpr bool kWriting = false;
  In(Reader& r, const std::vector<at::Tensor>& tensors) : r_(r), tensors_(tensors) {}
  template <class Wire, class T>
  void Num(T& v, const char* what) {
    v = static_cast<T>(r_.Get<Wire>(what));
  }
  // Checked in the file's width, before it narrows to the field's: within [lo, hi], else `bad`.
  template <class Wire, class T>
  void Num(T& v, const char* what, int64_t lo, int64_t hi, const char* bad) {
    const Wire w = r_.Get<Wire>(what);
    Check(static_cast<int64_t>(w) >= lo && static_cast<int64_t>(w) <= hi, bad);
    v = static_cast<T>(w);
  }
  void Str(std::string& s, const char* what) { s = r_.Str(what); }
  // A count of items of at least `item_bytes` each, never more than the bytes left could hold.
  template <class V>
  void Count(V& v, const char* what, size_t item_bytes = 1) {
    v.resize(r_.Count(what, item_bytes));
  }
  // A number of things the file describes, never more than its bytes left.
  void Bound(uint32_t& n, const char* what) { n = r_.Count(what); }
  void Dtype(c10::ScalarType& d, const char*) { d = ReadDtype(r_); }
  void Tensor(at::Tensor& t) {
    const uint32_t i = r_.Get<uint32_t>("tensor index");
    Check(i < tensors_.size(), "a tensor index is out of range");
    t = tensors_[i];
  }
  void Check(bool ok, const char* what) {
    if (!ok) Corrupt(what);
  }

 private:
  Reader& r_;
  const std::vector<at::Tensor>& tensors_;
};

}  // namespace torchreplay::format
