# GGUF MoE blocks written by llama.cpp's own Python writer (PyPI gguf), live:
# tests/gguf_moe_reference.py writes one block per architecture and tensor
# type with a numpy reference output of llama.cpp's routing, then
# apex_ffn_tests "[gguf_moe][python]" (test_gguf_moe_python.cpp) and
# "[gguf_gpt_oss][python]" (test_gguf_gpt_oss.cpp) load each and match it
# (APEX_FFN_GGUF_PY_DIR). Each is registered only when its file is part of
# the build, and the writer when either is and a Python interpreter can
# `import gguf, numpy`
# (APEX_FFN_GGUF_PYTHON, else python3 on the PATH, then
# /usr/bin/python3); otherwise a status message says why, and the C++ test
# itself skips with a message when the directory is not given.

set(_apex_ggufmoe_reads "")
if("${CMAKE_CURRENT_SOURCE_DIR}/test_gguf_moe_python.cpp" IN_LIST APEX_FFN_TEST_SOURCES)
  list(APPEND _apex_ggufmoe_reads "gguf_moe")
endif()
if("${CMAKE_CURRENT_SOURCE_DIR}/test_gguf_gpt_oss.cpp" IN_LIST APEX_FFN_TEST_SOURCES)
  list(APPEND _apex_ggufmoe_reads "gguf_gpt_oss")
endif()
if(NOT _apex_ggufmoe_reads)
  return()
endif()
set(APEX_FFN_GGUF_PYTHON "" CACHE FILEPATH "Python with gguf-py for the GGUF interop tests (empty: search)")
apex_ffn_python_with(_apex_ggufmoe_python "gguf, numpy" APEX_FFN_GGUF_PYTHON)
if(NOT _apex_ggufmoe_python)
  message(STATUS "apex-ffn: no Python with the gguf package; GGUF interop test not registered")
  return()
endif()

set(_apex_ggufmoe_dir "${CMAKE_CURRENT_BINARY_DIR}/interop/gguf_moe")
add_test(NAME gguf_moe.interop.python_writer
  COMMAND "${_apex_ggufmoe_python}" "${CMAKE_CURRENT_SOURCE_DIR}/gguf_moe_reference.py" "${_apex_ggufmoe_dir}")
set_tests_properties(gguf_moe.interop.python_writer PROPERTIES FIXTURES_SETUP apex_ffn_gguf_moe_py LABELS interop)
foreach(_tag IN LISTS _apex_ggufmoe_reads)  # gguf_moe.interop.apex_loads_python, gguf_gpt_oss.interop.apex_loads_python
  add_test(NAME ${_tag}.interop.apex_loads_python
    COMMAND apex_ffn_tests "[${_tag}][python]" --warn NoTests)
  set_tests_properties(${_tag}.interop.apex_loads_python PROPERTIES
    ENVIRONMENT "APEX_FFN_GGUF_PY_DIR=${_apex_ggufmoe_dir}"
    FIXTURES_REQUIRED apex_ffn_gguf_moe_py LABELS interop)
endforeach()
