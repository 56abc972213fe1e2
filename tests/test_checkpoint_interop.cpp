// PyTorch interop of checkpoints in both directions: SwiGLU and MoE
// checkpoints written by PyTorch (tools/torch_reference.py) reproduce
// PyTorch's output here, and checkpoints saved here load into PyTorch
// (interop.cmake runs both halves against a live torch when there is one).
#include <apex/ffn/io/checkpoint.hpp>
#include <apex/ffn/io/name_maps.hpp>
#include <apex/ffn/io/sharded_checkpoint.hpp>
#include <apex/ffn/layers/ffn_sublayer.hpp>
#include <apex/ffn/layers/kappa_swiglu.hpp>
#include <apex/ffn/layers/multi_token_heads.hpp>
#include <apex/ffn/layers/rms_norm.hpp>
#include <apex/ffn/layers/swiglu.hpp>
#include <apex/ffn/moe/moe_ffn.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <fcntl.h>
#include <unistd.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>

#include "checkpoint_bytes.hpp"
#include "sweep.hpp"
#include "temp_dir.hpp"

using namespace apex;
namespace fs = std::filesystem;
namespace st = apex::safetensors;
using Catch::Matchers::Contains;
using apex::test::TempDir;

namespace {

const fs::path kTests = fs::path(__FILE__).parent_path();

double rel_error(const Matrix<double>& a, const Matrix<double>& b) {
  const double scale = b.norm();
  return (a - b).norm() / (scale > 0 ? scale : 1.0);
}

}  // namespace

namespace {

struct IO {
  Matrix<double> x, y;
};
IO read_io(const std::string& path) {
  const st::Reader f(path);
  return {f.matrix<double>("x"), f.matrix<double>("y")};
}

/// The directory of PyTorch-written fixtures: the committed ones, plus a
/// freshly generated set when CTest's interop fixture provides one.
std::vector<fs::path> torch_dirs() {
  std::vector<fs::path> dirs{kTests / "data"};
  if (const char* d = std::getenv("APEX_FFN_TORCH_DIR")) dirs.emplace_back(d);
  return dirs;
}

}  // namespace

TEST_CASE("A SwiGLU checkpoint written by PyTorch reproduces PyTorch's output", "[checkpoint][interop][import]") {
  for (const fs::path& dir : torch_dirs()) {
    const std::string weights = (dir / "swiglu_f64.safetensors").string();
    INFO(weights);
    REQUIRE(fs::exists(weights));
    const st::Reader file(weights);
    const auto config = nlohmann::json::parse(file.metadata().at("apex.config"));
    REQUIRE(config["layer"] == "SwiGLU");
    SwiGLU<double> ffn(config["d_model"].get<Index>(), config["d_ffn"].get<Index>(), std::uint64_t(0));
    load_checkpoint(file, ffn.param_values());
    const IO io = read_io((dir / "swiglu_f64_io.safetensors").string());
    const double err = rel_error(ffn.forward(io.x), io.y);
    INFO("relative error " << err);
    CHECK(err <= 1e-10);
  }
}

TEST_CASE("A SwiGLU checkpoint saved here loads into PyTorch", "[checkpoint][interop][export]") {
  // With APEX_FFN_INTEROP_DIR set (CTest's interop fixture) the files stay
  // there for tools/torch_reference.py check; otherwise they are verified
  // here and removed.
  TempDir tmp;
  const char* env = std::getenv("APEX_FFN_INTEROP_DIR");
  const fs::path dir = env ? fs::path(env) : tmp.path;
  fs::create_directories(dir);
  SwiGLU<double> ffn(6, 10, 77);
  const Matrix<double> x = Matrix<double>::Random(5, 6);
  const Matrix<double> y = ffn.forward(x);
  SaveOptions o;
  o.metadata = {{"format", "pt"}, {"apex.config", R"({"layer": "SwiGLU", "d_model": 6, "d_ffn": 10})"}};
  save_checkpoint((dir / "apex_swiglu_f64.safetensors").string(), ffn.param_values(), o);
  st::save<double>((dir / "apex_swiglu_f64_io.safetensors").string(),
                   {{"x", {5, 6}, x.data()}, {"y", {5, 6}, y.data()}}, st::DType::F64, {{"format", "pt"}});
  SwiGLU<double> back(6, 10, 1);
  load_checkpoint((dir / "apex_swiglu_f64.safetensors").string(), back.param_values());
  CHECK(rel_error(back.forward(read_io((dir / "apex_swiglu_f64_io.safetensors").string()).x), y) == 0.0);
}

