// The demo's own parts (examples/demo): the context-embedding layer's
// gradients, the whole model's backward against finite differences, a short
// training run that must lower the loss (its optimiser is the library's,
// tested in test_optim.cpp), speculative decoding against plain decoding, the
// model packed for inference (float and bf16) against the float model, the
// sweep over every storage type (block formats included), the LoRA
// fine-tuning model (its backward against finite differences, a few steps
// on q4_0 weights), the PNG encoder and the command line.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "char_model.hpp"
#include "cli.hpp"
#include "context_embedding.hpp"
#include "decode.hpp"
#include "evaluate.hpp"
#include "finetune.hpp"
#include "finetune_report.hpp"
#include "gradcheck.hpp"
#include "lora_char_model.hpp"
#include "packed_char_model.hpp"
#include "plot.hpp"
#include "storage_sweep.hpp"
#include "text_data.hpp"
#include "trainer.hpp"

using namespace apex;
using namespace apex::demo;
using apex::test::check_params;
using apex::test::check_values;
using apex::test::dot_all;
using apex::test::random_matrix;
using Catch::Matchers::WithinAbs;

namespace {

const char* kText =
    "In the beginning God created the heaven and the earth.\n"
    "And the earth was without form, and void; and darkness was upon the face of the deep.\n"
    "And the Spirit of God moved upon the face of the waters.\n"
    "And God said, Let there be light: and there was light.\n"
    "And God saw the light, that it was good: and God divided the light from the darkness.\n"
    "And God called the light Day, and the darkness he called Night.\n"
    "And the evening and the morning were the first day.\n";

/// A model small enough for finite differences and Debug builds.
CharModelConfig small_config(Index vocab, bool gates) {
  CharModelConfig c;
  c.vocab = vocab;
  c.context = 3;
  c.embed = 2;
  c.preset = ModelPreset{"test", 8, 2, 12, 4, 2, 1, 4};
  c.mtp_heads = 2;
  c.skip_gates = gates;
  return c;
}

ContextIds random_ids(Index rows, Index cols, Index vocab, std::uint64_t seed) {
  Rng rng(seed);
  ContextIds ids(rows, cols);
  for (Index i = 0; i < ids.size(); ++i) ids.data()[i] = Index(rng.index(std::uint64_t(vocab)));
  return ids;
}

}  // namespace

TEST_CASE("ContextEmbedding concatenates the window's embeddings and projects them", "[demo][embedding]") {
  ContextEmbedding<double> emb(5, 3, 2, 4, 7);
  ContextIds ids(1, 3);
  ids << 4, 0, 4;
  const Matrix<double> y = emb.forward(ids);
  auto p = emb.params();
  const auto table = p[0].value(), w = p[1].value(), b = p[2].value();
  RowVector<double> e(6);
  e << table.row(4), table.row(0), table.row(4);
  const RowVector<double> want = e * w.transpose() + b;
  for (Index j = 0; j < 4; ++j) CHECK_THAT(y(0, j), WithinAbs(want(j), 1e-14));
}

TEST_CASE("ContextEmbedding gradients match finite differences", "[demo][embedding][gradcheck]") {
  ContextEmbedding<double> emb(6, 4, 3, 5, 11);
  // Repeated ids: a table row read twice must get both contributions.
  ContextIds ids = random_ids(7, 4, 6, 3);
  ids(0, 0) = ids(0, 3) = 2;
  const Matrix<double> r = random_matrix(7, 5, 4);
  ContextEmbedding<double>::Cache cache;
  emb.zero_grad();
  emb.backward(r, (emb.forward(ids, &cache), cache));
  const auto results = check_params(emb.params(), [&] { return dot_all(emb.forward(ids), r); });
  REQUIRE(results.size() == 3);
  APEX_CHECK_GRADS(results, 1e-6);
  for (const auto& g : results) CHECK(g.analytic_norm > 0);
}

TEST_CASE("ContextEmbedding rejects bad ids and shapes", "[demo][embedding]") {
  ContextEmbedding<float> emb(6, 4, 3, 5, 1);
  ContextIds ids = random_ids(2, 4, 6, 1);
  ids(1, 2) = 6;
  CHECK_THROWS_AS(emb.forward(ids), ValueError);
  CHECK_THROWS_AS(emb.forward(random_ids(2, 3, 6, 1)), ShapeError);
  CHECK_THROWS_AS(ContextEmbedding<float>(6, 0, 3, 5, 1), ConfigError);
}

