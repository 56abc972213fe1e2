# Expert parallelism over MPI: the opt-in target apex::mpi (INTERFACE, the
# headers under include/apex/ffn/mpi/ plus MPI::MPI_CXX) and, at top level,
# its tests, benchmark and example. The core apex::ffn never links MPI.
# Included from the top-level CMakeLists.txt after the other targets exist.

option(APEX_FFN_MPI "Build the expert-parallel target apex::mpi when MPI is found" ON)
if(NOT APEX_FFN_MPI)
  return()
endif()
find_package(MPI COMPONENTS CXX QUIET)
if(NOT MPI_CXX_FOUND)
  message(STATUS "apex_ffn: MPI not found; apex::mpi (expert parallelism) is not built")
  return()
endif()

add_library(apex_ffn_mpi INTERFACE)
add_library(apex::mpi ALIAS apex_ffn_mpi)
# MPI::MPI_CXX is an imported target: its headers are SYSTEM includes, so
# -Wpedantic -Werror never fires inside mpi.h.
target_link_libraries(apex_ffn_mpi INTERFACE apex_ffn MPI::MPI_CXX)
# The layer uses MPI's C API only: skip the deprecated C++ bindings (faster to
# compile, and they do not build warning-free with -Wextra under mpicxx).
target_compile_definitions(apex_ffn_mpi INTERFACE OMPI_SKIP_MPICXX=1 MPICH_SKIP_MPICXX=1)
set_target_properties(apex_ffn_mpi PROPERTIES EXPORT_NAME mpi)
# Sharded checkpoints (mpi/expert_parallel_checkpoint.hpp) need apex::checkpoint as well.

# mpiexec for this machine's tests: as root Open MPI needs to be told it may
# run; --oversubscribe lets 3 and 4 ranks share fewer cores.
set(APEX_FFN_MPIEXEC_FLAGS --oversubscribe CACHE STRING "Extra mpiexec flags for the MPI tests and benchmarks")
set(APEX_FFN_MPI_ENV OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1)

foreach(part tests benchmarks examples)
  string(TOUPPER ${part} PART)
  if(PROJECT_IS_TOP_LEVEL AND APEX_FFN_BUILD_${PART} AND EXISTS ${PROJECT_SOURCE_DIR}/${part}/mpi/CMakeLists.txt)
    add_subdirectory(${PROJECT_SOURCE_DIR}/${part}/mpi ${PROJECT_BINARY_DIR}/${part}/mpi)
  endif()
endforeach()

if(APEX_FFN_INSTALL)
  install(TARGETS apex_ffn_mpi EXPORT apex_ffn_mpi_targets)
  install(EXPORT apex_ffn_mpi_targets NAMESPACE apex:: FILE apex_ffn-mpi-targets.cmake
          DESTINATION ${CMAKE_INSTALL_DATADIR}/cmake/apex_ffn)
endif()
