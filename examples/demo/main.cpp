// The apex-ffn demo: trains a small character-level language model whose
// trunk is made only of this library's layers — dense SwiGLU and κ-SwiGLU
// mixture-of-experts sublayers behind skip gates, multi-token heads — on the
// King James Pentateuch, then measures what each feature does and writes a
// report with plots. See docs/demo.md.
#ifdef APEX_DEMO_HAVE_CHECKPOINT
#include <apex/ffn/checkpoint.hpp>
#endif

#include <Eigen/Core>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "char_model.hpp"
#include "cli.hpp"
#include "decode.hpp"
#include "evaluate.hpp"
#include "packed_char_model.hpp"
#include "plot.hpp"
#include "progress.hpp"
#include "report.hpp"
#include "text_data.hpp"
#include "trainer.hpp"

namespace {

using namespace apex;
using namespace apex::demo;
using Model = CharModel<float>;

constexpr double kLn2 = 0.6931471805599453;

/// The demo's model and training settings (see docs/demo.md for why).
CharModelConfig model_config(Index vocab) {
  CharModelConfig c;
  c.vocab = vocab;
  c.context = 16;
  c.embed = 16;
  c.preset = ModelPreset::tiny();
  c.mtp_heads = 4;
  c.mtp_lambda = 0.1;
  c.skip_threshold = 0.15;
  c.skip_penalty = 0.01;
  // The reference's α = 1e-3 is tuned for runs of 10⁵ steps; a few thousand
  // steps need a larger bias step to move the bias by O(1).
  c.balancer_alpha = 1e-2;
  return c;
}

TrainOptions train_options(const DemoOptions& o) {
  TrainOptions t;
  t.steps = o.steps;
  t.chunks = 16;
  t.chunk_len = 32;
  t.lr = 3e-3;
  t.warmup = std::min<long>(100, std::max<long>(1, o.steps / 10));
  t.U_max = 4.0;
  t.U_ramp = 0.5;
  t.seed = o.seed + 1000;
  return t;
}

/// Per-step records of one training run.
struct RunLog {
  std::vector<double> step, bpc, loss, lr, U, grad_norm, skip, val_step, val_bpc;
  std::vector<std::vector<double>> imbalance;               ///< [moe layer][step]
  std::vector<std::vector<std::vector<double>>> load;       ///< [moe layer][expert][step]
  std::vector<std::vector<Index>> counts;                   ///< [moe layer][expert]: whole run
  std::vector<Index> tokens_routed;                         ///< [moe layer]
  double seconds = 0, tokens = 0;

