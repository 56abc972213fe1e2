# Family references generated live (the committed tests/data/family_*.safetensors
# already cover every family without torch): tools/moe_families.py writes a
# fresh set with other seeds, then apex_ffn_tests "[families][reference]"
# matches them too (APEX_FFN_FAMILY_DIR). Registered only when
# test_families.cpp is part of the build and a Python interpreter can
# `import torch` (the one interop.cmake found, or APEX_FFN_TORCH_PYTHON).

if(NOT "${CMAKE_CURRENT_SOURCE_DIR}/test_families.cpp" IN_LIST APEX_FFN_TEST_SOURCES)
  return()
endif()
set(_apex_family_python "${APEX_FFN_TORCH_PYTHON}")
if(NOT _apex_family_python AND DEFINED CACHE{APEX_FFN_TORCH_PYTHON_FOUND})
  set(_apex_family_python "${APEX_FFN_TORCH_PYTHON_FOUND}")
endif()
if(NOT _apex_family_python)
  foreach(_py IN ITEMS /usr/bin/python3)
    if(EXISTS "${_py}" AND NOT _apex_family_python)
      execute_process(COMMAND "${_py}" -c "import torch" RESULT_VARIABLE _rc OUTPUT_QUIET ERROR_QUIET TIMEOUT 120)
      if(_rc EQUAL 0)
        set(_apex_family_python "${_py}")
      endif()
    endif()
  endforeach()
endif()
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
add_test(NAME routing.families.apex_matches_torch
  COMMAND apex_ffn_tests "[families][reference]" --warn NoTests)
set_tests_properties(routing.families.apex_matches_torch PROPERTIES
  ENVIRONMENT "APEX_FFN_FAMILY_DIR=${_apex_family_dir}"
  FIXTURES_REQUIRED apex_ffn_families LABELS interop)
