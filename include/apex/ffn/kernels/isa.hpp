#pragma once
/// \file kernels/isa.hpp
/// The instruction-set paths of the packed expert engine and how one is chosen.
///
/// Every path is compiled into every build: the SIMD paths are ordinary
/// functions carrying GCC/Clang `__attribute__((target(...)))`, so a build for
/// the compiler's default target (x86-64 baseline, as the test and sanitizer
/// presets use) still contains the AVX2, AVX-512, AVX-512 VNNI, AVX-512
/// BF16 and AMX-BF16 kernels.
/// Which path a call uses by default is fixed at compile time from the
/// compiler's target macros (`-march=native` on this machine selects
/// `avx512_bf16`); a caller may name another path explicitly, which is checked
/// against the running CPU (`cpu_supports`) so an unsupported path is a typed
/// error instead of SIGILL. Tests run every path the CPU supports.

#include <cstdint>
#include <string>

#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "../core/errors.hpp"

#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__)
#define APEX_PACKED_X86 1
#include <cpuid.h>
#include <immintrin.h>
// The target strings name everything a path's kernels use; a path is only
// entered after cpu_supports() said yes.
// F16C (fp16 scales of the block formats) came with AVX2 on every x86 CPU.
#define APEX_TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))
// AVX-512BW (byte and word integer ops on zmm: the block formats' tiles)
// came with AVX-512F on every CPU since Skylake-SP; VNNI (`vpdpbusd`) with
// Ice Lake / Cascade Lake, and every CPU with AVX-512 BF16 has VNNI too.
// The VNNI paths also take VL (`vpdpbusd` on ymm: Q8_0's one-row tile),
// which every CPU with AVX-512 VNNI has.
#define APEX_TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx2,fma,f16c")))
#define APEX_TARGET_AVX512VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))
#define APEX_TARGET_AVX512BF16 \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx512bf16,avx2,fma,f16c")))
#define APEX_TARGET_AMX_BF16 \
  __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512vnni,avx512bf16,avx2,fma,f16c")))
#define APEX_TARGET_AMX_INT8 \
  __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512vnni,avx512bf16,avx2,fma,f16c")))
// A tile's per-block step, inlined so the tile's accumulators stay in
// registers (GCC otherwise keeps the larger block bodies out of line).
#define APEX_KERNEL_INLINE __attribute__((always_inline))
#else
#define APEX_PACKED_X86 0
#endif

namespace apex::packed {

/// A kernel path. Each includes the one before it:
/// - `avx512`: AVX-512F and BW; the block formats' integer products with
///   `vpmaddubsw`/`vpmaddwd` on zmm;
/// - `avx512_vnni`: as avx512 with VL, the block formats' products with
///   `vpdpbusd`;
/// - `avx512_bf16`: as avx512_vnni, and bf16 weights may be multiplied in
///   pairs with `vdpbf16ps` (Bf16Products::paired);
/// - `amx_bf16`: as avx512_bf16, with the paired products on AMX-BF16 tiles
///   (`tdpbf16ps`, kernels/arch/amx_bf16.hpp) and Q8_0, Q4_0 and MXFP4 on
///   AMX-INT8 tiles from 16 rows (`tdpbssd`, the VNNI tiles' bits,
///   kernels/arch/amx_int8_quant.hpp). Never the compile-time
///   default: the tiles need the operating system's permission, asked at
///   run time.
/// Float weights run the same AVX-512 tiles on the last four.
enum class Isa { scalar, avx2, avx512, avx512_vnni, avx512_bf16, amx_bf16 };

/// The path the compiler targets (see the file comment).
inline constexpr Isa kDefaultIsa =
#if APEX_PACKED_X86 && defined(__AVX512BF16__) && defined(__AVX512VNNI__) && defined(__AVX512VL__) && \
    defined(__AVX512BW__)
    Isa::avx512_bf16;
#elif APEX_PACKED_X86 && defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(__AVX512BW__)
    Isa::avx512_vnni;
#elif APEX_PACKED_X86 && defined(__AVX512F__) && defined(__AVX512BW__)
    Isa::avx512;
#elif APEX_PACKED_X86 && defined(__AVX2__) && defined(__FMA__)
    Isa::avx2;
#else
    Isa::scalar;
#endif

/// All paths, in increasing order of capability.
inline constexpr Isa kAllIsas[] = {Isa::scalar, Isa::avx2, Isa::avx512, Isa::avx512_vnni, Isa::avx512_bf16,
                                   Isa::amx_bf16};

inline const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::scalar: return "scalar";
    case Isa::avx2: return "avx2";
    case Isa::avx512: return "avx512";
    case Isa::avx512_vnni: return "avx512_vnni";
    case Isa::avx512_bf16: return "avx512_bf16";
    case Isa::amx_bf16: return "amx_bf16";
  }
  return "unknown";
}