namespace {

/// The MoE's parameters plus its balancing bias, as PyTorch's state_dict
/// holds them (`expert_bias` is a buffer there). `bias` is the staging copy:
/// after a load, hand it to the balancer.
template <class T>
ParamList<T> moe_state(MoEFFN<T>& moe, RowVector<T>& bias) {
  bias = moe.balancer().bias();
  ParamList<T> state = moe.param_values();
  state.push_back({"expert_bias", bias.data(), nullptr, 1, bias.cols()});
  return state;
}

MoEConfig moe_config(const nlohmann::json& c) {
  REQUIRE(c["layer"] == "MoEFFN");
  MoEConfig cfg;
  cfg.d_model = c["d_model"];
  cfg.d_ffn = c["d_ffn"];
  cfg.n_experts = c["n_experts"];
  cfg.n_active = c["n_active"];
  cfg.n_shared = c["n_shared"];
  cfg.weights_from_unbiased = c["weights_from_unbiased"];
  return cfg;
}

nlohmann::json config_json(const MoEConfig& c) {
  return {{"layer", "MoEFFN"},       {"d_model", c.d_model},     {"d_ffn", c.d_ffn},
          {"n_experts", c.n_experts}, {"n_active", c.n_active},   {"n_shared", c.n_shared},
          {"weights_from_unbiased", c.weights_from_unbiased}};
}

/// Smallest gap between the K-th and (K+1)-th routing score over tokens:
/// far from 0, rounding differences between implementations cannot change
/// which experts are selected.
double routing_margin(MoEFFN<double>& moe, const Matrix<double>& x) {
  const Matrix<double> scores =
      (x * moe.router().weight().transpose()).rowwise() + moe.balancer().bias();  // N × E
  const Index k = moe.config().n_active;
  if (k == scores.cols()) return 1.0;
  double margin = 1e300;
  for (Index t = 0; t < scores.rows(); ++t) {
    std::vector<double> s(scores.row(t).data(), scores.row(t).data() + scores.cols());
    std::sort(s.rbegin(), s.rend());
    margin = std::min(margin, s[std::size_t(k - 1)] - s[std::size_t(k)]);
  }
  return margin;
}

}  // namespace

TEST_CASE("MoE checkpoints written by PyTorch reproduce PyTorch's output", "[checkpoint][interop][import][moe]") {
  for (const fs::path& dir : torch_dirs()) {
    for (const char* name : {"moe_f64", "moe_f32", "moe_bf16", "moe_unbiased_f64"}) {
      const std::string weights = (dir / (std::string(name) + ".safetensors")).string();
      INFO(weights);
      REQUIRE(fs::exists(weights));
      const st::Reader file(weights);
      const MoEConfig cfg = moe_config(nlohmann::json::parse(file.metadata().at("apex.config")));
      const IO io = read_io((dir / (std::string(name) + "_io.safetensors")).string());

      MoEFFN<double> moe(cfg, std::uint64_t(0));
      // The balancing bias is state, not a parameter: a strict load of
      // params() alone names it as unexpected.
      CHECK_THROWS_WITH(load_checkpoint(file, moe.param_values()), Contains("unexpected 'expert_bias'"));
      RowVector<double> bias;
      const ParamList<double> state = moe_state(moe, bias);
      load_checkpoint(file, state);
      moe.balancer().set_bias(bias);
      CHECK(bias.cwiseAbs().maxCoeff() > 0);
      const double err = rel_error(moe.forward(io.x), io.y);
      INFO("double: relative error " << err);
      CHECK(err <= 1e-10);

      // The same file into a float layer.
      MoEFFN<float> moe32(cfg, std::uint64_t(0));
      RowVector<float> bias32;
      load_checkpoint(file, moe_state(moe32, bias32));
      moe32.balancer().set_bias(bias32);
      const Matrix<float> x32 = io.x.cast<float>();
      const double err32 = rel_error(moe32.forward(x32).cast<double>(), io.y);
      INFO("float: relative error " << err32);
      CHECK(err32 <= 1e-5);
    }
  }
}

TEST_CASE("MoE checkpoints saved here load into PyTorch", "[checkpoint][interop][export][moe]") {
  TempDir tmp;
  const char* env = std::getenv("APEX_FFN_INTEROP_DIR");
  const fs::path dir = env ? fs::path(env) : tmp.path;
  fs::create_directories(dir);

  MoEConfig cfg;
  cfg.d_model = 8;
  cfg.d_ffn = 12;
  cfg.n_experts = 5;
  cfg.n_active = 2;
  cfg.n_shared = 1;
  MoEFFN<double> moe(cfg, std::uint64_t(42));
  RowVector<double> b(5);
  b << 0.1, -0.05, 0.0, 0.02, -0.2;
  moe.balancer().set_bias(b);
  Rng rng(43);
  Matrix<double> x(7, 8);
  fill_uniform(x, rng, 1.5);
  REQUIRE(routing_margin(moe, x) > 1e-6);

  for (st::DType dtype : {st::DType::F64, st::DType::BF16}) {
    const std::string stem = std::string("apex_moe_") + (dtype == st::DType::F64 ? "f64" : "bf16");
    INFO(stem);
    RowVector<double> bias;
    SaveOptions o;
    o.dtype = dtype;
    o.metadata = {{"format", "pt"}, {"apex.config", config_json(cfg).dump()}};
    o.shapes = {{"expert_bias", {std::uint64_t(cfg.n_experts)}}};  // a 1-D buffer in PyTorch
    save_checkpoint((dir / (stem + ".safetensors")).string(), moe_state(moe, bias), o);

    // The output PyTorch must reproduce is that of the weights as stored
    // (BF16 rounds them), so it is computed from a reloaded layer.
    MoEFFN<double> stored(cfg, std::uint64_t(1));
    RowVector<double> stored_bias;
    const LoadResult r = load_checkpoint((dir / (stem + ".safetensors")).string(), moe_state(stored, stored_bias));
    CHECK(r.loaded.size() == 1 + 3 * std::size_t(cfg.n_experts + cfg.n_shared) + 1);
    stored.balancer().set_bias(stored_bias);
    REQUIRE(routing_margin(stored, x) > 1e-6);
    const Matrix<double> y = stored.forward(x);
    if (dtype == st::DType::F64) CHECK(rel_error(y, moe.forward(x)) == 0.0);
    if (dtype == st::DType::BF16) CHECK(rel_error(y, moe.forward(x)) < 1e-2);
    st::save<double>((dir / (stem + "_io.safetensors")).string(), {{"x", {7, 8}, x.data()}, {"y", {7, 8}, y.data()}},
                     st::DType::F64, {{"format", "pt"}});
  }
}
