#pragma once
/// \file cli.hpp
/// The demo's command line: `--name value` or `--name=value`; an unknown
/// flag, a missing or malformed value is an error the caller reports with
/// exit code 2.

#include <apex/ffn/moe/config.hpp>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <string>

namespace apex::demo {

#ifndef APEX_DEMO_DEFAULT_DATA
#define APEX_DEMO_DEFAULT_DATA "data/kjv_pentateuch.txt"
#endif

struct DemoOptions {
  long steps = 5000;                       ///< training steps of the main run
  long contrast_steps = 400;               ///< steps of the run without load balancing (0: skip it)
  std::uint64_t seed = 1;                  ///< weights, batches, sampling
  int threads = 1;                         ///< threads of the MoE dispatch
  std::string out = "demo-output";         ///< folder for report.md, log.csv and the plots
  std::string checkpoint;                  ///< save the trained model here (safetensors) when set
  std::string packed = "bf16";             ///< weights of the packed inference copy: bf16, float or none
  std::string sweep = "all";               ///< score a packed copy in every storage type (all) or not (none)
  long d_model = ModelPreset::tiny().d_model;  ///< trunk width d (the tiny preset's by default)
  long d_ffn = ModelPreset::tiny().d_ffn;      ///< FFN hidden width f of every SwiGLU and expert
  long finetune_steps = 300;               ///< LoRA fine-tuning steps on the q4_0 (and q4_k) model (0: skip it)
  long lora_rank = 8;                      ///< rank of every adapter
  std::string data = APEX_DEMO_DEFAULT_DATA;  ///< training text
};

struct ParsedArgs {
  DemoOptions options;
  bool help = false;
  std::string error;  ///< non-empty: what was wrong
};

inline std::string usage(const std::string& prog) {
  const DemoOptions d;
  return "Usage: " + prog + " [options]\n"
         "Trains a small character-level language model built from apex-ffn layers (dense SwiGLU,\n"
         "kappa-SwiGLU mixture of experts, skip gates, multi-token heads) and writes a report.\n\n"
         "Options:\n"
         "  --steps N           training steps (default " + std::to_string(d.steps) + ")\n"
         "  --contrast-steps N  steps of the comparison run without load balancing, 0 to skip\n"
         "                      (default " + std::to_string(d.contrast_steps) + ", at most --steps)\n"
         "  --seed S            random seed for weights, batches and sampling (default " + std::to_string(d.seed) + ")\n"
         "  --threads T         threads for the mixture-of-experts dispatch (default " + std::to_string(d.threads) + ")\n"
         "  --out DIR           output folder for report.md, log.csv and plots (default " + d.out + ")\n"
         "  --checkpoint PATH   save the trained model to PATH (safetensors, written atomically)\n"
         "  --packed W          after training, pack the FFN layers for inference with W = bf16, float\n"
         "                      or none, and evaluate and decode with them too (default " + d.packed + ")\n"
         "  --sweep W           all: also pack the FFN layers in every storage type (f32, bf16, q8_0,\n"
         "                      q4_0, q4_k, q6_k, mxfp4) and score each on the validation text;\n"
         "                      none: skip it (default " + d.sweep + ")\n"
         "  --d-model N         trunk width (default " + std::to_string(d.d_model) + "; q4_k and q6_k need a multiple of 256)\n"
         "  --d-ffn N           FFN hidden width (default " + std::to_string(d.d_ffn) + "; q4_k and q6_k need a multiple of 256)\n"
         "  --finetune-steps N  after training, pack the FFN layers in q4_0 (and q4_k where the widths allow)\n"
         "                      and train LoRA adapters on the frozen packed weights for N steps, 0 to skip\n"
         "                      (default " + std::to_string(d.finetune_steps) + ")\n"
         "  --lora-rank R       rank of the adapters (default " + std::to_string(d.lora_rank) + ")\n"
         "  --data PATH         training text (default " + d.data + ")\n"
         "  --help              show this help\n";
}

namespace cli_detail {

inline bool parse_long(const std::string& s, long lo, long hi, long& out) {
  if (s.empty()) return false;
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(s.c_str(), &end, 10);
  if (errno != 0 || *end != '\0' || v < lo || v > hi) return false;
  out = long(v);
  return true;
}

/// Whether `arg` is one of the options that take a value.
inline bool takes_value(const std::string& arg) {
  return arg == "--steps" || arg == "--contrast-steps" || arg == "--seed" || arg == "--threads" || arg == "--out" ||
         arg == "--checkpoint" || arg == "--packed" || arg == "--data" || arg == "--sweep" || arg == "--d-model" ||
         arg == "--d-ffn" || arg == "--finetune-steps" || arg == "--lora-rank";
}

/// Parses `value` of option `arg` as an integer in [lo, hi] into `n`;
/// returns the error message, empty when it parsed.
inline std::string number(const std::string& arg, const std::string& value, long lo, long hi, long& n) {
  if (parse_long(value, lo, hi, n)) return {};
  return "option '" + arg + "' expects an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) +
         "], got '" + value + "'";
}

/// Stores `value` of the option `arg` (one that takes_value) in `o`; returns
/// what was wrong with it, empty when nothing was (and only then is `o` changed).
inline std::string set_option(DemoOptions& o, const std::string& arg, const std::string& value) {
  long n = 0;
  std::string e;
  if (arg == "--steps") {
    if ((e = number(arg, value, 1, 10'000'000, n)).empty()) o.steps = n;
  } else if (arg == "--contrast-steps") {
    if ((e = number(arg, value, 0, 10'000'000, n)).empty()) o.contrast_steps = n;
  } else if (arg == "--seed") {
    if ((e = number(arg, value, 0, 2'000'000'000'000'000'000L, n)).empty()) o.seed = std::uint64_t(n);
  } else if (arg == "--threads") {
    if ((e = number(arg, value, 1, 256, n)).empty()) o.threads = int(n);
  } else if (arg == "--d-model") {
    if ((e = number(arg, value, 1, 8192, n)).empty()) o.d_model = n;
  } else if (arg == "--d-ffn") {
    if ((e = number(arg, value, 1, 32768, n)).empty()) o.d_ffn = n;
  } else if (arg == "--finetune-steps") {
    if ((e = number(arg, value, 0, 10'000'000, n)).empty()) o.finetune_steps = n;
  } else if (arg == "--lora-rank") {
    if ((e = number(arg, value, 1, 4096, n)).empty()) o.lora_rank = n;
  } else if (value.empty()) {
    e = "option '" + arg + "' needs a non-empty value";
  } else if (arg == "--out") {
    o.out = value;
  } else if (arg == "--checkpoint") {
    o.checkpoint = value;
  } else if (arg == "--packed") {
    if (value != "bf16" && value != "float" && value != "none")
      e = "option '--packed' expects bf16, float or none, got '" + value + "'";
    else
      o.packed = value;
  } else if (arg == "--sweep") {
    if (value != "all" && value != "none")
      e = "option '--sweep' expects all or none, got '" + value + "'";
    else
      o.sweep = value;
  } else {
    o.data = value;
  }
  return e;
}

}  // namespace cli_detail

/// Reads `--name value` / `--name=value` pairs; stops at the first error.
inline ParsedArgs parse_args(int argc, const char* const* argv) {
  ParsedArgs r;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i], value;
    bool has_value = false;
    if (const auto eq = arg.find('='); arg.rfind("--", 0) == 0 && eq != std::string::npos) {
      value = arg.substr(eq + 1);
      arg = arg.substr(0, eq);
      has_value = true;
    }
    if (arg == "--help" || arg == "-h") {
      r.help = true;
      continue;
    }
    if (!cli_detail::takes_value(arg)) {
      r.error = "unknown option '" + arg + "'";
      return r;
    }
    if (!has_value) {
      if (i + 1 >= argc) {
        r.error = "option '" + arg + "' needs a value";
        return r;
      }
      value = argv[++i];
    }
    r.error = cli_detail::set_option(r.options, arg, value);
    if (!r.error.empty()) return r;
  }
  const DemoOptions& o = r.options;
  if (o.finetune_steps > 0 && o.lora_rank > std::min(o.d_model, o.d_ffn))
    r.error = "option '--lora-rank' " + std::to_string(o.lora_rank) + " exceeds min(--d-model, --d-ffn) = " +
              std::to_string(std::min(o.d_model, o.d_ffn)) + ", the smaller side of the adapted projections";
  return r;
}

}  // namespace apex::demo
