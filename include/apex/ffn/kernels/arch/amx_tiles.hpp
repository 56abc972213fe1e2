#pragma once
/// \file kernels/arch/amx_tiles.hpp
/// What the AMX tile kernels share (kernels/arch/amx_bf16.hpp,
/// kernels/arch/amx_int8_quant.hpp): the shapes of the eight tile registers,
/// the block of code that holds them, and the next panel's prefetch.
///
/// AMX needs the kernel's permission (granted once per process by
/// `cpu_supports(Isa::amx_bf16)`) and a tile configuration per thread;
/// `AmxTiles` loads a configuration for one block and releases the tiles
/// after it, so code of other libraries on the thread (oneDNN's AMX kernels
/// in PyTorch) finds the state it expects to configure itself.

#include <cstdint>

#include "../isa.hpp"

#if APEX_PACKED_X86
namespace apex::packed::detail {

/// The 64-byte operand of `ldtilecfg` (palette 1): per tile register its
/// rows and bytes per row; registers not shaped stay unused (0 × 0).
struct alignas(64) AmxConfig {
  std::uint8_t palette = 1, start_row = 0;
  std::uint8_t reserved[14] = {};
  std::uint16_t colsb[16] = {};
  std::uint8_t rows[16] = {};
  /// Tile t as `r` rows of `bytes` bytes (r ≤ 16, bytes ≤ 64).
  constexpr AmxConfig& shape(int t, int r, int bytes) {
    rows[t] = std::uint8_t(r), colsb[t] = std::uint16_t(bytes);
    return *this;
  }
};
static_assert(sizeof(AmxConfig) == 64, "ldtilecfg reads exactly 64 bytes");

/// Every tile register 16 rows of 64 bytes (the paired bf16 products).
inline const AmxConfig& amx_full_tiles() {
  static const AmxConfig config = [] {
    AmxConfig c;
    for (int t = 0; t < 8; ++t) c.shape(t, 16, 64);
    return c;
  }();
  return config;
}

/// A tile configuration loaded on this thread for one block of products.
class AmxTiles {
 public:
  APEX_TARGET_AMX_BF16 explicit AmxTiles(const AmxConfig& config) { _tile_loadconfig(&config); }
  APEX_TARGET_AMX_BF16 ~AmxTiles() { _tile_release(); }
  AmxTiles(const AmxTiles&) = delete;
  AmxTiles& operator=(const AmxTiles&) = delete;
};

/// The panel after the one being multiplied, pulled into L2 a few lines at
/// a time while this one runs. A panel's first row group reads its weights
/// from memory and the rest from L2: without it the tile unit idles on
/// memory for the first group and the bus idles for the others.
struct AmxNextPanel {
  const char* next = nullptr;  ///< the next panel's bytes (nullptr: none)
  const char* end = nullptr;
  Index lines_per_chunk = 0;   ///< cache lines prefetched per chunk step
  /// The `bytes` at `panel` (none for a null `panel`), spread over `steps` steps.
  void spread(const void* panel, Index bytes, Index steps) {
    if (!panel || steps <= 0) return;
    next = static_cast<const char*>(panel);
    end = next + bytes;
    lines_per_chunk = (bytes / 64 + steps - 1) / steps;
  }
  APEX_KERNEL_INLINE void step() {
    for (Index l = 0; l < lines_per_chunk && next < end; ++l, next += 64) _mm_prefetch(next, _MM_HINT_T1);
  }
};

}  // namespace apex::packed::detail
#endif
