// Memory-mapped packed weights and the pack-once file
// (inference/files/pack_once/file.hpp): a mapped layer computes the owned
// layer's bits on every storage type and kernel path, shares its mapping
// when copied, outlives its path, refuses writes, and a malformed file is a
// FormatError that leaves the caller's layer as it was.
#include <catch2/catch.hpp>

#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <apex/ffn/inference.hpp>
#include <apex/ffn/inference/files/pack_once/file.hpp>
#include <apex/ffn/inference/files/checkpoint/load.hpp>
#include <apex/ffn/inference/files/checkpoint/save.hpp>
#include <apex/ffn/layers/kappa_swiglu.hpp>

#include "fixtures.hpp"
#include "packed_layers.hpp"
#include "temp_dir.hpp"

using namespace apex;
using apex::packed::Dtype;
using apex::test::bitwise_equal;

namespace {

/// A layer with every part the file stores: 2 shared experts of their own
/// width under a gate. d and f are whole blocks of 256 for the k-quants.
MoEConfig block_config() {
  MoEConfig c = test::moe_config(4, 2, 2, 256, 256);
  c.d_shared_ffn = 512;
  c.shared_expert_gate = true;
  return c;
}

/// Forward of `layer` on x under every kernel path the CPU has; the paths
/// it lacks are reported once.
template <class Layer>
void check_all_paths(Layer& mapped, Layer& owned, const Matrix<float>& x) {
  for (packed::Isa isa : packed::kAllIsas) {
    if (!packed::cpu_supports(isa)) {
      static bool said[std::size(packed::kAllIsas)] = {};
      if (!std::exchange(said[std::size_t(isa)], true)) WARN("kernel path " << packed::isa_name(isa) << " skipped: this CPU lacks it");
      continue;
    }
    INFO("path " << packed::isa_name(isa) << ", rows " << x.rows());
    mapped.set_kernel_options({isa, packed::Bf16Products::automatic});
    owned.set_kernel_options({isa, packed::Bf16Products::automatic});
    CHECK(bitwise_equal(mapped.forward(x), owned.forward(x)));
  }
}

std::vector<unsigned char> file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}
void write_bytes(const std::string& path, const std::vector<unsigned char>& b) {
  std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(b.data()), std::streamsize(b.size()));
}

/// The file at `path` with its header JSON changed by `edit`, padded so
/// the data starts on a page as the writer places it, plus `extra` spaces
/// (which shift every tensor by that much).
template <class Edit>
void rewrite_header(const std::string& path, const std::string& out, Edit edit, std::size_t extra = 0) {
  const auto b = file_bytes(path);
  std::uint64_t n = 0;
  std::memcpy(&n, b.data(), 8);
  nlohmann::json h = nlohmann::json::parse(b.begin() + 8, b.begin() + 8 + std::ptrdiff_t(n));
  edit(h);
  std::string text = h.dump();
  text.append((4096 - (8 + text.size()) % 4096) % 4096 + extra, ' ');
  std::vector<unsigned char> o(8);
  const std::uint64_t len = text.size();
  std::memcpy(o.data(), &len, 8);
  o.insert(o.end(), text.begin(), text.end());
  o.insert(o.end(), b.begin() + 8 + std::ptrdiff_t(n), b.end());
  write_bytes(out, o);
}

}  // namespace