TEST_CASE("The whole demo model's backward matches finite differences", "[demo][model][gradcheck]") {
  const Corpus corpus = Corpus::from_text(kText);
  CharModelConfig cfg = small_config(corpus.vocab.size(), false);
  cfg.kappa.rho = 1.0;  // the true gradient through κ (ρ < 1 scales it on purpose)
  CharModel<double> model(cfg, 5);
  model.set_kappa_U(2.0);
  // Non-zero κ parameters, so their gradients and the path into the router are exercised.
  Rng rng(9);
  for (auto& p : model.params())
    if (p.name.find("kappa") != std::string::npos) {
      auto v = p.value();
      fill_uniform(v, rng, 0.5);
    }
  const Batch batch = make_batch(corpus.train, {10, 100}, 6, cfg.context, cfg.mtp_heads, 0);

  CharModel<double>::Cache cache;
  Matrix<double> dl, dh;
  model.zero_grad();
  const auto out = model.forward(batch.context, &cache);
  model.loss(out, batch, &dl, &dh);
  model.backward(dl, dh, cache);
  const double reg = model.add_kappa_regularizer_grad();
  CHECK(reg > 0);
  const auto loss = [&] {
    double r = 0;
    for (auto& layer : model.moe_layers())
      for (const auto& e : layer.ffn().experts()) r += double(e.regularizer()) / double(layer.ffn().experts().size());
    return model.loss(model.forward(batch.context), batch).total + r;
  };
  // Every tensor, its first 12 entries (all of the smaller ones): the whole
  // model at every entry would take longer than the rest of the suite.
  std::vector<apex::test::GradCheck> results;
  for (const auto& p : model.params()) {
    const Matrix<double> analytic = p.grad();
    results.push_back(check_values(p.name, p.value_data, analytic.data(), std::min<Index>(p.size(), 12), loss));
  }
  REQUIRE(results.size() == model.params().size());
  APEX_CHECK_GRADS(results, 1e-6);
}

TEST_CASE("Batches hold context windows and look-ahead labels", "[demo][data]") {
  const std::vector<Index> text = {1, 2, 3, 4, 5, 6, 7};
  const Batch b = make_batch(text, {1, 4}, 2, 3, 2, 0);
  REQUIRE(b.rows() == 4);
  REQUIRE(b.chunks() == 2);
  // Row 0 is position 1: context (pad, pad, 1), target 2.
  CHECK(b.context(0, 0) == 0);
  CHECK(b.context(0, 2) == 1);
  CHECK(b.labels[0](0) == 2);
  // Row 3 is position 5: context (3, 4, 5); labels run past the text into the ignore index.
  CHECK(b.context(3, 0) == 3);
  CHECK(b.context(3, 2) == 5);
  CHECK(b.labels[1].size() == 4);
  CHECK(b.labels[1](2) == 7);
  CHECK(b.labels[1](3) == kIgnoreIndex);
}

TEST_CASE("A few training steps lower the demo model's loss", "[demo][train]") {
  const Corpus corpus = Corpus::from_text(kText, 0.2);
  CharModelConfig cfg = small_config(corpus.vocab.size(), true);
  cfg.preset = ModelPreset{"test", 16, 4, 32, 4, 2, 1, 8};
  cfg.context = 6;
  cfg.embed = 4;
  cfg.skip_penalty = 0.01;
  cfg.balancer_alpha = 1e-2;
  CharModel<float> model(cfg, 1);
  TrainOptions t;
  t.steps = 60;
  t.chunks = 4;
  t.chunk_len = 16;
  t.lr = 1e-2;
  t.warmup = 5;
  Trainer<float> trainer(model, corpus.train, t, corpus.vocab.id('\n'));
  const Index pad = corpus.vocab.id('\n');
  const double before = evaluate(model, corpus.val, 0, 64, pad, 32, 2).loss;
  std::vector<double> losses;
  for (long s = 0; s < t.steps; ++s) {
    const StepStats st = trainer.step();
    REQUIRE(std::isfinite(st.loss));
    REQUIRE(std::isfinite(st.grad_norm));
    CHECK(st.U >= 1.0);
    CHECK(st.U <= 4.0);
    REQUIRE(st.load.size() == 2);
    for (const auto& r : st.load) CHECK(r.tokens > 0);
    losses.push_back(st.main_loss);
  }
  const double first = (losses[0] + losses[1] + losses[2]) / 3;
  const double last = (losses[57] + losses[58] + losses[59]) / 3;
  INFO("train loss " << first << " -> " << last);
  CHECK(last < 0.8 * first);
  const double after = evaluate(model, corpus.val, 0, 64, pad, 32, 2).loss;
  INFO("validation loss " << before << " -> " << after);
  CHECK(after < before);
  for (const auto& p : model.params()) REQUIRE(p.value().allFinite());
  // The balancers moved their biases.
  CHECK(model.moe_layers()[0].ffn().balancer().bias().cwiseAbs().maxCoeff() > 0);
}

