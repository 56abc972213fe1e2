# GGUF interop with gguf-py (PyPI `gguf`, llama.cpp's Python package), both
# directions, on the content tests/gguf_interop.py and tests/test_gguf.cpp
# both state:
#
#   gguf.interop.py_writes      gguf_interop.py write: GGUFWriter writes from_py.gguf
#   gguf.interop.apex_reads     apex_ffn_tests "[.gguf_interop_read]": gguf::File reads it, values and bytes
#   gguf.interop.apex_writes    apex_ffn_tests "[.gguf_interop_write]": gguf::Writer saves from_apex.gguf
#   gguf.interop.py_reads       gguf_interop.py check: GGUFReader reads it back identically
#   gguf.interop.py_type_sizes  gguf_interop.py types: gguf-py's type size table agrees with ours
#
# Registered only when test_gguf.cpp is part of the build and a Python
# interpreter can `import gguf` at configure time. APEX_FFN_GGUF_PYTHON names
# the interpreter; empty = search python3 on the PATH, then
# /usr/bin/python3 (the first that imports gguf).

if(NOT "${CMAKE_CURRENT_SOURCE_DIR}/test_gguf.cpp" IN_LIST APEX_FFN_TEST_SOURCES)
  return()
endif()

set(APEX_FFN_GGUF_PYTHON "" CACHE FILEPATH "Python with gguf-py for the GGUF interop tests (empty: search)")
apex_ffn_python_with(_apex_gguf_python "gguf, numpy" APEX_FFN_GGUF_PYTHON)
if(NOT _apex_gguf_python)
  message(STATUS "apex-ffn: no Python with gguf-py (pip install gguf); GGUF interop tests not registered")
  return()
endif()
message(STATUS "apex-ffn: GGUF interop tests use ${_apex_gguf_python}")

set(_apex_gguf_dir "${CMAKE_CURRENT_BINARY_DIR}/gguf_interop")
set(_apex_gguf_script "${CMAKE_CURRENT_SOURCE_DIR}/gguf_interop.py")
file(MAKE_DIRECTORY "${_apex_gguf_dir}")

add_test(NAME gguf.interop.py_writes
  COMMAND "${_apex_gguf_python}" "${_apex_gguf_script}" write "${_apex_gguf_dir}/from_py.gguf")
set_tests_properties(gguf.interop.py_writes PROPERTIES FIXTURES_SETUP apex_ffn_gguf_from_py LABELS interop)

add_test(NAME gguf.interop.apex_reads COMMAND apex_ffn_tests "[.gguf_interop_read]" --warn NoTests)
set_tests_properties(gguf.interop.apex_reads PROPERTIES
  ENVIRONMENT "APEX_GGUF_INTEROP_DIR=${_apex_gguf_dir}" FIXTURES_REQUIRED apex_ffn_gguf_from_py LABELS interop)

add_test(NAME gguf.interop.apex_writes COMMAND apex_ffn_tests "[.gguf_interop_write]" --warn NoTests)
set_tests_properties(gguf.interop.apex_writes PROPERTIES
  ENVIRONMENT "APEX_GGUF_INTEROP_DIR=${_apex_gguf_dir}" FIXTURES_SETUP apex_ffn_gguf_from_apex LABELS interop)

add_test(NAME gguf.interop.py_reads
  COMMAND "${_apex_gguf_python}" "${_apex_gguf_script}" check "${_apex_gguf_dir}/from_apex.gguf")
set_tests_properties(gguf.interop.py_reads PROPERTIES
  FIXTURES_REQUIRED apex_ffn_gguf_from_apex LABELS interop FAIL_REGULAR_EXPRESSION "FAIL")

add_test(NAME gguf.interop.py_type_sizes
  COMMAND "${_apex_gguf_python}" "${_apex_gguf_script}" types "${_apex_gguf_dir}/types.gguf")
set_tests_properties(gguf.interop.py_type_sizes PROPERTIES
  FIXTURES_REQUIRED apex_ffn_gguf_from_apex LABELS interop FAIL_REGULAR_EXPRESSION "FAIL")
