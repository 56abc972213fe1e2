# Compile options for this repository's own targets (tests, benchmarks,
# examples). Never attached to apex::ffn itself: consumers choose their flags.
add_library(apex_ffn_dev_options INTERFACE)
target_compile_options(apex_ffn_dev_options INTERFACE -Wall -Wextra -Wpedantic
  $<$<BOOL:${APEX_FFN_WERROR}>:-Werror>
  $<$<BOOL:${APEX_FFN_NATIVE}>:-march=native>
  # GCC 12 reports false '-Wmaybe-uninitialized' inside its AVX-512 intrinsic
  # headers when Eigen's packet code is inlined (GCC bug 105593).
  $<$<AND:$<BOOL:${APEX_FFN_NATIVE}>,$<CXX_COMPILER_ID:GNU>>:-Wno-maybe-uninitialized>)

# OpenMP threads the MoE dispatch; the library works without it.
# APEX_FFN_OPENMP=OFF builds the tests without it: ThreadSanitizer does not
# understand libgomp's synchronisation and would report its barriers as races.
option(APEX_FFN_OPENMP "Build tests, benchmarks and examples with OpenMP" ON)
if(APEX_FFN_OPENMP)
  find_package(OpenMP COMPONENTS CXX)
endif()
