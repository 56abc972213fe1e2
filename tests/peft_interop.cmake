# peft's LoRA adapter files, both ways, live against peft itself:
#
#   peft.interop.torch_fixtures    tools/peft_reference.py fixtures: tiny models of every MoE family
#                                  transformers holds, peft adapters on their experts, float64 outputs,
#                                  ∂L/∂x and the adapters' autograd gradients
#   peft.interop.apex_loads_peft   apex_ffn_tests "[peft][import]": the library loads peft's files and
#                                  matches those (≤ 1e-10 in double, ≤ 1e-5 over f32 packed experts)
#   peft.interop.apex_export       apex_ffn_tests "[peft][export]": the library saves adapters and outputs
#   peft.interop.peft_loads_apex   tools/peft_reference.py check: PeftModel.from_pretrained loads them,
#                                  every tensor as saved, and matches the outputs (≤ 1e-10)
#
# Registered only when test_peft_files.cpp is part of the build and a Python
# interpreter can `import torch, transformers, peft, safetensors`
# (APEX_FFN_PEFT_PYTHON, else tests/find_python.cmake's search); otherwise a
# status message says why, and the C++ cases skip with a message when
# APEX_FFN_PEFT_DIR is not set.

if(NOT "${CMAKE_CURRENT_SOURCE_DIR}/test_peft_files.cpp" IN_LIST APEX_FFN_TEST_SOURCES)
  return()
endif()
set(APEX_FFN_PEFT_PYTHON "" CACHE FILEPATH "Python with torch, transformers and peft for the peft interop tests (empty: search)")
apex_ffn_python_with(_apex_peft_python "torch, transformers, peft, safetensors" APEX_FFN_PEFT_PYTHON)
if(NOT _apex_peft_python)
  message(STATUS "apex-ffn: no Python with torch, transformers, peft and safetensors; peft interop tests not registered")
  return()
endif()
message(STATUS "apex-ffn: peft interop tests use ${_apex_peft_python}")

set(_apex_peft_dir "${CMAKE_CURRENT_BINARY_DIR}/interop/peft")
set(_apex_peft_ref "${PROJECT_SOURCE_DIR}/tools/peft_reference.py")

add_test(NAME peft.interop.torch_fixtures
  COMMAND "${_apex_peft_python}" "${_apex_peft_ref}" fixtures "${_apex_peft_dir}")
set_tests_properties(peft.interop.torch_fixtures PROPERTIES FIXTURES_SETUP apex_ffn_peft LABELS interop)

add_test(NAME peft.interop.apex_loads_peft
  COMMAND apex_ffn_tests "[peft][import]" --warn NoTests)
set_tests_properties(peft.interop.apex_loads_peft PROPERTIES
  ENVIRONMENT "APEX_FFN_PEFT_DIR=${_apex_peft_dir}"
  FIXTURES_REQUIRED apex_ffn_peft LABELS interop)

add_test(NAME peft.interop.apex_export
  COMMAND apex_ffn_tests "[peft][export]" --warn NoTests)
set_tests_properties(peft.interop.apex_export PROPERTIES
  ENVIRONMENT "APEX_FFN_PEFT_DIR=${_apex_peft_dir}"
  FIXTURES_REQUIRED apex_ffn_peft FIXTURES_SETUP apex_ffn_peft_export LABELS interop)

add_test(NAME peft.interop.peft_loads_apex
  COMMAND "${_apex_peft_python}" "${_apex_peft_ref}" check "${_apex_peft_dir}" --tol 1e-10)
set_tests_properties(peft.interop.peft_loads_apex PROPERTIES
  FIXTURES_REQUIRED "apex_ffn_peft;apex_ffn_peft_export" LABELS interop)