TEST_CASE("Greedy speculative decoding reproduces greedy decoding", "[demo][speculative]") {
  const Corpus corpus = Corpus::from_text(kText);
  CharModel<double> model(small_config(corpus.vocab.size(), true), 3);
  model.set_mode(SublayerMode::inference);
  const Index pad = corpus.vocab.id('\n');
  Rng rng(1);
  const auto prompt = corpus.vocab.encode("And God");
  const SpeculativeRun spec = speculative_generate(model, prompt, 24, 0.0, rng, pad);
  REQUIRE(Index(spec.tokens.size()) >= 24);
  CHECK(generate(model, prompt, Index(spec.tokens.size()), 0.0, rng, pad) == spec.tokens);
  CHECK(spec.stats.emitted == Index(spec.tokens.size()));
  CHECK(spec.stats.drafted == 2 * spec.stats.steps);
  const SpeculativeRun sampled = speculative_generate(model, prompt, 24, 1.0, rng, pad);
  CHECK(Index(sampled.tokens.size()) >= 24);
  for (Index t : sampled.tokens) CHECK((t >= 0 && t < corpus.vocab.size()));
}

TEST_CASE("The bigram baseline is normalised and fits its text", "[demo][data]") {
  const Corpus corpus = Corpus::from_text(kText);
  const BigramBaseline bigram(corpus.train, corpus.vocab.size());
  for (Index a : {0, 5}) {
    double total = 0;
    for (Index b = 0; b < corpus.vocab.size(); ++b) total += std::exp(-bigram.nll(a, b));
    CHECK_THAT(total, WithinAbs(1.0, 1e-12));
  }
  CHECK(bigram.mean_nll(corpus.train, 0, Index(corpus.train.size())) < std::log(double(corpus.vocab.size())));
}

TEST_CASE("PNG files carry valid chunks and the image's pixels", "[demo][plot]") {
  Image img(70, 3);
  img.set(0, 0, {255, 0, 0});
  img.set(69, 2, {1, 2, 3});
  draw_text(img, 1, 0, "ab", {0, 0, 0}, 1);
  const std::vector<std::uint8_t> f = png::encode(img);
  REQUIRE(f.size() > 8);
  CHECK(f[1] == 'P');
  // Walk the chunks, checking each CRC, and collect the zlib stream.
  std::vector<std::uint8_t> z;
  std::size_t i = 8;
  std::vector<std::string> types;
  auto be32 = [&](std::size_t at) {
    return std::uint32_t(f[at]) << 24 | std::uint32_t(f[at + 1]) << 16 | std::uint32_t(f[at + 2]) << 8 | f[at + 3];
  };
  while (i + 12 <= f.size()) {
    const std::uint32_t n = be32(i);
    types.emplace_back(f.begin() + std::ptrdiff_t(i + 4), f.begin() + std::ptrdiff_t(i + 8));
    CHECK(png::crc32(&f[i + 4], n + 4) == be32(i + 8 + n));
    if (types.back() == "IDAT") z.insert(z.end(), f.begin() + std::ptrdiff_t(i + 8), f.begin() + std::ptrdiff_t(i + 8 + n));
    i += 12 + n;
  }
  CHECK(types == std::vector<std::string>{"IHDR", "IDAT", "IEND"});
  CHECK(png::crc32(reinterpret_cast<const std::uint8_t*>("123456789"), 9) == 0xCBF43926u);  // the CRC-32 check value
#ifndef APEX_DEMO_HAVE_ZLIB
  // Stored blocks: undo them and the Sub filter, and compare every pixel.
  std::vector<std::uint8_t> raw;
  std::size_t at = 2;
  for (bool last = false; !last;) {
    last = z[at] & 1;
    const std::size_t len = z[at + 1] | std::size_t(z[at + 2]) << 8;
    raw.insert(raw.end(), z.begin() + std::ptrdiff_t(at + 5), z.begin() + std::ptrdiff_t(at + 5 + len));
    at += 5 + len;
  }
  CHECK(png::adler32(raw.data(), raw.size()) == (std::uint32_t(z[at]) << 24 | std::uint32_t(z[at + 1]) << 16 |
                                                  std::uint32_t(z[at + 2]) << 8 | z[at + 3]));
  REQUIRE(raw.size() == 3 * (1 + 70 * 3));
  for (int y = 0; y < 3; ++y) {
    const std::uint8_t* row = &raw[std::size_t(y) * (1 + 70 * 3)];
    CHECK(row[0] == 1);
    std::vector<std::uint8_t> px(70 * 3);
    for (int k = 0; k < 70 * 3; ++k) px[std::size_t(k)] = std::uint8_t(row[1 + k] + (k >= 3 ? px[std::size_t(k - 3)] : 0));
    for (int x = 0; x < 70; ++x) {
      const Rgb c = img.get(x, y);
      CHECK((px[std::size_t(3 * x)] == c.r && px[std::size_t(3 * x + 1)] == c.g && px[std::size_t(3 * x + 2)] == c.b));
    }
  }
#endif
  CHECK(img.get(0, 0).r == 255);
  CHECK(img.get(69, 2).b == 3);
}

