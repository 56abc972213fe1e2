#pragma once
/// \file demo_run.hpp
/// What one demo run measured, gathered for the report and the exit status.

#include <apex/ffn/core/types.hpp>

#include <cmath>
#include <optional>
#include <string>
#include <vector>

#include "char_model.hpp"
#include "cli.hpp"
#include "decode_runs.hpp"
#include "finetune_run.hpp"
#include "packed_run.hpp"
#include "run_log.hpp"
#include "storage_sweep.hpp"
#include "text_data.hpp"
#include "trainer.hpp"
#include "validation.hpp"

namespace apex::demo {

/// Everything one demo run measured, as the report reads it.
struct DemoRun {
  const DemoOptions& opt;
  const Corpus& corpus;
  const CharModelConfig& cfg;
  const TrainOptions& topt;
  const CharModel<float>& model;
  Index n_params;       ///< all parameters
  Index active_params;  ///< those one token uses
  const std::vector<Index>& moe_layer_ids;
  const RunLog& log;   ///< the main run
  const RunLog& nolb;  ///< the contrast run without the balancer
  long contrast;       ///< its steps (0: not run)
  const ValidationSummary& val;
  const DecodeSetup& decoding;
  const DecodeRuns& dec;  ///< the float model's decoding
  const std::optional<PackedRun>& inf;
  const std::optional<StorageSweep>& sweep;  ///< every storage type's packed copy (--sweep all)
  const std::vector<FineTuneRun>& finetune;  ///< LoRA on q4_0 and q4_k weights (empty: --finetune-steps 0)
  const std::string& checkpoint_note;  ///< empty without --checkpoint
  double wall_seconds;                 ///< the whole demo up to the report
};

/// The demo's claims: the model beats the bigram baseline, and greedy speculative
/// decoding reproduces greedy decoding, on the float model and on the packed one;
/// every storage type the widths allow gives a finite loss; LoRA fine-tuning
/// on packed weights ends with a finite validation loss below its start.
inline bool demo_checks_pass(const DemoRun& r) {
  bool ok = r.val.learned.loss < r.val.bigram_nll && std::isfinite(r.val.learned.loss) && r.dec.greedy_matches;
  if (r.inf) ok = ok && std::isfinite(r.inf->eval.loss) && r.inf->decode.greedy_matches;
  if (r.sweep)
    for (const StorageLoss& s : r.sweep->rows) ok = ok && (!s.applicable || std::isfinite(s.eval.loss));
  for (const FineTuneRun& f : r.finetune)
    ok = ok && (!f.applicable || (std::isfinite(f.after.loss) && f.after.loss < f.before.loss));
  return ok;
}

}  // namespace apex::demo