namespace detail {
#if APEX_PACKED_X86
/// F16C (CPUID leaf 1, ECX bit 29), asked of the CPU directly (Clang's
/// __builtin_cpu_supports has no "f16c") and once: under a hypervisor every
/// CPUID traps to it (7.1 µs each on a 2-vCPU EPYC VM), and every expert's
/// forward checks its path (check_forward_options), so asking each time cost
/// a decode step of eight experts 57 µs.
inline bool cpu_has_f16c() {
  static const bool has = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    return __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C) != 0;
  }();
  return has;
}

/// Whether the CPU has AMX-TILE and AMX-BF16 (CPUID leaf 7, EDX bits 24
/// and 22) and Linux lets this process use the tile data (arch_prctl
/// ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA, Linux ≥ 5.16; without it the
/// first tile instruction faults). Asked once; the grant is the process's.
inline bool amx_bf16_granted() {
  static const bool granted = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || (d & (1u << 24)) == 0 || (d & (1u << 22)) == 0) return false;
#if defined(__linux__) && defined(SYS_arch_prctl)
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
#else
    return false;
#endif
  }();
  return granted;
}

/// Whether the CPU also has AMX-INT8 (CPUID leaf 7, EDX bit 25: `tdpbssd`,
/// the block formats' tiles on path amx_bf16). Every CPU with AMX-BF16 so
/// far has it; asked once. The tile data's grant is amx_bf16_granted's.
inline bool amx_int8_present() {
  static const bool present = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    return __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d & (1u << 25)) != 0;
  }();
  return present;
}
#endif
}  // namespace detail

/// Whether the running CPU can execute path `isa`.
inline bool cpu_supports(Isa isa) {
  switch (isa) {
    case Isa::scalar: return true;
#if APEX_PACKED_X86
    case Isa::avx2: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && detail::cpu_has_f16c();
    case Isa::avx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && cpu_supports(Isa::avx2);
    case Isa::avx512_vnni:
      return cpu_supports(Isa::avx512) && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
    case Isa::avx512_bf16: return cpu_supports(Isa::avx512_vnni) && __builtin_cpu_supports("avx512bf16");
    case Isa::amx_bf16: return cpu_supports(Isa::avx512_bf16) && detail::amx_bf16_granted();
#else
    default: return false;
#endif
  }
  return false;
}

/// Whether `isa` is one of the AVX-512 paths (which share the float tiles).
constexpr bool is_avx512(Isa isa) {
  return isa == Isa::avx512 || isa == Isa::avx512_vnni || isa == Isa::avx512_bf16 || isa == Isa::amx_bf16;
}

/// Whether path `isa` has `vpdpbusd` (the block formats' VNNI tiles).
constexpr bool has_vnni(Isa isa) {
  return isa == Isa::avx512_vnni || isa == Isa::avx512_bf16 || isa == Isa::amx_bf16;
}

/// Whether path `isa` has `vdpbf16ps` (Bf16Products::paired).
constexpr bool has_bf16_pairs(Isa isa) { return isa == Isa::avx512_bf16 || isa == Isa::amx_bf16; }