TEST_CASE("The command line parses values and rejects bad flags", "[demo][cli]") {
  {
    const char* argv[] = {"demo",         "--steps", "12", "--seed=7", "--threads", "2", "--out", "x",
                          "--checkpoint=m.st", "--packed", "float"};
    const ParsedArgs a = parse_args(11, argv);
    REQUIRE(a.error.empty());
    CHECK(a.options.packed == "float");
    CHECK(a.options.steps == 12);
    CHECK(a.options.seed == 7);
    CHECK(a.options.threads == 2);
    CHECK(a.options.out == "x");
    CHECK(a.options.checkpoint == "m.st");
  }
  const std::vector<std::vector<const char*>> bad = {
      {"demo", "--steps"}, {"demo", "--steps", "0"}, {"demo", "--steps", "3x"}, {"demo", "--frobnicate"},
      {"demo", "--threads=-1"}, {"demo", "--out="}, {"demo", "steps"}, {"demo", "--packed", "fp16"},
      {"demo", "--sweep", "some"}, {"demo", "--d-model", "0"}, {"demo", "--d-ffn=x"}};
  for (const auto& argv : bad) {
    INFO(argv.back());
    CHECK_FALSE(parse_args(int(argv.size()), argv.data()).error.empty());
  }
  const char* help[] = {"demo", "--help"};
  CHECK(parse_args(2, help).help);
  CHECK(usage("demo").find("--checkpoint") != std::string::npos);
  CHECK(DemoOptions{}.packed == "bf16");  // the default run shows the bf16 model
  {
    const char* argv[] = {"demo", "--sweep", "none", "--d-model", "256", "--d-ffn=512"};
    const ParsedArgs a = parse_args(6, argv);
    REQUIRE(a.error.empty());
    CHECK(a.options.sweep == "none");
    CHECK(a.options.d_model == 256);
    CHECK(a.options.d_ffn == 512);
  }
  // By default the sweep runs on the tiny preset's widths.
  CHECK(DemoOptions{}.sweep == "all");
  CHECK(DemoOptions{}.d_model == ModelPreset::tiny().d_model);
  CHECK(DemoOptions{}.d_ffn == ModelPreset::tiny().d_ffn);
  // Fine-tuning: steps (0 skips it) and the adapters' rank, which must fit the widths.
  CHECK(DemoOptions{}.finetune_steps == 300);
  {
    const char* argv[] = {"demo", "--finetune-steps", "0", "--lora-rank=500"};  // no fine-tuning: any rank
    const ParsedArgs a = parse_args(4, argv);
    REQUIRE(a.error.empty());
    CHECK(a.options.finetune_steps == 0);
    CHECK(a.options.lora_rank == 500);
  }
  {
    const char* argv[] = {"demo", "--lora-rank", "65"};
    CHECK(parse_args(3, argv).error ==
          "option '--lora-rank' 65 exceeds min(--d-model, --d-ffn) = 64, the smaller side of the adapted projections");
    const char* wide[] = {"demo", "--lora-rank", "65", "--d-model", "256"};
    CHECK(parse_args(5, wide).error.empty());
  }
  for (const char* v : {"--lora-rank=0", "--finetune-steps=-1", "--finetune-steps=x"}) {
    const char* argv[] = {"demo", v};
    INFO(v);
    CHECK_FALSE(parse_args(2, argv).error.empty());
  }
}

