# Family references generated live (the committed tests/data/family_*.safetensors
# already cover every family without torch): tools/moe_families.py and
# tools/gpt_oss_reference.py write a fresh set with other seeds, then apex_ffn_tests "[families][reference]"
# matches them too (APEX_FFN_FAMILY_DIR). Registered only when
# test_families.cpp is part of the build and a Python interpreter can
# `import torch` (APEX_FFN_TORCH_PYTHON, else tests/find_python.cmake's search).

if(NOT "${CMAKE_CURRENT_SOURCE_DIR}/test_families.cpp" IN_LIST APEX_FFN_TEST_SOURCES)
  return()
endif()
set(APEX_FFN_TORCH_PYTHON "" CACHE FILEPATH "Python with torch for the checkpoint interop tests (empty: search)")
apex_ffn_python_with(_apex_family_python torch APEX_FFN_TORCH_PYTHON)
if(NOT _apex_family_python)
  message(STATUS "apex-ffn: no Python with torch; live MoE family references not registered")
  return()
endif()

set(_apex_family_dir "${CMAKE_CURRENT_BINARY_DIR}/interop/families")
add_test(NAME routing.families.torch_fixtures
  COMMAND "${_apex_family_python}" "${PROJECT_SOURCE_DIR}/tools/moe_families.py" fixtures "${_apex_family_dir}"
          --seed-base 1000)
set_tests_properties(routing.families.torch_fixtures PROPERTIES
  FIXTURES_SETUP apex_ffn_families LABELS interop)
add_test(NAME routing.gpt_oss.torch_fixtures
  COMMAND "${_apex_family_python}" "${PROJECT_SOURCE_DIR}/tools/gpt_oss_reference.py" fixtures "${_apex_family_dir}"
          --seed-base 1000)
set_tests_properties(routing.gpt_oss.torch_fixtures PROPERTIES
  FIXTURES_SETUP apex_ffn_families LABELS interop)
add_test(NAME routing.families.apex_matches_torch
  COMMAND apex_ffn_tests "[families][reference]" --warn NoTests)
set_tests_properties(routing.families.apex_matches_torch PROPERTIES
  ENVIRONMENT "APEX_FFN_FAMILY_DIR=${_apex_family_dir}"
  FIXTURES_REQUIRED apex_ffn_families LABELS interop)