  void init(std::size_t layers, std::size_t experts) {
    imbalance.assign(layers, {});
    load.assign(layers, std::vector<std::vector<double>>(experts));
    counts.assign(layers, std::vector<Index>(experts, 0));
    tokens_routed.assign(layers, 0);
  }
  void add_load(const std::vector<LoadReport>& reports) {
    for (std::size_t l = 0; l < reports.size(); ++l) {
      imbalance[l].push_back(reports[l].imbalance);
      for (std::size_t e = 0; e < reports[l].load.size(); ++e) {
        load[l][e].push_back(reports[l].load[e]);
        counts[l][e] += reports[l].counts[e];
      }
      tokens_routed[l] += reports[l].tokens;
    }
  }
  /// Mean over MoE layers of the per-step imbalance, steps [0, n).
  double mean_imbalance(std::size_t n) const {
    double s = 0;
    for (const auto& v : imbalance) s += mean_of(v, 0, n);
    return imbalance.empty() ? NAN : s / double(imbalance.size());
  }
};

/// Load report of steps [first, last) of a run, for one MoE layer.
/// Mean per-expert load of one MoE layer over steps [first, last) (each step's load has equal weight).
LoadReport window_load(const RunLog& log, std::size_t layer, std::size_t first, std::size_t last) {
  LoadReport r;
  const auto& per_expert = log.load[layer];
  r.load.resize(per_expert.size());
  double mx = 0;
  for (std::size_t e = 0; e < per_expert.size(); ++e) {
    r.load[e] = mean_of(per_expert[e], first, last);
    mx = std::max(mx, r.load[e]);
  }
  r.imbalance = mx * double(per_expert.size());
  return r;
}

/// Greedy and sampled speculative decoding after each prompt, with plain
/// greedy decoding alongside to check that speculation changes nothing.
struct DecodeRuns {
  SpeculativeStats greedy, sampled;
  std::vector<std::vector<Index>> greedy_tokens, sampled_tokens;  ///< per prompt
  bool greedy_matches = true;  ///< speculative greedy == plain greedy on every prompt
};

void accumulate(SpeculativeStats& total, const SpeculativeStats& s) {
  total.steps += s.steps;
  total.drafted += s.drafted;
  total.accepted += s.accepted;
  total.emitted += s.emitted;
}

/// Prompt i samples from its own stream, seeded `seed + i` (greedy draws
/// nothing), so two models decoded with the same seed see the same random
/// numbers on every prompt, even after one prompt's texts have diverged.
template <class M>
DecodeRuns decode_prompts(const M& model, const std::vector<std::vector<Index>>& prompts, Index n, double temperature,
                          std::uint64_t seed, Index pad) {
  DecodeRuns d;
  for (std::size_t i = 0; i < prompts.size(); ++i) {
    const std::vector<Index>& ids = prompts[i];
    Rng rng(seed + i);
    const SpeculativeRun g = speculative_generate(model, ids, n, 0.0, rng, pad);
    const std::vector<Index> plain = generate(model, ids, Index(g.tokens.size()), 0.0, rng, pad);
    d.greedy_matches = d.greedy_matches && plain == g.tokens;
    accumulate(d.greedy, g.stats);
    d.greedy_tokens.push_back(g.tokens);
    const SpeculativeRun r = speculative_generate(model, ids, n, temperature, rng, pad);
    accumulate(d.sampled, r.stats);
    d.sampled_tokens.push_back(r.tokens);
  }
  return d;
}

/// How many of the first `n` tokens two decodings share before they differ.
Index common_prefix(const std::vector<Index>& a, const std::vector<Index>& b, Index n) {
  Index i = 0;
  while (i < n && std::size_t(i) < a.size() && std::size_t(i) < b.size() && a[std::size_t(i)] == b[std::size_t(i)]) ++i;
  return i;
}

/// The packed inference copy of the trained model, measured as the float one is.
struct PackedRun {
  std::string weights;  ///< "bf16" or "float"
  EvalResult eval;      ///< the whole validation text, skip gates as learned
  DecodeRuns decode;    ///< same prompts, lengths and sampling seed as the float model's
  std::size_t ffn_bytes = 0;  ///< packed FFN weights of all sublayers, padding included
  double seconds = 0;         ///< packing, evaluation and decoding
};

template <class Storage>
PackedRun run_packed(const Model& trained, const Corpus& corpus, Index pad, int threads,
                     const std::vector<std::vector<Index>>& prompts, Index n, double temperature, std::uint64_t seed) {
  const auto t0 = std::chrono::steady_clock::now();
  PackedRun r;
  r.weights = std::is_same_v<Storage, float> ? "float" : "bf16";
  PackedCharModel<Storage> m = pack_model<Storage>(trained);
  m.set_threads(threads);
  for (auto& s : m.dense_layers()) r.ffn_bytes += s.ffn().bytes();
  for (auto& s : m.moe_layers()) r.ffn_bytes += s.ffn().expert_bytes();
  r.eval = evaluate(m, corpus.val, 0, Index(corpus.val.size()), pad);
  r.decode = decode_prompts(m, prompts, n, temperature, seed, pad);
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return r;
}

#ifdef APEX_DEMO_HAVE_CHECKPOINT
/// Views of every MoE balancer's bias (copied into `buffers`), to save with the parameters.
std::vector<Param<float>> balancer_params(Model& model, std::vector<Matrix<float>>& buffers) {
  std::vector<Param<float>> out;
  buffers.clear();
  for (auto& layer : model.moe_layers()) buffers.push_back(layer.ffn().balancer().bias());
  Index i = 0;
  for (Index l = 0; l < model.n_layers(); ++l)
    if (model.is_moe(l)) {
      auto& b = buffers[std::size_t(i++)];
      out.push_back({"layers." + std::to_string(l) + ".ffn.balancer.bias", b.data(), b.data(), b.rows(), b.cols()});
    }
  return out;
}
#endif

int run(const DemoOptions& opt) {
  const auto wall0 = std::chrono::steady_clock::now();
#ifdef _OPENMP
  omp_set_num_threads(opt.threads);
#endif
  // Eigen's own products stay single-threaded: the library's MoE dispatch is
  // the one place threads are used, which keeps results independent of --threads.
  Eigen::setNbThreads(1);

  const Corpus corpus = Corpus::load(opt.data);
  const Index pad = corpus.vocab.contains('\n') ? corpus.vocab.id('\n') : 0;
  const CharModelConfig cfg = model_config(corpus.vocab.size());
  const TrainOptions topt = train_options(opt);
  std::filesystem::create_directories(opt.out);

  Model model(cfg, opt.seed);
  model.set_threads(opt.threads);
  const Index n_params = parameter_count(model.params());
  const ModelPreset& p = cfg.preset;
  const Index expert_params = 3 * p.d_model * p.d_ffn + 2 * p.d_ffn;  // w_gate, w_up, w_down, κ α and b
  const Index n_moe = Index(model.moe_layers().size());
  const Index active_params = n_params - n_moe * (p.n_experts - p.n_active) * expert_params;
  const Index tokens_per_step = topt.chunks * topt.chunk_len;

  std::printf("apex-ffn demo: character-level LM on %s\n", opt.data.c_str());
  std::printf("  text: %zu training + %zu validation characters, vocabulary %ld\n", corpus.train.size(),
              corpus.val.size(), long(corpus.vocab.size()));
  std::printf("  model: %ld parameters (%ld active per token), preset '%s', context %ld characters\n", long(n_params),
              long(active_params), p.name, long(cfg.context));
  std::printf("  training: %ld steps x %ld tokens, seed %llu, %d thread(s)\n", opt.steps, long(tokens_per_step),
              static_cast<unsigned long long>(opt.seed), opt.threads);
  std::fflush(stdout);

  // ---- Main run ---------------------------------------------------------
  const std::size_t experts = std::size_t(p.n_experts);
  std::vector<std::string> columns = {"step", "lr", "U", "loss", "train_bpc", "kappa_reg", "skip_penalty",
                                      "grad_norm", "skip_rate", "val_bpc"};
  std::vector<Index> moe_layer_ids;
  for (Index l = 0; l < model.n_layers(); ++l)
    if (model.is_moe(l)) moe_layer_ids.push_back(l);
  for (Index l : moe_layer_ids) columns.push_back("imbalance_layer" + std::to_string(l));
  for (Index l : moe_layer_ids)
    for (std::size_t e = 0; e < experts; ++e)
      columns.push_back("load_layer" + std::to_string(l) + "_expert" + std::to_string(e));
  CsvLog csv(opt.out + "/log.csv", columns);

  RunLog log;
  log.init(moe_layer_ids.size(), experts);
  const long eval_every = std::max<long>(1, opt.steps / 12);
  const Index quick_eval_tokens = 8192;
  Trainer<float> trainer(model, corpus.train, topt, pad);
  ProgressBar bar(opt.steps);
  double smooth = NAN;
  for (long s = 0; s < opt.steps; ++s) {
    const StepStats st = trainer.step();
    log.tokens += double(tokens_per_step);
    const double bpc = st.main_loss / kLn2;
    smooth = std::isfinite(smooth) ? 0.95 * smooth + 0.05 * bpc : bpc;
    log.step.push_back(double(s + 1));
    log.bpc.push_back(bpc);
    log.loss.push_back(st.loss);
    log.lr.push_back(st.lr);
    log.U.push_back(st.U);
    log.grad_norm.push_back(st.grad_norm);
    log.skip.push_back(mean_of(st.skip_rate));
    log.add_load(st.load);
    double val = NAN;
    if ((s + 1) % eval_every == 0 || s + 1 == opt.steps) {
      val = evaluate(model, corpus.val, 0, quick_eval_tokens, pad).bpc();
      log.val_step.push_back(double(s + 1));
      log.val_bpc.push_back(val);
    }
    std::vector<double> row = {double(s + 1), st.lr, st.U, st.loss, bpc, st.kappa_reg, st.skip_penalty, st.grad_norm,
                               log.skip.back(), val};
    for (const auto& r : st.load) row.push_back(r.imbalance);
    for (const auto& r : st.load)
      for (double x : r.load) row.push_back(x);
    csv.row(row);
    bar.update(s + 1, smooth, log.tokens);
  }
  csv.flush();
  log.seconds = bar.seconds();

  // ---- Evaluation -------------------------------------------------------
  std::printf("evaluating on the validation text...\n");
  std::fflush(stdout);
  const Index val_tokens = Index(corpus.val.size());
  const EvalResult learned = evaluate(model, corpus.val, 0, val_tokens, pad);
  model.set_gates_open(true);
  const EvalResult open = evaluate(model, corpus.val, 0, val_tokens, pad);
  model.set_gates_open(false);
  const BigramBaseline bigram(corpus.train, corpus.vocab.size());
  const double bigram_nll = bigram.mean_nll(corpus.val, 0, learned.tokens);
  // Unigram for scale: the entropy of the training character frequencies.
  double unigram_nll = 0;
  {
    std::vector<double> f(std::size_t(corpus.vocab.size()), 0.1);
    for (Index t : corpus.train) f[std::size_t(t)] += 1;
    double total = 0;
    for (double x : f) total += x;
    for (Index i = 0; i < learned.tokens; ++i) unigram_nll -= std::log(f[std::size_t(corpus.val[std::size_t(i)])] / total);
    unigram_nll /= double(learned.tokens);
  }

  // ---- Contrast: the same run without load balancing ---------------------
  const long contrast = std::min(opt.contrast_steps, opt.steps);
  RunLog nolb;
  if (contrast > 0) {
    Model plain(cfg, opt.seed);
    plain.set_threads(opt.threads);
    TrainOptions t = topt;
    t.balance = false;  // same seed, batches and schedule: only the balancer differs
    Trainer<float> tr(plain, corpus.train, t, pad);
    nolb.init(moe_layer_ids.size(), experts);
    ProgressBar cbar(contrast, "no-balancer");
    for (long s = 0; s < contrast; ++s) {
      const StepStats st = tr.step();
      nolb.add_load(st.load);
      nolb.tokens += double(tokens_per_step);
      cbar.update(s + 1, st.main_loss / kLn2, nolb.tokens);
    }
  }

  // ---- Speculative decoding ---------------------------------------------
  std::printf("decoding...\n");
  std::fflush(stdout);
  model.set_mode(SublayerMode::inference);
  const std::vector<std::string> prompts = {"And God said", "And the LORD spake unto Moses, saying,",
                                            "In the beginning"};
  std::vector<std::vector<Index>> prompt_ids;
  for (const auto& prompt : prompts) prompt_ids.push_back(corpus.vocab.encode(prompt));
  const Index gen_tokens = 300;
  const double temperature = 0.8;
  const std::uint64_t decode_seed = opt.seed + 2000;
  const DecodeRuns dec = decode_prompts(model, prompt_ids, gen_tokens, temperature, decode_seed, pad);
  const SpeculativeStats& greedy_stats = dec.greedy;
  const SpeculativeStats& sampled_stats = dec.sampled;
  const bool greedy_matches = dec.greedy_matches;
  const std::string greedy_text = prompts[0] + corpus.vocab.decode(dec.greedy_tokens[0]);
  const std::string sample_text = prompts[0] + corpus.vocab.decode(dec.sampled_tokens[0]);
  model.set_mode(SublayerMode::training);

  // ---- The packed inference copy ------------------------------------------
  // The trained FFN layers packed into the inference layers (bf16 by
  // default), then evaluated and decoded exactly as the float model was.
  std::optional<PackedRun> inf;
  if (opt.packed != "none") {
    std::printf("packing the FFN layers (%s) for inference, evaluating and decoding...\n", opt.packed.c_str());
    std::fflush(stdout);
    inf = opt.packed == "bf16"
              ? run_packed<packed::bf16>(model, corpus, pad, opt.threads, prompt_ids, gen_tokens, temperature, decode_seed)
              : run_packed<float>(model, corpus, pad, opt.threads, prompt_ids, gen_tokens, temperature, decode_seed);
    std::printf("  %s FFN weights: validation loss %.6f nats/char vs float %.6f (relative difference %+.2e)\n",
                inf->weights.c_str(), inf->eval.loss, learned.loss, (inf->eval.loss - learned.loss) / learned.loss);
    std::fflush(stdout);
  }

  // ---- Checkpoint ---------------------------------------------------------
  std::string checkpoint_note;
#ifdef APEX_DEMO_HAVE_CHECKPOINT
  if (!opt.checkpoint.empty()) {
    std::vector<Matrix<float>> buffers;
    ParamList<float> all = model.params();
    for (auto& b : balancer_params(model, buffers)) all.push_back(b);
    SaveOptions so;
    so.metadata = {{"vocab", corpus.vocab.chars()}, {"context", std::to_string(cfg.context)},
                   {"preset", p.name}, {"seed", std::to_string(opt.seed)}, {"steps", std::to_string(opt.steps)}};
    save_checkpoint(opt.checkpoint, all, so);
    // Reload into a differently initialised model: the validation loss must be the same.
    Model reloaded(cfg, opt.seed + 77);
    std::vector<Matrix<float>> rbuf;
    ParamList<float> rall = reloaded.params();
    const auto rb = balancer_params(reloaded, rbuf);
    for (auto& b : rb) rall.push_back(b);
    load_checkpoint(opt.checkpoint, rall);
    for (std::size_t i = 0; i < rbuf.size(); ++i) reloaded.moe_layers()[i].ffn().balancer().set_bias(rbuf[i]);
    const double a = evaluate(model, corpus.val, 0, quick_eval_tokens, pad).loss;
    const double b = evaluate(reloaded, corpus.val, 0, quick_eval_tokens, pad).loss;
    checkpoint_note = fmt("Saved to `%s` (%.0f KiB, %zu tensors, float32). Reloaded into a freshly initialised model: "
                          "validation loss %.6f vs %.6f — %s.",
                          opt.checkpoint.c_str(), double(std::filesystem::file_size(opt.checkpoint)) / 1024.0,
                          all.size(), a, b, a == b ? "identical" : "DIFFERENT");
  }
#endif

  // ---- Plots --------------------------------------------------------------
  {
    Series train{"train (moving avg 50)", log.step, moving_average(log.bpc, 50), palette(0)};
    Series val{"validation (first 8k chars)", log.val_step, log.val_bpc, palette(1), 3};
    Series base{"bigram baseline", {log.step.front(), log.step.back()}, {bigram_nll / kLn2, bigram_nll / kLn2},
                palette(7)};
    ChartOptions co;
    co.title = "Character-level LM: loss";
    co.x_label = "training step";
    co.y_label = "bits per character";
    co.y_min = 1.0;
    co.y_max = std::ceil(std::max(bigram_nll / kLn2, mean_of(log.bpc, 0, 10)) + 0.2);
    write_png(opt.out + "/loss.png", line_chart({train, val, base}, co));
  }
  {
    std::vector<Series> s;
    const std::size_t layer = 0;  // the first MoE layer
    for (std::size_t e = 0; e < experts; ++e)
      s.push_back({"expert " + std::to_string(e), log.step, moving_average(log.load[layer][e], 50), palette(e)});
    s.push_back({"even share 1/E", {log.step.front(), log.step.back()}, {1.0 / double(experts), 1.0 / double(experts)},
                 {120, 120, 120}, 1});
    ChartOptions co;
    co.title = "Expert load, MoE layer " + std::to_string(moe_layer_ids[layer]) + " (balancer on)";
    co.x_label = "training step";
    co.y_label = "share of routed slots (moving avg 50 steps)";
    co.y_min = 0;
    co.y_max = 0.5;
    write_png(opt.out + "/expert_load.png", line_chart(s, co));
  }
  if (contrast > 0) {
    std::vector<Series> s;
    std::vector<double> on(std::size_t(contrast), 0.0), off(std::size_t(contrast), 0.0), x;
    for (long i = 0; i < contrast; ++i) {
      x.push_back(double(i + 1));
      for (std::size_t l = 0; l < moe_layer_ids.size(); ++l) {
        on[std::size_t(i)] += log.imbalance[l][std::size_t(i)] / double(moe_layer_ids.size());
        off[std::size_t(i)] += nolb.imbalance[l][std::size_t(i)] / double(moe_layer_ids.size());
      }
    }
    s.push_back({"balancer on", x, moving_average(on, 25), palette(2)});
    s.push_back({"balancer off", x, moving_average(off, 25), palette(1)});
    ChartOptions co;
    co.title = "Load imbalance (max/mean), mean of MoE layers";
    co.x_label = "training step";
    co.y_label = "max load / mean load (moving avg 25 steps)";
    co.y_min = 1.0;
    write_png(opt.out + "/imbalance.png", line_chart(s, co));
  }

  // ---- Report -------------------------------------------------------------
  // Float FFN weights for scale: w_gate, w_up, w_down of every expert and dense FFN.
  const double swiglu_bytes = 3.0 * double(p.d_model) * double(p.d_ffn) * sizeof(float);
  const double float_ffn_bytes =
      swiglu_bytes * (double(model.dense_layers().size()) + double(n_moe) * double(p.n_experts + p.n_shared));
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - wall0).count();
  Markdown md;
  md.heading(1, "apex-ffn demo report");
  md.para(fmt("Character-level language model on `%s`: %zu training and %zu validation characters, vocabulary of %ld. ",
              std::filesystem::path(opt.data).filename().string().c_str(), corpus.train.size(), corpus.val.size(),
              long(corpus.vocab.size())) +
          fmt("Trunk: embeddings of the last %ld characters, concatenated and projected to d = %ld, then the `%s` "
              "preset's %ld FFN sublayers (dense SwiGLU on even layers, κ-SwiGLU MoE with %ld experts, top-%ld, "
              "%ld shared on odd layers), each behind a skip gate, a final RMSNorm, the main head and %ld "
              "multi-token heads. ",
              long(cfg.context), long(p.d_model), p.name, long(p.n_layers), long(p.n_experts), long(p.n_active),
              long(p.n_shared), long(cfg.mtp_heads)) +
          fmt("%ld parameters, %ld active per token.", long(n_params), long(active_params)));
  md.para(fmt("Training: %ld steps of %ld tokens (%.2f M tokens), AdamW (peak lr %.0e, cosine), clip %.1f, κ's U "
              "ramped 1 → %.0f over the first %.0f%% of the steps, skip penalty λ = %.3g, balancer α = %.0e; seed %llu, "
              "%d thread(s). Training took %.1f s (%.1fk tokens/s); the whole demo %.1f s.",
              opt.steps, long(tokens_per_step), log.tokens / 1e6, topt.lr, topt.clip, topt.U_max, topt.U_ramp * 100,
              cfg.skip_penalty, cfg.balancer_alpha, static_cast<unsigned long long>(opt.seed), opt.threads,
              log.seconds, log.tokens / log.seconds / 1000, wall));