TEST_CASE("The demo model packed for inference scores and decodes like the float model", "[demo][packed]") {
  // The packed sublayers hold no float expert weights and no gradients.
  static_assert(std::is_same_v<PackedCharModel<packed::bf16>::Sparse::FFNType,
                               PackedMoE<packed::bf16, KappaSwiGLU<float>>>);
  static_assert(std::is_same_v<PackedCharModel<packed::bf16>::Dense::FFNType, PackedSwiGLU<packed::bf16>>);

  // A briefly trained model with skip gates (all three sublayer kinds are packed).
  const Corpus corpus = Corpus::from_text(kText, 0.2);
  CharModelConfig cfg = small_config(corpus.vocab.size(), true);
  cfg.preset = ModelPreset{"test", 16, 4, 32, 4, 2, 1, 8};
  cfg.context = 6;
  cfg.embed = 4;
  CharModel<float> model(cfg, 1);
  TrainOptions t;
  t.steps = 30;
  t.chunks = 4;
  t.chunk_len = 16;
  t.lr = 1e-2;
  t.warmup = 5;
  const Index pad = corpus.vocab.id('\n');
  Trainer<float> trainer(model, corpus.train, t, pad);
  for (long s = 0; s < t.steps; ++s) REQUIRE(std::isfinite(trainer.step().loss));

  const auto score = [&](auto& m) { return evaluate(m, corpus.train, 0, 384, pad, 32, 4); };
  const EvalResult f = score(model);
  auto as_float = pack_model<float>(model);
  auto as_bf16 = pack_model<packed::bf16>(model);
  REQUIRE(as_bf16.n_layers() == model.n_layers());
  const EvalResult pf = score(as_float), pb = score(as_bf16);
  REQUIRE(f.tokens == 384);
  REQUIRE(pf.tokens == f.tokens);
  REQUIRE(pb.tokens == f.tokens);
  const double rel_float = std::abs(pf.loss - f.loss) / f.loss, rel_bf16 = std::abs(pb.loss - f.loss) / f.loss;
  INFO("loss: float " << f.loss << ", packed float " << pf.loss << " (rel " << rel_float << "), packed bf16 "
                      << pb.loss << " (rel " << rel_bf16 << ")");
  // Packed float: the same weights, other summation orders — fp32 rounding only.
  CHECK(rel_float < 1e-6);
  // bf16: the weights rounded to 8 significant bits. Measured 1.2e-5 here
  // (token errors partly cancel in the mean); float layers used by mistake
  // give f.loss to ~1e-9, a wrong conversion more.
  CHECK(rel_bf16 < 2e-5);
  CHECK(rel_bf16 > 2e-6);
  CHECK(pb.loss != f.loss);

  // The logits themselves, per token, on random windows.
  const ContextIds ids = random_ids(64, cfg.context, corpus.vocab.size(), 9);
  const Matrix<float> zf = model.forward(ids).logits;
  const auto logit_err = [&](const auto& m) { return double((m.forward(ids).logits - zf).norm() / zf.norm()); };
  const double zrel_float = logit_err(as_float), zrel_bf16 = logit_err(as_bf16);
  INFO("logits: relative error packed float " << zrel_float << ", packed bf16 " << zrel_bf16);
  // Measured 1.6e-2 for bf16 (four sublayers, windows the model never
  // trained on) and 1.5e-7 for packed float.
  CHECK(zrel_float < 1e-6);
  CHECK(zrel_bf16 < 2.5e-2);
  CHECK(zrel_bf16 > 5e-3);

  // Speculative verification is exact on the bf16 model: greedy speculative
  // decoding emits the tokens of plain greedy decoding of that same model.
  Rng rng(2);
  for (const char* prompt : {"And God", "the earth", "In the beginning"}) {
    INFO(prompt);
    const auto ids = corpus.vocab.encode(prompt);
    const SpeculativeRun spec = speculative_generate(as_bf16, ids, 40, 0.0, rng, pad);
    REQUIRE(Index(spec.tokens.size()) >= 40);
    CHECK(generate(as_bf16, ids, Index(spec.tokens.size()), 0.0, rng, pad) == spec.tokens);
    CHECK(spec.stats.emitted == Index(spec.tokens.size()));
  }
}

namespace {

/// A model of `preset`'s widths trained for `steps` steps on kText.
CharModel<float> briefly_trained(const Corpus& corpus, const ModelPreset& preset, long steps) {
  CharModelConfig cfg = small_config(corpus.vocab.size(), true);
  cfg.preset = preset;
  cfg.context = 6;
  cfg.embed = 4;
  CharModel<float> model(cfg, 1);
  TrainOptions t;
  t.steps = steps;
  t.chunks = 4;
  t.chunk_len = 16;
  t.lr = 1e-2;
  t.warmup = 5;
  Trainer<float> trainer(model, corpus.train, t, corpus.vocab.id('\n'));
  for (long s = 0; s < t.steps; ++s) REQUIRE(std::isfinite(trainer.step().loss));
  return model;
}

const char* const kAllTypes[] = {"f32", "bf16", "q8_0", "q4_0", "q4_k", "q6_k", "mxfp4"};

}  // namespace