TEST_CASE("a mapped layer computes the owned layer's bits on every type and kernel path", "[mapped]") {
  test::TempDir dir;
  const PackedTypes all[] = {Dtype::f32, Dtype::bf16, Dtype::f16, Dtype::q8_0, Dtype::q4_0, Dtype::q4_k, Dtype::q6_k,
                             Dtype::mxfp4, PackedTypes({Dtype::q4_k, Dtype::q6_k}, {Dtype::q8_0, Dtype::mxfp4})};
  const MoEConfig c = block_config();
  const MoEFFN<float> moe(c, 7);
  for (const PackedTypes& t : all) {
    INFO("types " << packed_types_name(t));
    auto owned = PackedMoE<float>::from(moe, t);
    save_packed_layout(dir / "layer.safetensors", owned);
    auto mapped = map_packed_moe<float>(dir / "layer.safetensors", c);
    CHECK(mapped.types() == t);
    CHECK(mapped.experts()[0].mapped());
    CHECK(mapped.shared_experts()[1].mapped());
    CHECK_FALSE(owned.experts()[0].mapped());
    for (Index n : {Index(1), Index(3), Index(40)}) check_all_paths(mapped, owned, test::rnd<float>(n, 256, 90 + n));
  }
}

TEST_CASE("odd widths and kappa experts map with the owned layer's bits", "[mapped]") {
  test::TempDir dir;
  const MoEConfig c = test::full_config(2, 29, Scoring::SoftmaxAll, 0.0);
  MoEFFN<float, KappaSwiGLU<float>> kmoe(c, 15);
  test::perturb_kappa(kmoe, 40);
  for (Dtype t : {Dtype::f32, Dtype::bf16}) {
    auto owned = PackedMoE<float, KappaSwiGLU<float>>::from(kmoe, t);
    save_packed_layout(dir / "k.safetensors", owned);
    PackedLoadOptions o;
    o.expert_options.of<KappaSwiGLU<float>>() = kmoe.experts()[0].options();
    auto mapped = map_packed_moe<float, KappaSwiGLU<float>>(dir / "k.safetensors", c, o);
    check_all_paths(mapped, owned, test::rnd<float>(5, c.d_model, 3));
    // A plain SwiGLU map of a κ file is refused by its recorded shape.
    CHECK_THROWS_AS(map_packed_moe<float>(dir / "k.safetensors", c), FormatError);
  }
}

TEST_CASE("a copy of a mapped layer shares the mapping, which outlives the path", "[mapped]") {
  test::TempDir dir;
  const MoEConfig c = block_config();
  const auto owned = PackedMoE<float>::from(MoEFFN<float>(c, 3), Dtype::q4_k);
  save_packed_layout(dir / "a.safetensors", owned);
  const Matrix<float> x = test::rnd<float>(2, 256, 5);
  const Matrix<float> want = owned.forward(x);
  std::optional<PackedMoE<float>> copy;
  {
    const auto mapped = map_packed_moe<float>(dir / "a.safetensors", c);
    copy.emplace(mapped);
    CHECK(copy->experts()[0].gate_up().codes_data() == mapped.experts()[0].gate_up().codes_data());
  }
  std::filesystem::remove(dir / "a.safetensors");
  CHECK(bitwise_equal(copy->forward(x), want));
  // A saved copy of a mapped layer saves from its mapping: same bits again.
  save_packed_layout(dir / "b.safetensors", *copy);
  CHECK(bitwise_equal(map_packed_moe<float>(dir / "b.safetensors", c).forward(x), want));
}

TEST_CASE("writes to mapped panels are refused and to_owned makes the copy", "[mapped]") {
  test::TempDir dir;
  const MoEConfig c = block_config();
  save_packed_layout(dir / "a.safetensors", PackedMoE<float>::from(MoEFFN<float>(c, 3), Dtype::q8_0));
  const auto mapped = map_packed_moe<float>(dir / "a.safetensors", c);
  packed::PanelMatrix m = mapped.experts()[0].gate_up();
  std::vector<std::byte> row(std::size_t(m.row_bytes()));
  m.get_row(0, 0, row.data());
  std::vector<float> w(std::size_t(m.k()), 0.5f);
  CHECK_THROWS_WITH(m.put_row(0, 0, row.data()), Catch::Contains("read-only view of the mapped file"));
  CHECK_THROWS_AS(m.pack_row(0, 0, w.data()), ConfigError);
  const float stored = m.get(0, 0, 0);
  REQUIRE(std::abs(stored - 0.5f) > 0.01f);
  packed::PanelMatrix o = m.to_owned();
  CHECK_FALSE(o.mapped());
  CHECK(o.get(0, 0, 0) == stored);
  o.pack_row(0, 0, w.data());
  CHECK(o.get(0, 0, 0) == Approx(0.5f).margin(1e-3));  // q8_0 of a row of 0.5
  CHECK(m.get(0, 0, 0) == stored);                      // the mapping is unchanged
}