  md.heading(2, "Validation loss");
  {
    std::vector<std::vector<std::string>> rows = {
        {"unigram (character frequencies)", fmt("%.3f", unigram_nll), fmt("%.3f", unigram_nll / kLn2)},
        {"bigram baseline (add-0.1 smoothing, same data)", fmt("%.3f", bigram_nll), fmt("%.3f", bigram_nll / kLn2)},
        {"**this model**, skip gates as learned", fmt("**%.3f**", learned.loss), fmt("**%.3f**", learned.bpc())},
        {"this model, skip gates forced open", fmt("%.3f", open.loss), fmt("%.3f", open.bpc())}};
    if (inf)
      rows.push_back({"this model, FFN layers packed in " + inf->weights + " (inference layers)",
                      fmt("%.3f", inf->eval.loss), fmt("%.3f", inf->eval.bpc())});
    md.table({"model", "nats/char", "bits/char"}, rows);
  }
  md.para(fmt("Scored on all %ld validation positions (the held-out end of Deuteronomy). The model needs %.0f%% of the "
              "bigram baseline's bits per character; next-character accuracy %.1f%%.",
              long(learned.tokens), 100 * learned.loss / bigram_nll, 100 * learned.main_accuracy));
  if (inf)
    md.para(fmt("Packed for inference (`pack_model<%s>`: every FFN sublayer's expert weights in %s, no gradient "
                "buffers; routers, balancing bias, κ, norms and skip gates stay float): validation loss %.6f nats/char "
                "against %.6f for the float model, a relative difference of %+.2e; next-character accuracy %.2f%% vs "
                "%.2f%%, mean skip rate %.2f%% vs %.2f%%. The packed FFN weights take %.0f KiB (float: %.0f KiB). "
                "Packing, evaluating and decoding took %.1f s.",
                inf->weights.c_str(), inf->weights.c_str(), inf->eval.loss, learned.loss,
                (inf->eval.loss - learned.loss) / learned.loss, 100 * inf->eval.main_accuracy,
                100 * learned.main_accuracy, 100 * inf->eval.mean_skip_rate(), 100 * learned.mean_skip_rate(),
                double(inf->ffn_bytes) / 1024.0, double(float_ffn_bytes) / 1024.0, inf->seconds));