TEST_CASE("The storage sweep scores every type the widths allow and names the others", "[demo][packed][quant]") {
  // d = 32, f = 64: whole blocks of 32 (q8_0, q4_0, mxfp4), not of 256 (q4_k, q6_k).
  const Corpus corpus = Corpus::from_text(kText, 0.2);
  CharModel<float> model = briefly_trained(corpus, ModelPreset{"test", 32, 4, 64, 4, 2, 1, 8}, 30);
  const Index pad = corpus.vocab.id('\n');
  const double f = evaluate(model, corpus.train, 0, 384, pad, 32, 4).loss;
  const StorageSweep s = run_storage_sweep(model, SweepText{corpus.train, 0, 384, pad, 32, 4}, 1, f);

  REQUIRE(s.rows.size() == std::size(kAllTypes));
  for (std::size_t i = 0; i < s.rows.size(); ++i) CHECK(s.rows[i].type == kAllTypes[i]);
  const auto delta = [&](const char* type) { return s.find(type)->eval.loss - f; };
  INFO("float " << f << "; delta f32 " << delta("f32") << ", bf16 " << delta("bf16") << ", q8_0 " << delta("q8_0")
                << ", q4_0 " << delta("q4_0") << ", mxfp4 " << delta("mxfp4"));
  for (const char* type : {"f32", "bf16", "q8_0", "q4_0", "mxfp4"}) {
    INFO(type);
    REQUIRE(s.find(type)->applicable);
    CHECK(s.find(type)->eval.tokens == 384);
    CHECK(std::isfinite(s.find(type)->eval.loss));
  }
  for (const char* type : {"q4_k", "q6_k"}) {
    INFO(type);
    const StorageLoss& r = *s.find(type);
    CHECK_FALSE(r.applicable);
    CHECK(r.reason.find("is not a multiple of 256") != std::string::npos);
    CHECK(r.reason.find(type) != std::string::npos);
  }
  // f32 is the float weights in other summation orders; bf16 rounds them to
  // 8 significant bits; q8_0 to 8-bit codes per 32 weights, and the
  // activations to q8_0 as well; the 4-bit formats keep 16 levels a block.
  // Measured here: f32 −1.4e-8, bf16 −5.6e-5, q8_0 +4.3e-5, q4_0 +4.0e-4,
  // mxfp4 +1.4e-2 nats (the demo's own run: +2.8e-4 for q8_0, +7.3e-3 and
  // +7.9e-3 for q4_0 and mxfp4, docs/demo.md).
  CHECK(std::abs(delta("f32")) < 1e-5);
  CHECK(std::abs(delta("bf16")) < 1e-3);
  CHECK(std::abs(delta("q8_0")) < 0.005);
  CHECK(std::abs(delta("q4_0")) < 0.05);
  CHECK(std::abs(delta("mxfp4")) < 0.05);
  // Quantized layers, not float ones used by mistake.
  for (const char* type : {"q8_0", "q4_0", "mxfp4"}) CHECK(s.find(type)->eval.loss != s.find("f32")->eval.loss);

  // Bytes: 4, 2, 34/32, 18/32 and 17/32 bytes a weight (no padding at these widths).
  CHECK(s.float_bytes == s.ffn_weights * 4);
  CHECK(s.find("f32")->ffn_bytes == s.float_bytes);
  CHECK(s.find("bf16")->ffn_bytes == s.ffn_weights * 2);
  CHECK(s.find("q8_0")->ffn_bytes == s.ffn_weights / 32 * 34);
  CHECK(s.find("q4_0")->ffn_bytes == s.ffn_weights / 32 * 18);
  CHECK(s.find("mxfp4")->ffn_bytes == s.ffn_weights / 32 * 17);

  // The console summary and the report carry every type: its loss, or why not.
  const std::string text = storage_sweep_summary(s);
  Markdown md;
  report_storage_sweep(md, s);
  const std::string report = md.str();
  for (const StorageLoss& r : s.rows) {
    INFO(r.type);
    const std::string shown = r.applicable ? fmt("%.6f", r.eval.loss) : "not applicable: " + r.reason;
    CHECK(text.find(r.type) != std::string::npos);
    CHECK(text.find(shown) != std::string::npos);
    CHECK(report.find("`" + r.type + "`") != std::string::npos);
    CHECK(report.find(shown) != std::string::npos);
    if (r.applicable) CHECK(report.find(fmt("%+.6f", r.eval.loss - f)) != std::string::npos);
  }
}

TEST_CASE("With widths of whole 256-weight blocks the K-quants are scored too", "[demo][packed][quant]") {
  const Corpus corpus = Corpus::from_text(kText, 0.2);
  CharModel<float> model = briefly_trained(corpus, ModelPreset{"test", 256, 2, 256, 2, 1, 1, 8}, 10);
  const Index pad = corpus.vocab.id('\n');
  const double f = evaluate(model, corpus.train, 0, 128, pad, 32, 4).loss;
  const StorageSweep s = run_storage_sweep(model, SweepText{corpus.train, 0, 128, pad, 32, 4}, 1, f);
  REQUIRE(s.rows.size() == std::size(kAllTypes));
  for (const StorageLoss& r : s.rows) {
    INFO(r.type << ": " << r.reason << " loss " << r.eval.loss << " vs float " << f);
    REQUIRE(r.applicable);
    CHECK(std::isfinite(r.eval.loss));
  }
  const auto delta = [&](const char* type) { return s.find(type)->eval.loss - f; };
  INFO("float " << f << "; delta q8_0 " << delta("q8_0") << ", q6_k " << delta("q6_k") << ", q4_k " << delta("q4_k"));
  // Measured: q8_0 −2.3e-4, q6_k +1.2e-3, q4_k −2.9e-3 nats (a barely
  // trained model: the 4-bit error moves its loss either way).
  CHECK(std::abs(delta("q8_0")) < 0.005);
  CHECK(std::abs(delta("q6_k")) < 0.01);
  CHECK(std::abs(delta("q4_k")) < 0.05);
  for (const char* type : {"q4_k", "q6_k"}) CHECK(s.find(type)->eval.loss != s.find("f32")->eval.loss);
  // 144 and 210 bytes per 256 weights.
  CHECK(s.find("q4_k")->ffn_bytes == s.ffn_weights / 256 * 144);
  CHECK(s.find("q6_k")->ffn_bytes == s.ffn_weights / 256 * 210);
}

