// The bytes of a .trp file: plain fields and the tensor table (format_io.h).
#include "torchreplay/format_io.h"

#include <ATen/ops/empty.h>
#include <c10/util/safe_numerics.h>

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace torchreplay::format {

bool Storable(c10::ScalarType t) {
  return static_cast<int>(t) < static_cast<int>(c10::ScalarType::NumOptions) && t != c10::ScalarType::Undefined &&
         !c10::isQIntType(t);
}


bool Utf8(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    const unsigned char c = s[i];
    const int extra = c < 0x80 ? 0 : (c >> 5) == 0x6 ? 1 : (c >> 4) == 0xe ? 2 : (c >> 3) == 0x1e ? 3 : -1;
    if (extra < 0 || s.size() - i <= static_cast<size_t>(extra)) return false;
    for (int k = 1; k <= extra; ++k) {
      if ((static_cast<unsigned char>(s[i + k]) >> 6) != 0x2) return false;
    }
    i += 1 + extra;
  }
  return true;
}

uint32_t TensorTable::Add(const at::Tensor& t) {
  if (!t.defined() || t.layout() != at::kStrided || !t.device().is_cpu() || t.is_quantized() ||
      t.is_neg() || t.is_conj()) {
    throw Unsupported{"a tensor that is not a plain strided CPU tensor (save CPU programs)"};
  }
  if (!Storable(t.scalar_type())) throw Unsupported{absl::StrCat("a tensor of dtype ", c10::toString(t.scalar_type()))};
  for (size_t i = 0; i < tensors_.size(); ++i) {
    if (tensors_[i].is_same(t)) return static_cast<uint32_t>(i);
  }
  tensors_.push_back(t);
  const c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  if (std::find(storages_.begin(), storages_.end(), s) == storages_.end()) storages_.push_back(s);
  return static_cast<uint32_t>(tensors_.size() - 1);
}

void TensorTable::Write(Writer& w) const {
  w.Put<uint32_t>(static_cast<uint32_t>(storages_.size()));
  for (const c10::StorageImpl* s : storages_) {
    w.Put<uint64_t>(s->nbytes());
    w.bytes().append(static_cast<const char*>(s->data()), s->nbytes());
  }
  w.Put<uint32_t>(static_cast<uint32_t>(tensors_.size()));
  for (const at::Tensor& t : tensors_) {
    w.Put<int8_t>(static_cast<int8_t>(t.scalar_type()));
    w.Ints(t.sizes());
    w.Ints(t.strides());
    w.Put<int64_t>(t.storage_offset());
    const auto it = std::find(storages_.begin(), storages_.end(), t.storage().unsafeGetStorageImpl());
    w.Put<uint32_t>(static_cast<uint32_t>(it - storages_.begin()));
  }
}

[[noreturn]] void Truncated(const char* what) {
  throw Bad{absl::StatusCode::kDataLoss, absl::StrCat("the file is truncated or corrupted (", what, ")")};
}

[[noreturn]] void Corrupt(const std::string& what) {
  throw Bad{absl::StatusCode::kDataLoss, absl::StrCat("the file is corrupted: ", what)};
}

c10::ScalarType ReadDtype(Reader& r) {
  const int8_t d = r.Get<int8_t>("dtype");
  if (d < 0 || !Storable(static_cast<c10::ScalarType>(d))) Corrupt(absl::StrCat("unknown dtype ", static_cast<int>(d)));
  return static_cast<c10::ScalarType>(d);
}

std::vector<at::Tensor> ReadTensors(Reader& r) {
  std::vector<c10::Storage> storages(r.Count("storages", sizeof(uint64_t)));
  for (c10::Storage& s : storages) {
    const uint64_t n = r.Get<uint64_t>("storage size");
    std::string_view data = r.Bytes(n, "storage bytes");
    at::Tensor bytes = at::empty({static_cast<int64_t>(n)}, at::TensorOptions().dtype(at::kByte));
    if (n > 0) std::memcpy(bytes.data_ptr(), data.data(), n);
    s = bytes.storage();
  }
  std::vector<at::Tensor> tensors(r.Count("tensors", 16));
  for (at::Tensor& t : tensors) {
    const c10::ScalarType dtype = ReadDtype(r);
    const std::vector<int64_t> sizes = r.Ints("sizes"), strides = r.Ints("strides");
    const int64_t offset = r.Get<int64_t>("storage offset");
    const uint32_t storage = r.Get<uint32_t>("storage index");
    if (sizes.size() != strides.size() || static_cast<int64_t>(sizes.size()) > kMaxRank) {
      Corrupt("a tensor's sizes and strides disagree");
    }
    if (storage >= storages.size()) Corrupt("a tensor's storage index is out of range");
    // The last element it reaches, with every product checked: it must lie within its storage.
    uint64_t reach = 0, numel = 1;
    bool overflow = offset < 0;
    for (size_t d = 0; d < sizes.size(); ++d) {
      if (sizes[d] < 0 || strides[d] < 0) Corrupt("a tensor has a negative size or stride");
      uint64_t step = 0;
      overflow |= c10::mul_overflows(static_cast<uint64_t>(sizes[d]), numel, &numel);
      if (sizes[d] > 0) {
        overflow |= c10::mul_overflows(static_cast<uint64_t>(sizes[d] - 1), static_cast<uint64_t>(strides[d]), &step);
        overflow |= c10::add_overflows(reach, step, &reach);
      }
    }
    uint64_t bytes = 0;
    const uint64_t item = c10::elementSize(dtype);
    overflow |= c10::add_overflows(reach, static_cast<uint64_t>(offset) + 1, &reach) ||
                c10::mul_overflows(reach, item, &bytes);
    if (overflow || (numel > 0 && bytes > storages[storage].nbytes())) {
      Corrupt("a tensor reaches beyond its storage");
    }
    t = at::empty({0}, at::TensorOptions().dtype(dtype)).set_(storages[storage], offset, sizes, strides);
  }
  return tensors;
}

}  // namespace torchreplay::format