  md.heading(2, "Load balancing");
  {
    std::vector<std::vector<std::string>> rows;
    for (std::size_t l = 0; l < moe_layer_ids.size(); ++l) {
      const LoadReport whole = LoadBalancer<float>::make_report(log.counts[l], log.tokens_routed[l], p.n_active);
      const std::size_t n = log.step.size();
      const LoadReport last = window_load(log, l, n - std::min<std::size_t>(n, std::size_t(n / 10 + 1)), n);
      std::vector<std::string> r = {fmt("%ld", long(moe_layer_ids[l]))};
      std::string loads;
      for (std::size_t e = 0; e < experts; ++e) loads += fmt("%s%.3f", e ? " / " : "", whole.load[e]);
      r.push_back(loads);
      r.push_back(fmt("%.3f", whole.imbalance));
      r.push_back(fmt("%.3f", mean_of(log.imbalance[l])));
      r.push_back(fmt("%.3f", last.imbalance));
      std::string bias;
      const auto& b = model.moe_layers()[l].ffn().balancer().bias();
      for (Index e = 0; e < b.cols(); ++e) bias += fmt("%s%+.2f", e ? " " : "", double(b(e)));
      r.push_back(bias);
      rows.push_back(r);
    }
    md.para(fmt("Share of the routed (token, slot) assignments each expert received (even = %.3f). \"max/mean\" is "
                "the imbalance figure of the balancer (1 = perfectly even, %ld = everything on one expert).",
                1.0 / double(experts), long(experts)));
    md.table({"MoE layer", "load per expert, whole run", "max/mean, whole run", "max/mean per step, mean",
              "max/mean, last 10%", "final bias"},
             rows);
  }
  if (contrast > 0) {
    std::vector<std::vector<std::string>> rows;
    for (std::size_t l = 0; l < moe_layer_ids.size(); ++l) {
      const LoadReport off = window_load(nolb, l, 0, std::size_t(contrast));
      const LoadReport on = window_load(log, l, 0, std::size_t(contrast));
      const LoadReport off_end = window_load(nolb, l, std::size_t(contrast * 3 / 4), std::size_t(contrast));
      const LoadReport on_end = window_load(log, l, std::size_t(contrast * 3 / 4), std::size_t(contrast));
      rows.push_back({fmt("%ld", long(moe_layer_ids[l])), fmt("%.3f", on.imbalance), fmt("%.3f", off.imbalance),
                      fmt("%.3f", on_end.imbalance), fmt("%.3f", off_end.imbalance)});
    }
    md.para(fmt("Contrast: the same model, seed and batches trained for %ld steps with the balancer's bias updates "
                "switched off, against the first %ld steps of the run above (mean per-step max/mean over all MoE "
                "layers: %.3f with the balancer, %.3f without).",
                contrast, contrast, log.mean_imbalance(std::size_t(contrast)), nolb.mean_imbalance(std::size_t(contrast))));
    md.table({"MoE layer", "max/mean, balancer on", "max/mean, balancer off", "last quarter, on", "last quarter, off"},
             rows);
  }
  md.image("expert load over training", "expert_load.png");
  if (contrast > 0) md.image("imbalance with and without the balancer", "imbalance.png");

