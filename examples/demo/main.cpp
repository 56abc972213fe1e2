// The apex-ffn demo: trains a small character-level language model whose
// trunk is made only of this library's layers — dense SwiGLU and κ-SwiGLU
// mixture-of-experts sublayers behind skip gates, multi-token heads — on the
// King James Pentateuch, then measures what each feature does, packs the
// FFN layers in every storage type, fine-tunes LoRA adapters on the q4_0
// weights, and writes a report with plots. See docs/demo.md.
#include <Eigen/Core>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "char_model.hpp"
#ifdef APEX_DEMO_HAVE_CHECKPOINT
#include "checkpoint_check.hpp"
#endif
#include "cli.hpp"
#include "decode_runs.hpp"
#include "demo_plots.hpp"
#include "demo_report.hpp"
#include "demo_run.hpp"
#include "finetune_report.hpp"
#include "finetune_run.hpp"
#include "packed_run.hpp"
#include "storage_sweep.hpp"
#include "text_data.hpp"
#include "trainer.hpp"
#include "training_run.hpp"
#include "validation.hpp"

namespace {

using namespace apex;
using namespace apex::demo;
using Model = CharModel<float>;

/// The demo's model and training settings (see docs/demo.md for why).
CharModelConfig model_config(Index vocab, const DemoOptions& o) {
  CharModelConfig c;
  c.vocab = vocab;
  c.context = 16;
  c.embed = 16;
  c.preset = ModelPreset::tiny();
  // --d-model/--d-ffn: other widths, e.g. whole 256-weight blocks for q4_k and q6_k.
  if (o.d_model != c.preset.d_model || o.d_ffn != c.preset.d_ffn) {
    c.preset.name = "tiny with --d-model/--d-ffn";
    c.preset.d_model = o.d_model;
    c.preset.d_ffn = o.d_ffn;
  }
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

/// Threads for the library's MoE dispatch only: Eigen's own products stay
/// single-threaded, which keeps results independent of --threads.
void use_threads(int threads) {
#ifdef _OPENMP
  omp_set_num_threads(threads);
#else
  (void)threads;
#endif
  Eigen::setNbThreads(1);
}

/// Parameters one token uses: all but the routed experts it is not sent to.
Index active_parameters(const Model& model, Index n_params) {
  const ModelPreset& p = model.config().preset;
  const Index expert_params = 3 * p.d_model * p.d_ffn + 2 * p.d_ffn;  // w_gate, w_up, w_down, κ α and b
  const Index n_moe = Index(model.moe_layers().size());
  return n_params - n_moe * (p.n_experts - p.n_active) * expert_params;
}

void print_banner(const DemoOptions& opt, const Corpus& corpus, const CharModelConfig& cfg, const TrainOptions& topt,
                  Index n_params, Index active_params) {
  std::printf("apex-ffn demo: character-level LM on %s\n", opt.data.c_str());
  std::printf("  text: %zu training + %zu validation characters, vocabulary %ld\n", corpus.train.size(),
              corpus.val.size(), long(corpus.vocab.size()));
  std::printf("  model: %ld parameters (%ld active per token), preset '%s', context %ld characters\n", long(n_params),
              long(active_params), cfg.preset.name, long(cfg.context));
  std::printf("  training: %ld steps x %ld tokens, seed %llu, %d thread(s)\n", opt.steps,
              long(topt.chunks * topt.chunk_len), static_cast<unsigned long long>(opt.seed), opt.threads);
  std::fflush(stdout);
}

void announce(const char* what) {
  std::printf("%s\n", what);
  std::fflush(stdout);
}

/// With --sweep all: every storage type's packed copy scored on the whole
/// validation text, as the --packed copy was, printed against the float loss.
std::optional<StorageSweep> storage_sweep(const DemoOptions& opt, const Model& model, const Corpus& corpus, Index pad,
                                          const std::optional<PackedRun>& inf, double float_loss) {
  if (opt.sweep == "none") return std::nullopt;
  announce("packing the FFN layers in every storage type and evaluating each...");
  const SweepText on{corpus.val, 0, Index(corpus.val.size()), pad};
  std::optional<StorageSweep> s = run_storage_sweep(model, on, opt.threads, float_loss, inf);
  std::printf("%s", storage_sweep_summary(*s).c_str());
  std::fflush(stdout);
  return s;
}

/// The LoRA fine-tuning's settings: the batches of training, a short warmup.
FineTuneOptions finetune_options(const DemoOptions& o) {
  FineTuneOptions f;
  f.steps = std::max<long>(1, o.finetune_steps);
  f.chunks = 16;
  f.chunk_len = 32;
  f.lr = 2e-3;
  f.warmup = std::min<long>(20, std::max<long>(1, f.steps / 10));
  f.seed = o.seed + 2000;
  return f;
}

/// With --finetune-steps > 0: LoRA adapters trained on the model packed in
/// q4_0, and in q4_k (not applicable unless the widths are whole 256-weight
/// blocks); each run's console lines, CSV log and chart.
std::vector<FineTuneRun> finetune(const DemoOptions& opt, Model& model, const Corpus& corpus, Index pad,
                                  const TrainOptions& topt, double float_loss) {
  std::vector<FineTuneRun> runs;
  if (opt.finetune_steps == 0) return runs;
  announce("fine-tuning LoRA adapters on the FFN layers packed in q4_0 (and q4_k where the widths allow)...");
  LoraOptions lora;
  lora.rank = opt.lora_rank;
  lora.alpha = 2.0 * double(opt.lora_rank);  // s = α/r = 2 at every rank
  const FineTuneSetup in{corpus, pad, topt, finetune_options(opt), lora, opt.seed + 3000, opt.threads, float_loss};
  runs.push_back(run_finetune<packed::q4_0>(model, in));
  runs.push_back(run_finetune<packed::q4_k>(model, in));
  for (const FineTuneRun& r : runs) {
    std::printf("%s", finetune_summary(r).c_str());
    if (!r.applicable) continue;
    write_finetune_csv(opt.out + "/finetune_" + r.type + ".csv", r.log);
    plot_finetune(opt.out + "/finetune_" + r.type + ".png", r.log, r.type);
  }
  std::fflush(stdout);
  return runs;
}

/// With --checkpoint: the save-and-reload check's sentence for the report; otherwise empty.
std::string checkpoint_note(const DemoOptions& opt, Model& model, const Corpus& corpus, Index pad) {
#ifdef APEX_DEMO_HAVE_CHECKPOINT
  if (!opt.checkpoint.empty()) return save_and_reload_checkpoint(model, opt.checkpoint, corpus, opt.seed, opt.steps, pad);
#else
  (void)opt, (void)model, (void)corpus, (void)pad;
#endif
  return {};
}

void write_plots(const std::string& out, const RunLog& log, const RunLog& nolb, long contrast, double bigram_nll,
                 Index first_moe_layer) {
  plot_loss(out + "/loss.png", log, bigram_nll);
  plot_expert_load(out + "/expert_load.png", log, first_moe_layer);
  if (contrast > 0) plot_imbalance(out + "/imbalance.png", log, nolb, contrast);
}

/// Trains, evaluates, decodes, packs, fine-tunes on packed weights, checks
/// the checkpoint, plots and reports, in that order; the exit status says
/// whether the demo's claims held.
int run(const DemoOptions& opt) {
  const auto wall0 = std::chrono::steady_clock::now();
  use_threads(opt.threads);
  const Corpus corpus = Corpus::load(opt.data);
  const Index pad = corpus.vocab.contains('\n') ? corpus.vocab.id('\n') : 0;
  const CharModelConfig cfg = model_config(corpus.vocab.size(), opt);
  const TrainOptions topt = train_options(opt);
  std::filesystem::create_directories(opt.out);

  Model model(cfg, opt.seed);
  model.set_threads(opt.threads);
  const Index n_params = parameter_count(model.params());
  const Index active_params = active_parameters(model, n_params);
  print_banner(opt, corpus, cfg, topt, n_params, active_params);

  const std::vector<Index> moe_layer_ids = moe_layer_indices(model);
  const TrainingInput input{corpus, topt, pad};
  const RunLog log = train_main_run(model, input, moe_layer_ids, opt.out + "/log.csv");
  announce("evaluating on the validation text...");
  const ValidationSummary val = evaluate_on_validation(model, corpus, pad);
  const long contrast = std::min(opt.contrast_steps, opt.steps);
  const RunLog nolb = train_contrast_run(cfg, opt.seed, opt.threads, input, contrast);

  announce("decoding...");
  const DecodeSetup decoding = demo_decode_setup(corpus.vocab, opt.seed);
  const DecodeRuns dec = decode_trained(model, decoding, pad);
  // The trained FFN layers packed into the inference layers (bf16 by
  // default), then evaluated and decoded exactly as the float model was.
  const std::optional<PackedRun> inf =
      run_packed_copy(opt.packed, model, corpus, pad, opt.threads, decoding, val.learned.loss);
  const std::optional<StorageSweep> sweep = storage_sweep(opt, model, corpus, pad, inf, val.learned.loss);
  const std::vector<FineTuneRun> tuned = finetune(opt, model, corpus, pad, topt, val.learned.loss);
  const std::string note = checkpoint_note(opt, model, corpus, pad);
  write_plots(opt.out, log, nolb, contrast, val.bigram_nll, moe_layer_ids.front());

  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - wall0).count();
  const DemoRun r{opt, corpus, cfg, topt, model, n_params, active_params, moe_layer_ids, log, nolb, contrast,
                  val, decoding, dec, inf, sweep, tuned, note, wall};
  write_report(r);
  const bool ok = demo_checks_pass(r);
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
