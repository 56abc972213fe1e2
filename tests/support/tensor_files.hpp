#pragma once
// Safetensors files built tensor by tensor, for the loader tests: read every
// tensor of a file (as F64 values), change, drop or add tensors, relabel one
// as a dtype no loader accepts, and write the result back to memory. And a
// byte source that records which bytes a loader read, so a test can tell a
// rejection raised before the expensive part of a load (packing the experts)
// from one raised half-way.

#include <apex/ffn/io/safetensors.hpp>
#include <apex/ffn/io/shard_index.hpp>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace apex::test {

/// One tensor of a file: values held as doubles, written as F64 bytes under
/// the label `dtype` (relabelling a tensor "I64" keeps its byte count and
/// makes it a tensor no float loader accepts).
struct TensorData {
  std::string name;
  std::vector<std::uint64_t> shape;
  std::vector<double> values;
  std::string dtype = "F64";
};

/// Every tensor of `file` (F32, F64 or BF16) whose name does not start with
/// one of `skip`, in the file's order.
inline std::vector<TensorData> read_tensors(const safetensors::Reader& file, const std::vector<std::string>& skip = {}) {
  std::vector<TensorData> out;
  for (const auto& t : file.tensors()) {
    if (std::any_of(skip.begin(), skip.end(), [&](const std::string& s) { return t.name.rfind(s, 0) == 0; })) continue;
    TensorData d{t.name, t.shape, std::vector<double>(std::size_t(t.numel())), "F64"};
    file.read(t, d.values.data());
    out.push_back(std::move(d));
  }
  return out;
}

/// The tensor called `name` (nullptr if there is none).
inline TensorData* find_tensor(std::vector<TensorData>& ts, const std::string& name) {
  for (auto& t : ts)
    if (t.name == name) return &t;
  return nullptr;
}

/// `ts` without the tensor called `name`.
inline std::vector<TensorData> without(std::vector<TensorData> ts, const std::string& name) {
  ts.erase(std::remove_if(ts.begin(), ts.end(), [&](const TensorData& t) { return t.name == name; }), ts.end());
  return ts;
}

/// A safetensors file of `ts` (data as F64 bytes, in order) in memory.
inline std::vector<unsigned char> write_tensors(const std::vector<TensorData>& ts) {
  nlohmann::json h = nlohmann::json::object();
  std::uint64_t off = 0;
  for (const auto& t : ts) {
    const std::uint64_t n = 8 * std::uint64_t(t.values.size());
    h[t.name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {off, off + n}}};
    off += n;
  }
  std::string text = h.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  std::vector<unsigned char> out(8 + text.size() + off, 0);
  for (int i = 0; i < 8; ++i) out[std::size_t(i)] = (unsigned char)((text.size() >> (8 * i)) & 0xFF);
  std::copy(text.begin(), text.end(), out.begin() + 8);
  std::size_t at = 8 + text.size();
  for (const auto& t : ts) {
    if (!t.values.empty()) std::memcpy(out.data() + at, t.values.data(), 8 * t.values.size());
    at += 8 * t.values.size();
  }
  return out;
}

/// A memory source that logs every read (offset, bytes) into a log it shares
/// with the test, which keeps it after the reader took the source over.
class LoggingSource : public safetensors::ByteSource {
 public:
  using Log = std::vector<std::pair<std::uint64_t, std::uint64_t>>;
  LoggingSource(const std::vector<unsigned char>& bytes, std::shared_ptr<Log> log)
      : inner_(bytes.data(), bytes.size()), log_(std::move(log)) {}
  std::uint64_t size() const override { return inner_.size(); }
  void read(std::uint64_t offset, void* dst, std::size_t n) const override {
    log_->emplace_back(offset, n);
    inner_.read(offset, dst, n);
  }
  const std::string& description() const override { return inner_.description(); }

 private:
  safetensors::MemorySource inner_;
  std::shared_ptr<Log> log_;
};

/// A reader of `bytes` whose reads go to `log` (cleared once the header is
/// parsed, so the log holds only what a loader read).
inline safetensors::Reader logged_reader(const std::vector<unsigned char>& bytes,
                                         const std::shared_ptr<LoggingSource::Log>& log) {
  safetensors::Reader r(std::make_unique<LoggingSource>(bytes, log));
  log->clear();
  return r;
}

/// Names of the tensors of `file` whose data the logged reads touched.
inline std::set<std::string> tensors_read(const safetensors::Reader& file, const LoggingSource::Log& log) {
  std::set<std::string> names;
  const std::uint64_t base = file.header().data_offset();
  for (const auto& t : file.tensors())
    for (const auto& [off, n] : log)
      if (off < base + t.end && base + t.begin < off + n) names.insert(t.name);
  return names;
}

/// Writes the tensors of `file` into `folder` as a Hugging Face sharded
/// checkpoint: `shards` files `model-0000i-of-0000n.safetensors`, tensor t
/// in shard t mod n (so every shard holds routed experts, the router and
/// shared experts land in different shards), as F64 (8-byte types as
/// stored), and the index. Returns
/// the index's path.
inline std::string write_sharded(const safetensors::Reader& file, const std::filesystem::path& folder, int shards) {
  auto parts = std::vector<std::vector<TensorData>>(std::size_t(shards));
  ShardIndex index;
  std::vector<TensorData> all;  // 8-byte types keep their bytes and label (a spoiled I64 stays I64)
  for (const auto& t : file.tensors()) {
    TensorData d{t.name, t.shape, std::vector<double>(std::size_t(t.numel())), "F64"};
    if (safetensors::dtype_size(t.dtype) == 8) {
      file.read_bytes(t, d.values.data());
      d.dtype = safetensors::dtype_name(t.dtype);
    } else {
      file.read(t, d.values.data());
    }
    all.push_back(std::move(d));
  }
  auto name = [&](int i) {
    const std::string n = std::to_string(shards), k = std::to_string(i + 1);
    return "model-" + std::string(5 - k.size(), '0') + k + "-of-" + std::string(5 - n.size(), '0') + n + ".safetensors";
  };
  for (std::size_t t = 0; t < all.size(); ++t) {
    parts[t % std::size_t(shards)].push_back(all[t]);
    index.weight_map[all[t].name] = name(int(t % std::size_t(shards)));
    index.total_size += 8 * all[t].values.size();
  }
  for (int i = 0; i < shards; ++i) {
    const std::vector<unsigned char> bytes = write_tensors(parts[std::size_t(i)]);
    std::ofstream((folder / name(i)).string(), std::ios::binary)
        .write(reinterpret_cast<const char*>(bytes.data()), std::streamsize(bytes.size()));
  }
  const std::string index_path = (folder / kShardIndexName).string();
  write_shard_index(index_path, index);
  return index_path;
}

}  // namespace apex::test
