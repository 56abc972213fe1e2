# The Python package's tests (tests/python, pytest), against the extension
# built here as the target apex_ffn_python (python/CMakeLists.txt), so the
# suite needs no pip install:
#
#   python.<file>       tests/python/test_<file>.py, with PYTHONPATH at the built package
#   python.example.<e>  examples/python/<e>.py, shortened (it runs to the end)
#
# Registered when a Python interpreter can `import torch, transformers, peft,
# safetensors, gguf, nanobind, pytest` (APEX_FFN_TEST_PYTHON, else
# tests/find_python.cmake's search) and has its development headers;
# otherwise a status message says why and nothing is built. Each test file
# also skips itself, with a message, when an optional module it needs is absent.

option(APEX_FFN_PYTHON_TESTS "Build the Python extension and run the Python package's tests when a Python with torch is found" ON)
if(NOT APEX_FFN_PYTHON_TESTS)
  return()
endif()
set(APEX_FFN_TEST_PYTHON "" CACHE FILEPATH "Python with torch, transformers, peft, nanobind and pytest for the Python package's tests (empty: search)")
apex_ffn_python_with(_apex_py "torch, transformers, peft, safetensors, gguf, nanobind, pytest" APEX_FFN_TEST_PYTHON)
if(NOT _apex_py)
  message(STATUS "apex-ffn: no Python with torch, transformers, peft, safetensors, gguf, nanobind and pytest; "
                 "the Python package's tests are not built or registered")
  return()
endif()
set(Python_EXECUTABLE "${_apex_py}")
find_package(Python 3.9 COMPONENTS Interpreter Development.Module)
if(NOT Python_Development.Module_FOUND)
  message(STATUS "apex-ffn: ${_apex_py} has no development headers (Debian: python3-dev); "
                 "the Python package's tests are not built or registered")
  return()
endif()
message(STATUS "apex-ffn: the Python package's tests use ${_apex_py}")
add_subdirectory(${PROJECT_SOURCE_DIR}/python ${CMAKE_BINARY_DIR}/python)

file(GLOB _apex_py_tests CONFIGURE_DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/python/test_*.py)
foreach(_file IN LISTS _apex_py_tests)
  get_filename_component(_name ${_file} NAME_WE)
  string(REGEX REPLACE "^test_" "" _name ${_name})
  add_test(NAME python.${_name}
    COMMAND "${_apex_py}" -m pytest -q -p no:cacheprovider ${_file}
    WORKING_DIRECTORY ${CMAKE_CURRENT_SOURCE_DIR}/python)
  set_tests_properties(python.${_name} PROPERTIES LABELS python
    ENVIRONMENT "PYTHONPATH=${CMAKE_BINARY_DIR}/python;APEX_FFN_TEST_TMP=${CMAKE_CURRENT_BINARY_DIR}/python-tmp"
    # pytest's exit code 5 (every test skipped or none collected) is not a failure
    SKIP_RETURN_CODE 5)
endforeach()

add_test(NAME python.example.gguf_generate
  COMMAND "${_apex_py}" ${PROJECT_SOURCE_DIR}/examples/python/gguf_generate.py --tokens 4)
add_test(NAME python.example.lora_finetune
  COMMAND "${_apex_py}" ${PROJECT_SOURCE_DIR}/examples/python/lora_finetune.py --steps 6
          --out ${CMAKE_CURRENT_BINARY_DIR}/python-tmp/lora-adapter)
set_tests_properties(python.example.gguf_generate python.example.lora_finetune PROPERTIES LABELS python
  ENVIRONMENT "PYTHONPATH=${CMAKE_BINARY_DIR}/python")