/// Which tiles the block formats (Q8_0 … MXFP4) run on path `isa`: "vnni"
/// (`vpdpbusd`), "amx_int8+vnni" (`tdpbssd` for the 32-weight formats from
/// 16 rows, where the CPU has it), "avx512bw", "avx2" or "scalar" (for
/// benchmark reports).
constexpr const char* block_format_tiles(Isa isa) {
  return isa == Isa::amx_bf16       ? "amx_int8+vnni"
         : has_vnni(isa)            ? "vnni"
         : isa == Isa::avx512       ? "avx512bw"
         : isa == Isa::avx2         ? "avx2"
                                    : "scalar";
}

namespace detail {
/// ConfigError unless the CPU runs `isa`: a path named explicitly on the wrong
/// machine would otherwise die of an illegal instruction.
inline void require_isa(const char* where, Isa isa) {
  bool known = false;  // a value cast from an integer: name it, not "unknown"
  for (Isa i : kAllIsas) known = known || i == isa;
  apex::detail::require_config(known, where, [&] {
    return "isa must be one of scalar, avx2, avx512, avx512_vnni, avx512_bf16, amx_bf16, got " +
           std::to_string(int(isa));
  });
  apex::detail::require_config(cpu_supports(isa), where, [&] {
    return std::string("kernel path '") + isa_name(isa) + "' is not supported by this CPU";
  });
}

#if APEX_PACKED_X86
#ifndef APEX_PACKED_PREFETCH_BYTES
#define APEX_PACKED_PREFETCH_BYTES 4096
#endif
/// How far ahead of the slab being multiplied the kernels prefetch weights.
/// With few rows the loop is a chain of dependent FMAs, the out-of-order
/// window fills with them and the hardware alone keeps too few cache misses in
/// flight to reach the memory bandwidth; an explicit prefetch 4 KiB ahead
/// (into the next panel at a panel's end: panels are contiguous) restores it
/// (measured here: bf16 decode from ≈ 68 % to ≈ 90 % of the read bandwidth;
/// 1 and 2 KiB help less, 8 KiB less again).
/// Prefetches never fault; the address is formed as an integer, never as an
/// out-of-range pointer.
inline constexpr std::uintptr_t kPrefetchBytes = APEX_PACKED_PREFETCH_BYTES;

APEX_KERNEL_INLINE inline void prefetch_slab(const void* slab) {
  const std::uintptr_t a = reinterpret_cast<std::uintptr_t>(slab) + kPrefetchBytes;
  _mm_prefetch(reinterpret_cast<const char*>(a), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(a + 64), _MM_HINT_T0);
}
/// The cache line kPrefetchBytes ahead of `line`: a tile that reads a slab
/// front to back issues it beside each load of a code line, one prefetch per
/// line, spread over the block, instead of a burst at the block's start.
/// It began with the K-quant tiles: a super-block's codes are 4 KiB a panel
/// (Q4_K; Q6_K 6 KiB), so without it each block starts on a page the
/// hardware prefetcher has not seen and its first loads wait on DRAM (one
/// Qwen3-30B-A3B MoE step, cold, on against off: Q4_K 1.02–1.18×, Q6_K
/// 1.04–1.29× on the three x86 paths; docs/performance.md, "K-quant decode,
/// one prefetch a line"). Which tiles take it, and what it gave each, is
/// written at the tile: the `Ahead` passes of the K-quant entries (every
/// x86 path), the AVX2 Q8_0 entry's in-order pass (which the AVX-512BW
/// path also runs at one row) and the VNNI Q4_0/MXFP4 entry
/// (`kSkipsBurst`). The VNNI Q8_0 entry prefetches nothing (the burst and
/// one a line both lost there); the AVX-512BW Q8_0 tile keeps the burst
/// above one row.
///
/// Both prefetch helpers are always inlined: GCC counts a function whose
/// only effect is a prefetch as free of side effects, and where it cannot
/// inline one into a kernel of another target it deletes the call.
APEX_KERNEL_INLINE inline void prefetch_line(const void* line) {
  const std::uintptr_t a = reinterpret_cast<std::uintptr_t>(line) + kPrefetchBytes;
  _mm_prefetch(reinterpret_cast<const char*>(a), _MM_HINT_T0);
}
#endif

}  // namespace detail

}  // namespace apex::packed
