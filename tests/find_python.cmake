# apex_ffn_python_with(OUT MODULES CHOSEN): the Python interpreter the live
# interop tests run, in OUT: the one the cache variable named CHOSEN gives
# (APEX_FFN_TORCH_PYTHON, APEX_FFN_GGUF_PYTHON, APEX_FFN_PEFT_PYTHON) if set,
# else the first of python3 on the PATH, the interpreters of the virtual
# environments APEX_FFN_PYTHON_VENVS lists (the active one and the source
# tree's .venv, which CI creates) and /usr/bin/python3 that can
# `import MODULES` ("torch", "gguf, numpy"), else "". The search runs once
# per build folder and module list (an internal cache entry), since each try
# starts Python.
set(APEX_FFN_PYTHON_VENVS "$ENV{VIRTUAL_ENV};${PROJECT_SOURCE_DIR}/.venv" CACHE STRING
    "Virtual environments whose Python the interop tests try after python3 on the PATH")
function(apex_ffn_python_with out modules chosen)
  if(${chosen})
    set(${out} "${${chosen}}" PARENT_SCOPE)
    return()
  endif()
  string(MAKE_C_IDENTIFIER "${modules}" _id)
  set(_entry APEX_FFN_PYTHON_WITH_${_id})
  if(NOT DEFINED CACHE{${_entry}})
    find_program(_path_python NAMES python3 NO_CACHE)
    set(_found "")
    set(_candidates "${_path_python}")
    foreach(_venv IN LISTS APEX_FFN_PYTHON_VENVS)
      if(_venv)
        list(APPEND _candidates "${_venv}/bin/python3" "${_venv}/bin/python")
      endif()
    endforeach()
    list(APPEND _candidates /usr/bin/python3)
    foreach(_py IN LISTS _candidates)
      if(_py AND EXISTS "${_py}" AND NOT _found)
        execute_process(COMMAND "${_py}" -c "import ${modules}" RESULT_VARIABLE _rc OUTPUT_QUIET ERROR_QUIET
                        TIMEOUT 120)
        if(_rc EQUAL 0)
          set(_found "${_py}")
        endif()
      endif()
    endforeach()
    set(${_entry} "${_found}" CACHE INTERNAL "Python that imports ${modules} (searched once)")
  endif()
  set(${out} "${${_entry}}" PARENT_SCOPE)
endfunction()