TEST_CASE("a pack-once file of Q6_K's former code order is refused by the fact that differs", "[mapped]") {
  test::TempDir dir;
  const MoEConfig c = block_config();
  const std::string good = dir / "q6k.safetensors", old = dir / "q6k_old.safetensors";
  const auto packed = PackedMoE<float>::from(MoEFFN<float>(c, 3), Dtype::q6_k);
  save_packed_layout(good, packed);
  const Matrix<float> x = test::rnd<float>(5, 256, 8);
  CHECK(bitwise_equal(map_packed_moe<float>(good, c).forward(x), packed.forward(x)));
  // Files packed before Q6_K's codes were grouped carry the geometry alone.
  rewrite_header(good, old, [](nlohmann::json& h) {
    h["__metadata__"]["apex.layout.block.q6_k"] = "256 weights, 210 bytes, 18 scale bytes, group 1";
  });
  CHECK_THROWS_AS(map_packed_moe<float>(old, c), FormatError);
  CHECK_THROWS_WITH(map_packed_moe<float>(old, c),
                    Catch::Contains("apex.layout.block.q6_k") && Catch::Contains("codes by group of 16") &&
                        Catch::Contains("pack the layer again"));
}

TEST_CASE("malformed pack-once files are FormatErrors and leave the layer unchanged", "[mapped]") {
  test::TempDir dir;
  const MoEConfig c = block_config();
  const std::string good = dir / "good.safetensors", bad = dir / "bad.safetensors";
  save_packed_layout(good, PackedMoE<float>::from(MoEFFN<float>(c, 3), Dtype::q4_0));
  auto dst = map_packed_moe<float>(good, c);
  const Matrix<float> x = test::rnd<float>(1, 256, 8);
  const Matrix<float> want = dst.forward(x);
  const auto refused = [&](const std::string& what) {
    INFO(what);
    CHECK_THROWS_AS(dst = map_packed_moe<float>(bad, c), FormatError);
    CHECK(bitwise_equal(dst.forward(x), want));
  };
  rewrite_header(good, bad, [](nlohmann::json& h) { h["__metadata__"]["apex.layout.version"] = "2"; });
  refused("version 2");
  CHECK_THROWS_WITH(map_packed_moe<float>(bad, c), Catch::Contains("apex.layout.version"));
  rewrite_header(good, bad, [](nlohmann::json& h) { h["__metadata__"]["apex.layout"] = "rows"; });
  refused("layout 'rows'");
  rewrite_header(good, bad, [](nlohmann::json& h) { h["__metadata__"]["apex.layout.lanes"] = "16"; });
  CHECK_THROWS_WITH(map_packed_moe<float>(bad, c), Catch::Contains("'16' in the file but '32' in this build"));
  // The header grown by 16 bytes: every tensor 16 bytes off its boundary.
  rewrite_header(good, bad, [](nlohmann::json&) {}, 16);
  refused("misaligned");
  CHECK_THROWS_WITH(map_packed_moe<float>(bad, c), Catch::Contains("not on a 64-byte boundary"));
  rewrite_header(good, bad, [](nlohmann::json& h) {
    auto& t = h["experts.1.down.codes"];
    t["shape"][1] = t["shape"][1].get<int>() / 2;
    t["shape"][0] = t["shape"][0].get<int>() * 2;
  });
  refused("codes of another shape");
  auto b = file_bytes(good);
  b.resize(b.size() - 100);
  write_bytes(bad, b);
  refused("truncated");
  save_packed_moe(bad, PackedMoE<float>::from(MoEFFN<float>(c, 3), Dtype::q4_0));
  refused("a quantized checkpoint (file rows)");
  std::filesystem::remove(bad);
  REQUIRE(::mkfifo(bad.c_str(), 0600) == 0);
  refused("a FIFO");
  std::filesystem::remove(bad);
  // Another config: its shape is refused, naming both.
  MoEConfig other = c;
  other.n_experts = 5;
  CHECK_THROWS_WITH(map_packed_moe<float>(good, other), Catch::Contains("the config asks for"));
  PackedLoadOptions o;
  o.types = PackedTypes(Dtype::q8_0);
  CHECK_THROWS_AS(map_packed_moe<float>(good, c, o), ConfigError);
}

