# Builds and runs tests/consumer as a separate CMake project.
#   MODE=find_package      install this build into WORK_DIR/prefix, then find_package it
#   MODE=add_subdirectory  pull the source tree in with add_subdirectory
# Usage: cmake -DMODE=… -DSOURCE_DIR=… -DBUILD_DIR=… -DWORK_DIR=… -DCXX=… -DGENERATOR=… -P run_consumer.cmake
function(run)
  execute_process(COMMAND ${ARGV} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "consumer (${MODE}): command failed (${rc}): ${ARGV}")
  endif()
endfunction()

file(REMOVE_RECURSE ${WORK_DIR})
set(args -S ${SOURCE_DIR}/tests/consumer -B ${WORK_DIR}/build -G ${GENERATOR}
         -DCMAKE_CXX_COMPILER=${CXX} -DCMAKE_BUILD_TYPE=Release -DCONSUMER_MODE=${MODE})
if(MODE STREQUAL "find_package")
  run(${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${WORK_DIR}/prefix)
  if(NOT EXISTS ${WORK_DIR}/prefix/share/cmake/apex_ffn/apex_ffn-config.cmake)
    message(FATAL_ERROR "install did not produce share/cmake/apex_ffn/apex_ffn-config.cmake")
  endif()
  list(APPEND args -DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix)
else()
  list(APPEND args -DAPEX_FFN_SOURCE_DIR=${SOURCE_DIR})
endif()
run(${CMAKE_COMMAND} ${args})
run(${CMAKE_COMMAND} --build ${WORK_DIR}/build)
run(${WORK_DIR}/build/consumer)