  md.heading(2, "Skip gates");
  {
    std::vector<std::vector<std::string>> rows;
    double saved = 0, work = 0;
    for (Index l = 0; l < model.n_layers(); ++l) {
      const double cost = model.is_moe(l) ? double(p.n_active + p.n_shared) : 1.0;  // in SwiGLU evaluations
      saved += cost * learned.skip_rate[std::size_t(l)];
      work += cost;
      rows.push_back({fmt("%ld", long(l)), model.is_moe(l) ? "κ-SwiGLU MoE" : "SwiGLU",
                      fmt("%.1f%%", 100 * learned.skip_rate[std::size_t(l)])});
    }
    md.para(fmt("Share of validation tokens whose FFN each gate skipped (τ = %.2f, inference mode: skipped tokens are "
                "not computed). Mean skip rate %.1f%%, which saves %.1f%% of the FFN work (MoE layers weighted by "
                "the %ld expert evaluations a token costs there).",
                cfg.skip_threshold, 100 * learned.mean_skip_rate(), 100 * saved / work, long(p.n_active + p.n_shared)));
    md.table({"layer", "FFN", "skip rate"}, rows);
    md.para(fmt("Cost in validation loss: %.4f bits/char with the gates as learned vs %.4f with every gate forced "
                "open (τ = 0), a difference of %+.4f bits/char (%+.2f%%).",
                learned.bpc(), open.bpc(), learned.bpc() - open.bpc(), 100 * (learned.loss - open.loss) / open.loss));
  }