TEST_CASE("owned panel arrays are zeroed, aligned, deep-copied and, from 64 KiB, back to back in chunks", "[mapped]") {
  using packed::detail::PanelArray;
  const auto zeroed = [](const PanelArray& a) {
    return std::all_of(a.data(), a.data() + a.size(), [](std::byte v) { return v == std::byte{0}; });
  };
  const Index big = Index(PanelArray::kChunkedBytes) + 3;  // rounds up to a 64-byte step in its chunk
  PanelArray small(1000);
  std::vector<PanelArray> run;
  for (int i = 0; i < 4; ++i) run.emplace_back(big);
  CHECK_FALSE(small.chunked());
  for (const PanelArray* a : {&small, &run[0], &run[1], &run[2], &run[3]}) {
    CHECK(reinterpret_cast<std::uintptr_t>(a->data()) % 64 == 0);
    CHECK(zeroed(*a));
  }
#if APEX_PANEL_HEAP
  const Index step = (big + 63) / 64 * 64;
  // Of three consecutive pairs at most one straddles a chunk's end; within a chunk they lie back to back.
  int adjacent = 0;
  for (int i = 0; i < 3; ++i) {
    REQUIRE(run[i].chunked());
    if (run[i].chunk() == run[i + 1].chunk()) {
      CHECK(run[i + 1].data() == run[i].data() + step);
      ++adjacent;
    }
  }
  CHECK(adjacent >= 2);
  // Arrays over a quarter chunk get a chunk of their own, on a huge-page boundary.
  PanelArray own(Index(packed::detail::PanelHeap::kOwnChunkBytes) + 1);
  CHECK(reinterpret_cast<std::uintptr_t>(own.data()) % (std::uintptr_t(2) << 20) == 0);
  CHECK(zeroed(own));
  // An array released while its chunk lives gives its whole pages back; its neighbours keep their bytes.
  {
    const Index n = Index(1) << 20;
    std::vector<PanelArray> three;
    for (int attempt = 0; attempt < 2; ++attempt) {  // a chunk that ended among them: the next one has room
      three.clear();
      for (int i = 0; i < 3; ++i) three.emplace_back(n);
      if (three[0].chunk() == three[2].chunk()) break;
    }
    REQUIRE(three[0].chunk() == three[2].chunk());
    PanelArray &before = three[0], &middle = three[1], &after = three[2];
    std::memset(before.data(), 3, std::size_t(n));
    std::memset(middle.data(), 4, std::size_t(n));
    std::memset(after.data(), 5, std::size_t(n));
    const long page = ::sysconf(_SC_PAGESIZE);
    void* inner = middle.data() + page;  // data() is 64-byte aligned: skip to whole pages
    inner = reinterpret_cast<void*>(reinterpret_cast<std::uintptr_t>(inner) / page * page);
    const std::size_t pages = std::size_t(n / page - 2);
    std::vector<unsigned char> resident(pages);
    const auto resident_pages = [&] {
      REQUIRE(::mincore(inner, pages * std::size_t(page), resident.data()) == 0);
      return std::count_if(resident.begin(), resident.end(), [](unsigned char r) { return (r & 1) != 0; });
    };
    CHECK(resident_pages() == std::ptrdiff_t(pages));
    middle = PanelArray();
    CHECK(resident_pages() == 0);
    CHECK(std::all_of(before.data(), before.data() + n, [](std::byte c) { return c == std::byte{3}; }));
    CHECK(std::all_of(after.data(), after.data() + n, [](std::byte c) { return c == std::byte{5}; }));
  }
#endif
  CHECK_THROWS_AS(PanelArray(-1000), std::bad_alloc);
  // Copies are deep; a moved-from array is empty.
  std::memset(run[1].data(), 7, std::size_t(big));
  PanelArray copy = run[1];
  CHECK(std::memcmp(copy.data(), run[1].data(), std::size_t(big)) == 0);
  copy.data()[0] = std::byte{1};
  CHECK(run[1].data()[0] == std::byte{7});
  CHECK(zeroed(run[2]));  // the neighbour is untouched
  PanelArray moved = std::move(copy);
  CHECK(moved.size() == big);
  CHECK(copy.size() == 0);
  CHECK(moved.data()[0] == std::byte{1});
}