TEST_CASE("The LoRA fine-tuning model's backward matches finite differences", "[demo][lora][gradcheck]") {
  // The packed engine holds float weights only, so the check runs on the
  // same model class with the adapters over the training layers in double
  // (LoraReferenceLayers): the demo's conversion, sublayers and backward.
  const Corpus corpus = Corpus::from_text(kText);
  CharModelConfig cfg = small_config(corpus.vocab.size(), false);
  cfg.kappa.rho = 1.0;  // the true gradient through κ's logit input (frozen here, but it carries ∂L/∂x)
  CharModel<double> trained(cfg, 5);
  trained.set_kappa_U(2.0);
  Rng rng(9);
  for (auto& p : trained.params())
    if (p.name.find("kappa") != std::string::npos) {
      auto v = p.value();
      fill_uniform(v, rng, 0.5);
    }
  LoraOptions o;
  o.rank = 2;
  o.alpha = 3;
  auto model = adapt_model<LoraReferenceLayers<double>>(trained, o, 7);
  const Batch batch = make_batch(corpus.train, {10, 100}, 6, cfg.context, cfg.mtp_heads, 0);

  // B = 0: the adapted model computes what the trained one does.
  const auto z0 = trained.forward(batch.context);
  const auto za = model.forward(batch.context);
  CHECK((za.logits - z0.logits).norm() <= 1e-12 * z0.logits.norm());
  CHECK((za.head_logits - z0.head_logits).norm() <= 1e-12 * z0.head_logits.norm());

  // B = 0 also makes every ∂L/∂A zero: random B, so both are exercised.
  ParamList<double> lora = lora_parameters(model);
  REQUIRE(lora.size() == 2 * 2 * (1 + 4 + 1));  // (A, B) × (gate_up, down) × (dense, 4 routed, 1 shared)
  for (auto& p : lora)
    if (p.name.find("lora_B") != std::string::npos) {
      auto v = p.value();
      fill_uniform(v, rng, 0.5);
    }
  decltype(model)::Cache cache;
  Matrix<double> dl, dh;
  model.zero_grad();
  const auto out = model.forward(batch.context, &cache);
  model.loss(out, batch, &dl, &dh);
  model.backward(dl, dh, cache);
  const auto loss = [&] { return model.loss(model.forward(batch.context), batch).total; };
  // Every adapter entry; the embedding's first entries check ∂L/∂x through every adapted layer.
  std::vector<apex::test::GradCheck> results;
  for (const auto& p : model.params()) {
    const bool adapter = is_lora_parameter(p.name);
    if (!adapter && p.name.rfind("embed.", 0) != 0) continue;
    const Matrix<double> analytic = p.grad();
    const Index n = adapter ? p.size() : std::min<Index>(p.size(), 12);
    results.push_back(check_values(p.name, p.value_data, analytic.data(), n, loss));
    CHECK(analytic.norm() > 0);
  }
  REQUIRE(results.size() == lora.size() + 3);
  APEX_CHECK_GRADS(results, 1e-6);
}

