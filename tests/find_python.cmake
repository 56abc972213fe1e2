# apex_ffn_python_with(OUT MODULES CHOSEN): the Python interpreter the live
# interop tests run, in OUT: the one the cache variable named CHOSEN gives
# (APEX_FFN_TORCH_PYTHON, APEX_FFN_GGUF_PYTHON) if set, else the first of
# python3 on the PATH and /usr/bin/python3 that can `import MODULES`
# ("torch", "gguf, numpy"), else "". The search runs once per build folder
# and module list (an internal cache entry), since each try starts Python.
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
    foreach(_py IN ITEMS "${_path_python}" /usr/bin/python3)
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