#if APEX_PANEL_HEAP
// Forks: the child of a fork made while another thread takes arrays must
// find the heap's lock free. Each array of the other thread is the only one
// in its chunk, so every take maps a new chunk under the lock: most forks
// land while it is held.
TEST_CASE("a child forked while another thread takes panel arrays takes them too", "[mapped]") {
  using packed::detail::PanelArray;
  std::atomic<bool> stop{false};
  std::thread churn([&stop] {
    while (!stop.load(std::memory_order_relaxed)) PanelArray a(Index(1) << 20);
  });
  int hung = 0, failed = 0;
  for (int i = 0; i < 40; ++i) {
    const pid_t pid = ::fork();
    if (pid == 0) {
      ::alarm(10);  // a child stuck on the lock dies of SIGALRM
      PanelArray a(Index(1) << 20);
      ::_exit(a.chunked() ? 0 : 1);
    }
    int status = 0;
    if (pid < 0 || ::waitpid(pid, &status, 0) != pid) break;
    hung += WIFSIGNALED(status) ? 1 : 0;
    failed += WIFEXITED(status) && WEXITSTATUS(status) != 0 ? 1 : 0;
  }
  stop = true;
  churn.join();
  CHECK(hung == 0);
  CHECK(failed == 0);
}

// No chunk can be mapped (here an address-space limit, in a child): arrays
// go to the ordinary heap, zeroed and aligned, instead of failing.
TEST_CASE("panel arrays fall back to the ordinary heap when no chunk can be mapped", "[mapped]") {
  using packed::detail::PanelArray;
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    long pages = 0;
    std::ifstream("/proc/self/statm") >> pages;  // the address space's size, in pages
    const rlim_t room = rlim_t(pages) * rlim_t(::sysconf(_SC_PAGESIZE)) + (rlim_t(96) << 20);
    const rlimit limit{room, room};
    if (::setrlimit(RLIMIT_AS, &limit) != 0) ::_exit(5);
    try {
      std::vector<PanelArray> taken;  // 1 MiB each: past the current chunk's room within 256 of them
      for (int i = 0; i < 300; ++i) {
        taken.emplace_back(Index(1) << 20);
        const PanelArray& a = taken.back();
        if (a.chunked()) continue;
        const bool zeroed = std::all_of(a.data(), a.data() + a.size(), [](std::byte v) { return v == std::byte{0}; });
        ::_exit(!zeroed ? 3 : reinterpret_cast<std::uintptr_t>(a.data()) % 64 != 0 ? 4 : 0);
      }
      ::_exit(2);  // every array found a chunk: the limit did not bite
    } catch (const std::bad_alloc&) {
      ::_exit(6);
    }
  }
  int status = 0;
  REQUIRE(::waitpid(pid, &status, 0) == pid);
  REQUIRE(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
}
#endif
