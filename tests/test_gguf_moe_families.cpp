// A GGUF written from a Hugging Face-named safetensors checkpoint of each
// open MoE family (tests/data/family_*.safetensors, made with the family's
// PyTorch code by tools/moe_families.py, or a fresh set from
// routing_interop.cmake) gives that family's reference block output: the
// checkpoint is read under the family's names (io/name_maps.hpp), written as
// the family's llama.cpp architecture (inference/files/gguf/save.hpp), and read
// back by load_gguf_moe and load_gguf_moe_float.
#include <catch2/catch.hpp>

#include <apex/ffn/inference/files/gguf/load.hpp>
#include <apex/ffn/inference/files/gguf/save.hpp>
#include <apex/ffn/io/checkpoint.hpp>
#include <apex/ffn/io/gguf.hpp>
#include <apex/ffn/io/name_maps.hpp>

#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "families.hpp"
#include "temp_dir.hpp"

using namespace apex;

TEST_CASE("gguf_moe: a family checkpoint written as GGUF gives the family's reference output", "[gguf_moe][families]") {
  namespace fs = std::filesystem;
  std::vector<fs::path> dirs{fs::path(__FILE__).parent_path() / "data"};
  if (const char* d = std::getenv("APEX_FFN_FAMILY_DIR")) dirs.emplace_back(d);
  test::TempDir tmp;
  for (const fs::path& data : dirs)
    for (MoEFamily f : test::kFamilies) {
      const std::string path = (data / ("family_" + std::string(family_name(f)) + ".safetensors")).string();
      INFO(path);
      REQUIRE(fs::exists(path));
      const safetensors::Reader file(path);
      const MoEConfig cfg = test::fixture_config(f, file);
      MoEFFN<float> moe(cfg, 7);
      LoadOptions lo;
      lo.allow_unexpected = true;  // the test.* and grad.* tensors
      load_family_checkpoint(file, moe, f, file.metadata().at("prefix"), lo);
      GgufSaveOptions o;
      o.layer = 2;
      o.family = f;
      const std::string out = tmp / "block.gguf";
      save_gguf_moe(out, moe, packed::Dtype::f32, o);
      const gguf::File g = gguf::File::open(out);
      CHECK(g.architecture() == gguf::architecture_of(f).name);
      const Index n = file.at("test.x").shape[0];
      const Matrix<double> x = test::read_tensor(file, "test.x", n, cfg.d_model);
      const Matrix<double> y = test::read_tensor(file, "test.y", n, cfg.d_model);
      // Float weights (the checkpoint's F64 rounded once): float-level agreement.
      const Matrix<double> y_double = load_gguf_moe_float<double>(g, 2).forward(x);
      const Matrix<double> y_packed = load_gguf_moe(g, 2).forward(x.cast<float>()).cast<double>();
      CHECK((y_double - y).norm() <= 1e-6 * y.norm());
      CHECK((y_packed - y).norm() <= 1e-5 * y.norm());
    }
}
