# PyTorch interop of checkpoints, both directions, live (the committed
# fixtures in tests/data/ already cover PyTorch → apex-ffn without torch).
# Included from tests/CMakeLists.txt after apex_ffn_tests is defined.
#
#   checkpoint.interop.apex_export      apex_ffn_tests "[export]" saves layers, inputs and outputs
#   checkpoint.interop.torch_loads_apex tools/torch_reference.py check-dir: PyTorch loads them, ≤ 1e-10
#   checkpoint.interop.torch_fixtures   tools/torch_reference.py fixtures: fresh PyTorch checkpoints
#   checkpoint.interop.apex_loads_torch apex_ffn_tests "[import]" on them, ≤ 1e-10
#
# Registered only when test_checkpoint_interop.cpp is part of the build and a Python
# interpreter can `import torch` at configure time (Debian: python3-torch).
# APEX_FFN_TORCH_PYTHON names the interpreter; empty = search python3 on the
# PATH, then /usr/bin/python3.

if(NOT "${CMAKE_CURRENT_SOURCE_DIR}/test_checkpoint_interop.cpp" IN_LIST APEX_FFN_TEST_SOURCES)
  return()
endif()

set(APEX_FFN_TORCH_PYTHON "" CACHE FILEPATH "Python with torch for the checkpoint interop tests (empty: search)")
apex_ffn_python_with(_apex_torch_python torch APEX_FFN_TORCH_PYTHON)
if(NOT _apex_torch_python)
  message(STATUS "apex-ffn: no Python with torch; checkpoint interop tests not registered")
  return()
endif()
message(STATUS "apex-ffn: checkpoint interop tests use ${_apex_torch_python}")

set(_apex_interop_dir "${CMAKE_CURRENT_BINARY_DIR}/interop")
set(_apex_torch_ref "${PROJECT_SOURCE_DIR}/tools/torch_reference.py")

add_test(NAME checkpoint.interop.apex_export
  COMMAND apex_ffn_tests "[export]" --warn NoTests)
set_tests_properties(checkpoint.interop.apex_export PROPERTIES
  ENVIRONMENT "APEX_FFN_INTEROP_DIR=${_apex_interop_dir}/from_apex"
  FIXTURES_SETUP apex_ffn_from_apex LABELS interop)

add_test(NAME checkpoint.interop.torch_loads_apex
  COMMAND "${_apex_torch_python}" "${_apex_torch_ref}" check-dir "${_apex_interop_dir}/from_apex" --tol 1e-10)
set_tests_properties(checkpoint.interop.torch_loads_apex PROPERTIES
  FIXTURES_REQUIRED apex_ffn_from_apex LABELS interop)

add_test(NAME checkpoint.interop.torch_fixtures
  COMMAND "${_apex_torch_python}" "${_apex_torch_ref}" fixtures "${_apex_interop_dir}/from_torch" --seed-base 1000)
set_tests_properties(checkpoint.interop.torch_fixtures PROPERTIES
  FIXTURES_SETUP apex_ffn_from_torch LABELS interop)

add_test(NAME checkpoint.interop.apex_loads_torch
  COMMAND apex_ffn_tests "[import]" --warn NoTests)
set_tests_properties(checkpoint.interop.apex_loads_torch PROPERTIES
  ENVIRONMENT "APEX_FFN_TORCH_DIR=${_apex_interop_dir}/from_torch"
  FIXTURES_REQUIRED apex_ffn_from_torch LABELS interop)
