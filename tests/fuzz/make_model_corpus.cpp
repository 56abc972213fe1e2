// Writes the seed corpora of the model-file fuzz targets — fuzz_gpt_oss
// (corpus_gpt_oss/) and fuzz_packed_layout (corpus_packed/) — with the
// library's own writers, for the small layers those targets load
// (fuzz_gpt_oss.hpp, fuzz_packed.hpp). The seeds are committed; run this
// again only when a writer's format changes:
//
//   c++ -std=c++17 -O1 -Iinclude -I/usr/include/eigen3 tests/fuzz/make_model_corpus.cpp \
//       -o /tmp/make_model_corpus && /tmp/make_model_corpus tests/fuzz
//
// (The config.json seeds of fuzz_hf_config, corpus_config/, are text files
// written by hand.)
#include <apex/ffn/inference.hpp>
#include <apex/ffn/inference/files/gpt_oss/load.hpp>
#include <apex/ffn/inference/files/gpt_oss/save.hpp>
#include <apex/ffn/io/gpt_oss_checkpoint.hpp>

#include <filesystem>
#include <string>

#include "fuzz_gpt_oss.hpp"
#include "fuzz_packed.hpp"

int main(int argc, char** argv) {
  namespace fs = std::filesystem;
  using namespace apex;
  const fs::path out = argc > 1 ? argv[1] : "tests/fuzz";
  fs::create_directories(out / "corpus_gpt_oss");
  fs::create_directories(out / "corpus_packed");

  GptOssMoE<float> oss(fuzz::fuzz_gpt_oss_config(), 3);
  save_gpt_oss_checkpoint((out / "corpus_gpt_oss" / "dense_f32.safetensors").string(), oss);
  const auto oss_packed = PackedMoE<packed::mxfp4, ClampedSwiGLU<float>>::from(oss, packed::Dtype::mxfp4);
  save_packed_gpt_oss((out / "corpus_gpt_oss" / "mxfp4.safetensors").string(), oss_packed);

  const MoEFFN<float> moe(fuzz::fuzz_packed_config(), 5);
  for (const packed::Dtype t : {packed::Dtype::q8_0, packed::Dtype::q4_0, packed::Dtype::mxfp4}) {
    const auto layer = PackedMoE<float>::from(moe, t);
    const std::string name = packed::dtype_name(t);
    save_packed_layout((out / "corpus_packed" / ("layout_" + name + ".bin")).string(), layer);
    save_packed_moe((out / "corpus_packed" / ("checkpoint_" + name + ".safetensors")).string(), layer);
  }
  return 0;
}