  md.heading(2, "Multi-token heads");
  {
    std::vector<std::vector<std::string>> rows = {
        {"main head", "t+1", fmt("%.1f%%", 100 * learned.main_accuracy), fmt("%.3f", learned.bpc())}};
    for (std::size_t i = 0; i < learned.head_accuracy.size(); ++i)
      rows.push_back({fmt("head %zu", i + 1), fmt("t+%zu", i + 2), fmt("%.1f%%", 100 * learned.head_accuracy[i]),
                      fmt("%.3f", learned.head_loss[i] / kLn2)});
    md.para("Top-1 accuracy on the validation text: head k predicts the character k positions after the main head's.");
    md.table({"head", "predicts", "accuracy", "bits/char"}, rows);
  }

  md.heading(2, "Speculative decoding");
  md.para(fmt("The heads draft %ld characters; one main-model forward over the %ld context windows verifies them. "
              "%ld characters after each of %zu prompts.",
              long(cfg.mtp_heads), long(cfg.mtp_heads + 1), long(gen_tokens), prompts.size()));
  md.table({"mode", "acceptance rate", "tokens per main-model step", "main-model steps"},
           {{"greedy", fmt("%.1f%%", 100 * greedy_stats.acceptance_rate()), fmt("%.2f", greedy_stats.tokens_per_step()),
             fmt("%ld", long(greedy_stats.steps))},
            {fmt("sampled (T = %.1f)", temperature), fmt("%.1f%%", 100 * sampled_stats.acceptance_rate()),
             fmt("%.2f", sampled_stats.tokens_per_step()), fmt("%ld", long(sampled_stats.steps))}});
  md.para(std::string("Greedy speculative output identical to plain greedy decoding: ") +
          (greedy_matches ? "**yes**" : "**no**") +
          ". Sampled speculative decoding is distributed as sampling from the main model alone (speculative "
          "sampling, with the heads' softmax as the draft distribution).");
  if (inf) {
    const DecodeRuns& d = inf->decode;
    std::vector<std::vector<std::string>> rows;
    std::string same_greedy, same_sampled;
    for (std::size_t i = 0; i < prompts.size(); ++i) {
      const Index g = common_prefix(d.greedy_tokens[i], dec.greedy_tokens[i], gen_tokens);
      const Index s = common_prefix(d.sampled_tokens[i], dec.sampled_tokens[i], gen_tokens);
      same_greedy += fmt("%s%ld", i ? ", " : "", long(g));
      same_sampled += fmt("%s%ld", i ? ", " : "", long(s));
    }
    md.para(fmt("The same decoding on the model packed in %s (same prompts, lengths and sampling seed). \"same as "
                "float\" counts the leading characters, of %ld per prompt, equal to the float model's output.",
                inf->weights.c_str(), long(gen_tokens)));
    md.table({"mode", "acceptance rate", "tokens per main-model step", "same as float, per prompt"},
             {{"greedy, " + inf->weights, fmt("%.1f%%", 100 * d.greedy.acceptance_rate()),
               fmt("%.2f", d.greedy.tokens_per_step()), same_greedy},
              {fmt("sampled (T = %.1f), ", temperature) + inf->weights, fmt("%.1f%%", 100 * d.sampled.acceptance_rate()),
               fmt("%.2f", d.sampled.tokens_per_step()), same_sampled}});
    md.para(std::string("On the packed model too, greedy speculative output is identical to plain greedy decoding of "
                        "that model: ") +
            (d.greedy_matches ? "**yes**" : "**no**") +
            ". Where its text departs from the float model's, the packed weights changed an argmax or a sampling "
            "decision, and the rest of the text follows from that character.");
  }