TEST_CASE("LoRA fine-tuning on q4_0 weights lowers the loss and changes only the adapters", "[demo][lora][train]") {
  static_assert(std::is_same_v<LoraCharModel<packed::q4_0>::Sparse::FFNType,
                               LoraMoE<PackedMoE<packed::q4_0, KappaSwiGLU<float>>>>);
  static_assert(std::is_same_v<LoraCharModel<packed::q4_0>::Dense::FFNType, LoraSwiGLU<PackedSwiGLU<packed::q4_0>>>);
  const Corpus corpus = Corpus::from_text(kText, 0.2);
  CharModel<float> trained = briefly_trained(corpus, ModelPreset{"test", 32, 4, 64, 4, 2, 1, 8}, 30);
  const Index pad = corpus.vocab.id('\n');
  auto model = adapt_model<LoraLayers<packed::q4_0>>(trained, LoraOptions{}, 3);
  for (const auto& s : model.moe_layers()) CHECK_FALSE(s.has_gradients());  // the adapters' are not allocated yet
  const Batch batch = make_batch(corpus.train, {0, 60, 120, 180}, 16, trained.context(), trained.mtp().num_heads(), pad);
  const auto batch_loss_of = [&](const auto& m) { return m.loss(m.forward(batch.context), batch).total; };

  // It starts as the q4_0 weights with float activations: off the float
  // model, near the packed q4_0 inference model (Q8_0 activations).
  const double start = batch_loss_of(model), float_loss = batch_loss_of(trained);
  const double inference = batch_loss_of(pack_model<packed::q4_0>(trained));
  INFO("batch loss: float " << float_loss << ", q4_0 inference " << inference << ", q4_0 LoRA start " << start);
  CHECK(start != float_loss);
  CHECK(std::abs(start - inference) < 0.02);

  // Everything but the adapters, and the routers (not in params()), as converted.
  std::vector<std::pair<std::string, Matrix<float>>> frozen;
  for (auto& p : model.params())
    if (!is_lora_parameter(p.name)) frozen.emplace_back(p.name, p.value());
  REQUIRE(frozen.size() > 10);
  std::vector<Matrix<float>> routers;
  for (const auto& s : model.moe_layers()) routers.push_back(s.ffn().router().weight());

  FineTuneOptions fo;
  fo.steps = 25;
  fo.lr = 1e-2;
  fo.warmup = 2;
  fo.balance = false;
  FineTuner<LoraCharModel<packed::q4_0>> tuner(model, corpus.train, fo, pad);
  for (const auto& s : model.moe_layers()) CHECK(s.has_gradients());  // params() allocated them (LoraMoE's too)
  REQUIRE(tuner.parameters().size() == 2 * 2 * (2 + 2 * 5));  // 2 dense layers, 2 MoE layers of 4 + 1 experts
  std::vector<double> losses;
  for (long s = 0; s < fo.steps; ++s) {
    const FineTuneStep st = tuner.step(batch);
    REQUIRE(std::isfinite(st.loss));
    REQUIRE(st.grad_norm > 0);
    losses.push_back(st.loss);
  }
  const double end = batch_loss_of(model);
  INFO("fine-tuning loss " << losses.front() << " -> " << losses.back() << ", batch loss " << start << " -> " << end);
  CHECK(losses.front() == Approx(start + 0.0).epsilon(0.02));
  CHECK(end < start - 0.1);
  std::size_t i = 0;
  for (auto& p : model.params()) {
    if (is_lora_parameter(p.name)) continue;
    INFO(p.name);
    REQUIRE(frozen[i].first == p.name);
    CHECK(frozen[i].second == Matrix<float>(p.value()));
    ++i;
  }
  for (std::size_t l = 0; l < routers.size(); ++l) CHECK(model.moe_layers()[l].ffn().router().weight() == routers[l]);
  CHECK_THROWS_WITH(FineTuneOptions{0}.validate(), Catch::Contains("steps must be positive"));
}

TEST_CASE("The fine-tuning report says how much of the gap was won back", "[demo][lora][report]") {
  FineTuneRun r;
  r.type = "q4_0";
  r.applicable = true;
  r.float_loss = 1.0;
  r.before.loss = 1.008;
  r.after.loss = 1.002;
  r.adapter_params = 1234;
  r.opt.steps = 10;
  r.log.pair_lora_ms = {30, 10, 20};
  r.log.pair_float_ms = {10, 5, 40};
  const std::string text = finetune_summary(r);
  INFO(text);
  CHECK(text.find("75% of the gap won back") != std::string::npos);
  CHECK(text.find("1234 adapter parameters") != std::string::npos);
  CHECK(text.find("20.0 ms fine-tuning vs 10.0 ms float training (2.00x, medians of 3 back-to-back pairs)") !=
        std::string::npos);
  r.after.loss = 0.99;
  CHECK(recovery_text(r) == fmt("all of the gap won back and %.4f bits/char more: the adapters also train the model "
                                "further", 0.01 / kLn2));
  r.before.loss = 0.999;
  CHECK(recovery_text(r) == "the packed model was not worse than the float model to start with");

  FineTuneRun k;
  k.type = "q4_k";
  k.reason = "reduction length 128 is not a multiple of 256";
  CHECK(finetune_summary(k) ==
        "LoRA fine-tuning on q4_k: not applicable: reduction length 128 is not a multiple of 256\n");
  Markdown md;
  report_finetune(md, {r, k}, 1.007, NAN);
  const std::string report = md.str();
  INFO(report);
  CHECK(report.find("| `q4_0` inference layers (Q8 activations; the sweep's row) | 1.007000 |") != std::string::npos);
  CHECK(report.find("Not applicable: reduction length 128 is not a multiple of 256.") != std::string::npos);
  CHECK(report.find("finetune_q4_0.png") != std::string::npos);
  CHECK(report.find("finetune_q4_k.png") == std::string::npos);
}
