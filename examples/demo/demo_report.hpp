#pragma once
/// \file demo_report.hpp
/// report.md: what one demo run measured — validation loss against the
/// baselines, the packed copy, load balancing, skip gates, multi-token heads,
/// speculative decoding and a sample — one function per section.

#include <apex/ffn/moe/load_balancer.hpp>
#include <apex/ffn/core/types.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "decode_runs.hpp"
#include "demo_run.hpp"
#include "finetune_report.hpp"
#include "packed_run.hpp"
#include "report.hpp"
#include "run_log.hpp"
#include "storage_sweep.hpp"

namespace apex::demo {

/// The title, the model and the training settings.
inline void report_overview(Markdown& md, const DemoRun& r) {
  const ModelPreset& p = r.cfg.preset;
  const Index tokens_per_step = r.topt.chunks * r.topt.chunk_len;
  md.heading(1, "apex-ffn demo report");
  md.para(fmt("Character-level language model on `%s`: %zu training and %zu validation characters, vocabulary of %ld. ",
              std::filesystem::path(r.opt.data).filename().string().c_str(), r.corpus.train.size(),
              r.corpus.val.size(), long(r.corpus.vocab.size())) +
          fmt("Trunk: embeddings of the last %ld characters, concatenated and projected to d = %ld, then the `%s` "
              "preset's %ld FFN sublayers (dense SwiGLU on even layers, κ-SwiGLU MoE with %ld experts, top-%ld, "
              "%ld shared on odd layers), each behind a skip gate, a final RMSNorm, the main head and %ld "
              "multi-token heads. ",
              long(r.cfg.context), long(p.d_model), p.name, long(p.n_layers), long(p.n_experts), long(p.n_active),
              long(p.n_shared), long(r.cfg.mtp_heads)) +
          fmt("%ld parameters, %ld active per token.", long(r.n_params), long(r.active_params)));
  md.para(fmt("Training: %ld steps of %ld tokens (%.2f M tokens), AdamW (peak lr %.0e, cosine), clip %.1f, κ's U "
              "ramped 1 → %.0f over the first %.0f%% of the steps, skip penalty λ = %.3g, balancer α = %.0e; seed %llu, "
              "%d thread(s). Training took %.1f s (%.1fk tokens/s); the whole demo %.1f s.",
              r.opt.steps, long(tokens_per_step), r.log.tokens / 1e6, r.topt.lr, r.topt.clip, r.topt.U_max,
              r.topt.U_ramp * 100, r.cfg.skip_penalty, r.cfg.balancer_alpha, static_cast<unsigned long long>(r.opt.seed),
              r.opt.threads, r.log.seconds, r.log.tokens / r.log.seconds / 1000, r.wall_seconds));
}

/// Float FFN weight bytes for scale: w_gate, w_up, w_down of every expert and dense FFN.
inline double float_ffn_bytes(const DemoRun& r) {
  const ModelPreset& p = r.cfg.preset;
  const double swiglu_bytes = 3.0 * double(p.d_model) * double(p.d_ffn) * sizeof(float);
  return swiglu_bytes * (double(r.model.dense_layers().size()) +
                         double(Index(r.model.moe_layers().size())) * double(p.n_experts + p.n_shared));
}

/// Validation loss of the model, its gates forced open and its packed copy, against the baselines.
inline void report_validation(Markdown& md, const DemoRun& r) {
  const EvalResult& learned = r.val.learned;
  md.heading(2, "Validation loss");
  std::vector<std::vector<std::string>> rows = {
      {"unigram (character frequencies)", fmt("%.3f", r.val.unigram_nll), fmt("%.3f", r.val.unigram_nll / kLn2)},
      {"bigram baseline (add-0.1 smoothing, same data)", fmt("%.3f", r.val.bigram_nll),
       fmt("%.3f", r.val.bigram_nll / kLn2)},
      {"**this model**, skip gates as learned", fmt("**%.3f**", learned.loss), fmt("**%.3f**", learned.bpc())},
      {"this model, skip gates forced open", fmt("%.3f", r.val.open.loss), fmt("%.3f", r.val.open.bpc())}};
  if (r.inf)
    rows.push_back({"this model, FFN layers packed in " + r.inf->weights + " (inference layers)",
                    fmt("%.3f", r.inf->eval.loss), fmt("%.3f", r.inf->eval.bpc())});
  md.table({"model", "nats/char", "bits/char"}, rows);
  md.para(fmt("Scored on all %ld validation positions (the held-out end of Deuteronomy). The model needs %.0f%% of the "
              "bigram baseline's bits per character; next-character accuracy %.1f%%.",
              long(learned.tokens), 100 * learned.loss / r.val.bigram_nll, 100 * learned.main_accuracy));
  if (!r.inf) return;
  const PackedRun& inf = *r.inf;
  md.para(fmt("Packed for inference (`pack_model<%s>`: every FFN sublayer's expert weights in %s, no gradient "
              "buffers; routers, balancing bias, κ, norms and skip gates stay float): validation loss %.6f nats/char "
              "against %.6f for the float model, a relative difference of %+.2e; next-character accuracy %.2f%% vs "
              "%.2f%%, mean skip rate %.2f%% vs %.2f%%. The packed FFN weights take %.0f KiB (float: %.0f KiB). "
              "Packing, evaluating and decoding took %.1f s.",
              inf.weights.c_str(), inf.weights.c_str(), inf.eval.loss, learned.loss,
              (inf.eval.loss - learned.loss) / learned.loss, 100 * inf.eval.main_accuracy, 100 * learned.main_accuracy,
              100 * inf.eval.mean_skip_rate(), 100 * learned.mean_skip_rate(), double(inf.ffn_bytes) / 1024.0,
              float_ffn_bytes(r) / 1024.0, inf.seconds));
}

/// Every storage type's packed copy against the float model (with --sweep all),
/// then the LoRA fine-tuning on packed weights.
inline void report_storage(Markdown& md, const DemoRun& r) {
  if (r.sweep) report_storage_sweep(md, *r.sweep);
  const auto inference = [&](const char* type) {
    const StorageLoss* s = r.sweep ? r.sweep->find(type) : nullptr;
    return s && s->applicable ? s->eval.loss : NAN;
  };
  report_finetune(md, r.finetune, inference("q4_0"), inference("q4_k"));
}

/// Each MoE layer's expert load over the whole run and its final bias.
inline void report_load_balancing(Markdown& md, const DemoRun& r) {
  const std::size_t experts = std::size_t(r.cfg.preset.n_experts);
  md.heading(2, "Load balancing");
  std::vector<std::vector<std::string>> rows;
  for (std::size_t l = 0; l < r.moe_layer_ids.size(); ++l) {
    const LoadReport whole =
        LoadBalancer<float>::make_report(r.log.counts[l], r.log.tokens_routed[l], r.cfg.preset.n_active);
    const std::size_t n = r.log.step.size();
    const LoadReport last = window_load(r.log, l, n - std::min<std::size_t>(n, std::size_t(n / 10 + 1)), n);
    std::vector<std::string> row = {fmt("%ld", long(r.moe_layer_ids[l]))};
    std::string loads;
    for (std::size_t e = 0; e < experts; ++e) loads += fmt("%s%.3f", e ? " / " : "", whole.load[e]);
    row.push_back(loads);
    row.push_back(fmt("%.3f", whole.imbalance));
    row.push_back(fmt("%.3f", mean_of(r.log.imbalance[l])));
    row.push_back(fmt("%.3f", last.imbalance));
    std::string bias;
    const auto& b = r.model.moe_layers()[l].ffn().balancer().bias();
    for (Index e = 0; e < b.cols(); ++e) bias += fmt("%s%+.2f", e ? " " : "", double(b(e)));
    row.push_back(bias);
    rows.push_back(row);
  }
  md.para(fmt("Share of the routed (token, slot) assignments each expert received (even = %.3f). \"max/mean\" is "
              "the imbalance figure of the balancer (1 = perfectly even, %ld = everything on one expert).",
              1.0 / double(experts), long(experts)));
  md.table({"MoE layer", "load per expert, whole run", "max/mean, whole run", "max/mean per step, mean",
            "max/mean, last 10%", "final bias"},
           rows);
}

/// The first steps of the main run against the contrast run without the balancer.
inline void report_contrast(Markdown& md, const DemoRun& r) {
  const std::size_t c = std::size_t(r.contrast);
  std::vector<std::vector<std::string>> rows;
  for (std::size_t l = 0; l < r.moe_layer_ids.size(); ++l) {
    const LoadReport off = window_load(r.nolb, l, 0, c);
    const LoadReport on = window_load(r.log, l, 0, c);
    const LoadReport off_end = window_load(r.nolb, l, std::size_t(r.contrast * 3 / 4), c);
    const LoadReport on_end = window_load(r.log, l, std::size_t(r.contrast * 3 / 4), c);
    rows.push_back({fmt("%ld", long(r.moe_layer_ids[l])), fmt("%.3f", on.imbalance), fmt("%.3f", off.imbalance),
                    fmt("%.3f", on_end.imbalance), fmt("%.3f", off_end.imbalance)});
  }
  md.para(fmt("Contrast: the same model, seed and batches trained for %ld steps with the balancer's bias updates "
              "switched off, against the first %ld steps of the run above (mean per-step max/mean over all MoE "
              "layers: %.3f with the balancer, %.3f without).",
              r.contrast, r.contrast, r.log.mean_imbalance(c), r.nolb.mean_imbalance(c)));
  md.table({"MoE layer", "max/mean, balancer on", "max/mean, balancer off", "last quarter, on", "last quarter, off"},
           rows);
}

/// Each gate's skip rate on the validation text, the FFN work saved and the loss it costs.
inline void report_skip_gates(Markdown& md, const DemoRun& r) {
  const ModelPreset& p = r.cfg.preset;
  const EvalResult& learned = r.val.learned;
  md.heading(2, "Skip gates");
  std::vector<std::vector<std::string>> rows;
  double saved = 0, work = 0;
  for (Index l = 0; l < r.model.n_layers(); ++l) {
    const double cost = r.model.is_moe(l) ? double(p.n_active + p.n_shared) : 1.0;  // in SwiGLU evaluations
    saved += cost * learned.skip_rate[std::size_t(l)];
    work += cost;
    rows.push_back({fmt("%ld", long(l)), r.model.is_moe(l) ? "κ-SwiGLU MoE" : "SwiGLU",
                    fmt("%.1f%%", 100 * learned.skip_rate[std::size_t(l)])});
  }
  md.para(fmt("Share of validation tokens whose FFN each gate skipped (τ = %.2f, inference mode: skipped tokens are "
              "not computed). Mean skip rate %.1f%%, which saves %.1f%% of the FFN work (MoE layers weighted by "
              "the %ld expert evaluations a token costs there).",
              r.cfg.skip_threshold, 100 * learned.mean_skip_rate(), 100 * saved / work, long(p.n_active + p.n_shared)));
  md.table({"layer", "FFN", "skip rate"}, rows);
  md.para(fmt("Cost in validation loss: %.4f bits/char with the gates as learned vs %.4f with every gate forced "
              "open (τ = 0), a difference of %+.4f bits/char (%+.2f%%).",
              learned.bpc(), r.val.open.bpc(), learned.bpc() - r.val.open.bpc(),
              100 * (learned.loss - r.val.open.loss) / r.val.open.loss));
}

/// Top-1 accuracy of the main head and every multi-token head.
inline void report_heads(Markdown& md, const DemoRun& r) {
  const EvalResult& learned = r.val.learned;
  md.heading(2, "Multi-token heads");
  std::vector<std::vector<std::string>> rows = {
      {"main head", "t+1", fmt("%.1f%%", 100 * learned.main_accuracy), fmt("%.3f", learned.bpc())}};
  for (std::size_t i = 0; i < learned.head_accuracy.size(); ++i)
    rows.push_back({fmt("head %zu", i + 1), fmt("t+%zu", i + 2), fmt("%.1f%%", 100 * learned.head_accuracy[i]),
                    fmt("%.3f", learned.head_loss[i] / kLn2)});
  md.para("Top-1 accuracy on the validation text: head k predicts the character k positions after the main head's.");
  md.table({"head", "predicts", "accuracy", "bits/char"}, rows);
}

/// Acceptance and characters per main-model step of the float model's speculative decoding.
inline void report_speculative(Markdown& md, const DemoRun& r) {
  const DecodeSetup& d = r.decoding;
  const SpeculativeStats& greedy = r.dec.greedy;
  const SpeculativeStats& sampled = r.dec.sampled;
  md.heading(2, "Speculative decoding");
  md.para(fmt("The heads draft %ld characters; one main-model forward over the %ld context windows verifies them. "
              "%ld characters after each of %zu prompts.",
              long(r.cfg.mtp_heads), long(r.cfg.mtp_heads + 1), long(d.gen_tokens), d.prompts.size()));
  md.table({"mode", "acceptance rate", "tokens per main-model step", "main-model steps"},
           {{"greedy", fmt("%.1f%%", 100 * greedy.acceptance_rate()), fmt("%.2f", greedy.tokens_per_step()),
             fmt("%ld", long(greedy.steps))},
            {fmt("sampled (T = %.1f)", d.temperature), fmt("%.1f%%", 100 * sampled.acceptance_rate()),
             fmt("%.2f", sampled.tokens_per_step()), fmt("%ld", long(sampled.steps))}});
  md.para(std::string("Greedy speculative output identical to plain greedy decoding: ") +
          (r.dec.greedy_matches ? "**yes**" : "**no**") +
          ". Sampled speculative decoding is distributed as sampling from the main model alone (speculative "
          "sampling, with the heads' softmax as the draft distribution).");
}

/// The same decoding on the packed copy, and how far its texts follow the float model's.
inline void report_packed_decoding(Markdown& md, const DemoRun& r, const PackedRun& inf) {
  const DecodeSetup& s = r.decoding;
  const DecodeRuns& d = inf.decode;
  std::string same_greedy, same_sampled;
  for (std::size_t i = 0; i < s.prompts.size(); ++i) {
    const Index g = common_prefix(d.greedy_tokens[i], r.dec.greedy_tokens[i], s.gen_tokens);
    const Index k = common_prefix(d.sampled_tokens[i], r.dec.sampled_tokens[i], s.gen_tokens);
    same_greedy += fmt("%s%ld", i ? ", " : "", long(g));
    same_sampled += fmt("%s%ld", i ? ", " : "", long(k));
  }
  md.para(fmt("The same decoding on the model packed in %s (same prompts, lengths and sampling seed). \"same as "
              "float\" counts the leading characters, of %ld per prompt, equal to the float model's output.",
              inf.weights.c_str(), long(s.gen_tokens)));
  md.table({"mode", "acceptance rate", "tokens per main-model step", "same as float, per prompt"},
           {{"greedy, " + inf.weights, fmt("%.1f%%", 100 * d.greedy.acceptance_rate()),
             fmt("%.2f", d.greedy.tokens_per_step()), same_greedy},
            {fmt("sampled (T = %.1f), ", s.temperature) + inf.weights, fmt("%.1f%%", 100 * d.sampled.acceptance_rate()),
             fmt("%.2f", d.sampled.tokens_per_step()), same_sampled}});
  md.para(std::string("On the packed model too, greedy speculative output is identical to plain greedy decoding of "
                      "that model: ") +
          (d.greedy_matches ? "**yes**" : "**no**") +
          ". Where its text departs from the float model's, the packed weights changed an argmax or a sampling "
          "decision, and the rest of the text follows from that character.");
}

/// A sampled and a greedy text after the first prompt, the checkpoint check, the files written.
inline void report_sample_and_files(Markdown& md, const DemoRun& r) {
  const DecodeSetup& d = r.decoding;
  const std::string greedy_text = d.prompts[0] + r.corpus.vocab.decode(r.dec.greedy_tokens[0]);
  const std::string sample_text = d.prompts[0] + r.corpus.vocab.decode(r.dec.sampled_tokens[0]);
  md.heading(2, "Generated sample");
  md.para(fmt("Speculative sampling at T = %.1f from the prompt \"%s\":", d.temperature, d.prompts[0].c_str()));
  md.code(sample_text);
  md.para("Greedy:");
  md.code(greedy_text);
  if (!r.checkpoint_note.empty()) {
    md.heading(2, "Checkpoint");
    md.para(r.checkpoint_note);
  }
  md.heading(2, "Files");
  md.bullet("`log.csv`: one row per training step (loss, learning rate, U, gradient norm, skip rate, per-layer "
            "imbalance and per-expert load; validation loss where evaluated)");
  md.bullet("`loss.png`, `expert_load.png`" + std::string(r.contrast > 0 ? ", `imbalance.png`" : ""));
  for (const FineTuneRun& f : r.finetune)
    if (f.applicable)
      md.bullet("`finetune_" + f.type + ".csv` (one row per fine-tuning step: its loss, the float and the unadapted " +
                f.type + " model's on the same batch, step time), `finetune_" + f.type + ".png`");
  md.end_list();
  md.image("loss curves", "loss.png");
}

/// The whole report, section by section.
inline std::string report_markdown(const DemoRun& r) {
  Markdown md;
  report_overview(md, r);
  report_validation(md, r);
  report_storage(md, r);
  report_load_balancing(md, r);
  if (r.contrast > 0) report_contrast(md, r);
  md.image("expert load over training", "expert_load.png");
  if (r.contrast > 0) md.image("imbalance with and without the balancer", "imbalance.png");
  report_skip_gates(md, r);
  report_heads(md, r);
  report_speculative(md, r);
  if (r.inf) report_packed_decoding(md, r, *r.inf);
  report_sample_and_files(md, r);
  return md.str();
}

/// Writes report.md into `--out` and prints it.
inline void write_report(const DemoRun& r) {
  const std::string report = report_markdown(r);
  {
    std::ofstream f(r.opt.out + "/report.md");
    f << report;
    if (!f) throw std::runtime_error("cannot write " + r.opt.out + "/report.md");
  }
  std::printf("\n%s", report.c_str());
  std::printf("Report, log and plots written to %s/\n", r.opt.out.c_str());
}

}  // namespace apex::demo