  md.heading(2, "Generated sample");
  md.para(fmt("Speculative sampling at T = %.1f from the prompt \"%s\":", temperature, prompts[0].c_str()));
  md.code(sample_text);
  md.para("Greedy:");
  md.code(greedy_text);

  if (!checkpoint_note.empty()) {
    md.heading(2, "Checkpoint");
    md.para(checkpoint_note);
  }
  md.heading(2, "Files");
  md.bullet("`log.csv`: one row per training step (loss, learning rate, U, gradient norm, skip rate, per-layer "
            "imbalance and per-expert load; validation loss where evaluated)");
  md.bullet("`loss.png`, `expert_load.png`" + std::string(contrast > 0 ? ", `imbalance.png`" : ""));
  md.end_list();
  md.image("loss curves", "loss.png");

  const std::string report = md.str();
  {
    std::ofstream f(opt.out + "/report.md");
    f << report;
    if (!f) throw std::runtime_error("cannot write " + opt.out + "/report.md");
  }
  std::printf("\n%s", report.c_str());
  std::printf("Report, log and plots written to %s/\n", opt.out.c_str());

  // Exit status: the demo's claims, checked.
  bool ok = learned.loss < bigram_nll && std::isfinite(learned.loss) && greedy_matches;
  if (inf) ok = ok && std::isfinite(inf->eval.loss) && inf->decode.greedy_matches;
  if (!ok) std::fprintf(stderr, "demo: the trained model did not meet its checks (see the report)\n");
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  const ParsedArgs args = parse_args(argc, argv);
  const std::string prog = argc > 0 ? std::filesystem::path(argv[0]).filename().string() : "demo";
  if (!args.error.empty()) {
    std::fprintf(stderr, "%s: %s\n\n%s", prog.c_str(), args.error.c_str(), usage(prog).c_str());
    return 2;
  }
  if (args.help) {
    std::printf("%s", usage(prog).c_str());
    return 0;
  }
#ifndef APEX_DEMO_HAVE_CHECKPOINT
  if (!args.options.checkpoint.empty()) {
    std::fprintf(stderr, "%s: --checkpoint is unavailable: this build has no checkpoint support (nlohmann_json "
                 "was not found when it was configured)\n", prog.c_str());
    return 2;
  }
#endif
  if (!std::ifstream(args.options.data)) {
    std::fprintf(stderr, "%s: cannot read the training text '%s' (option --data)\n", prog.c_str(),
                 args.options.data.c_str());
    return 2;
  }
  try {
    return run(args.options);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: error: %s\n", prog.c_str(), e.what());
    return 1;
  }
}
