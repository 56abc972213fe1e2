# PyTorch references of the optimiser generated live (the committed
# tests/data/optim_adamw_{f32,f64}.safetensors already cover it without
# torch): tools/optim_reference.py writes a fresh pair with other seeds, then
# apex_ffn_tests "[optim][reference]" matches them too (APEX_FFN_OPTIM_DIR).
# Registered only when test_optim.cpp is part of the build and a Python
# interpreter can `import torch` (APEX_FFN_TORCH_PYTHON, else
# tests/find_python.cmake's search).

if(NOT "${CMAKE_CURRENT_SOURCE_DIR}/test_optim.cpp" IN_LIST APEX_FFN_TEST_SOURCES)
  return()
endif()
set(APEX_FFN_TORCH_PYTHON "" CACHE FILEPATH "Python with torch for the checkpoint interop tests (empty: search)")
apex_ffn_python_with(_apex_optim_python torch APEX_FFN_TORCH_PYTHON)
if(NOT _apex_optim_python)
  message(STATUS "apex-ffn: no Python with torch; the live AdamW and clipping references are not registered "
                 "(the committed ones in tests/data still run)")
  return()
endif()

set(_apex_optim_dir "${CMAKE_CURRENT_BINARY_DIR}/interop/optim")
add_test(NAME optim.torch_fixtures
  COMMAND "${_apex_optim_python}" "${PROJECT_SOURCE_DIR}/tools/optim_reference.py" fixtures "${_apex_optim_dir}"
          --seed-base 1000)
set_tests_properties(optim.torch_fixtures PROPERTIES FIXTURES_SETUP apex_ffn_optim LABELS interop)
add_test(NAME optim.apex_matches_torch
  COMMAND apex_ffn_tests "[optim][reference]" --warn NoTests)
set_tests_properties(optim.apex_matches_torch PROPERTIES
  ENVIRONMENT "APEX_FFN_OPTIM_DIR=${_apex_optim_dir}"
  FIXTURES_REQUIRED apex_ffn_optim LABELS interop)
