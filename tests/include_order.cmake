# The include order of the headers (README.md, "Where the headers are"):
# each folder of include/apex/ffn/ includes only itself and the folders
# below it, so a layer can be read, tested and reused without the ones above.
#
#   cmake -DHEADERS=<source>/include/apex/ffn -P tests/include_order.cmake
#
# Reads every `#include "…"` of every header under HEADERS, resolves it from
# the including file's folder and fails listing each include that points up
# (file:line -> target, and the rule it breaks), or at a header that does not
# exist. The rule:
#
#   core < optim < quant < kernels < layers < moe < io < inference < adapters < mpi
#
# A subfolder counts as its folder (kernels/arch/ is kernels), except inside
# the folders ordered below, whose own headers come last: io/file/ holds the
# files themselves, under both formats (which do not include each other);
# inference/engine/ holds the layers, inference/files/ their file formats.
# The umbrella headers (include/apex/ffn/*.hpp, include/apex/ffn.hpp) may
# include anything and no folder may include them.

cmake_minimum_required(VERSION 3.25)
if(NOT HEADERS OR NOT IS_DIRECTORY "${HEADERS}")
  message(FATAL_ERROR "include_order.cmake: set -DHEADERS=<source>/include/apex/ffn (got '${HEADERS}')")
endif()
get_filename_component(HEADERS "${HEADERS}" ABSOLUTE)

set(ORDER core optim quant kernels layers moe io inference adapters mpi)
# Within a folder, ranks of its subfolders; "|" joins siblings of one rank,
# "." is the folder's own headers. A subfolder not listed ranks as ".".
set(ORDER_io "file" "safetensors|gguf" ".")
set(ORDER_inference "engine" "files" ".")

# Where a header (a path relative to HEADERS) stands: its folder, the
# folder's rank, its subfolder within that folder's order and the
# subfolder's rank. Umbrella headers rank above every folder.
function(place rel out_folder out_rank out_sub out_sub_rank)
  list(LENGTH ORDER n_folders)
  set(folder "(umbrella)")
  set(rank ${n_folders})
  set(sub ".")
  set(sub_rank 0)
  string(REPLACE "/" ";" parts "${rel}")
  list(LENGTH parts n_parts)
  list(GET parts 0 first)
  if(n_parts GREATER 1 AND NOT first STREQUAL "..")
    set(folder ${first})
    list(FIND ORDER ${folder} rank)
    if(rank LESS 0)
      set(rank -1)  # a folder outside the order: reported by the caller
    endif()
    if(DEFINED ORDER_${folder})
      set(sub ".")
      if(n_parts GREATER 2)
        list(GET parts 1 sub)
      endif()
      set(i 0)
      set(sub_rank -1)
      set(dot_rank -1)
      foreach(level IN LISTS ORDER_${folder})
        string(REPLACE "|" ";" names "${level}")
        if(sub IN_LIST names)
          set(sub_rank ${i})
        endif()
        if("." IN_LIST names)
          set(dot_rank ${i})
        endif()
        math(EXPR i "${i} + 1")
      endforeach()
      if(sub_rank LESS 0)
        set(sub ".")
        set(sub_rank ${dot_rank})
      endif()
    endif()
  endif()
  set(${out_folder} ${folder} PARENT_SCOPE)
  set(${out_rank} ${rank} PARENT_SCOPE)
  set(${out_sub} ${sub} PARENT_SCOPE)
  set(${out_sub_rank} ${sub_rank} PARENT_SCOPE)
endfunction()

string(JOIN " < " rule_text ${ORDER})
set(rules "each folder includes only the folders below it: ${rule_text}")
foreach(folder IN ITEMS io inference)
  set(levels "")
  foreach(level IN LISTS ORDER_${folder})
    string(REPLACE "|" ", " level "${level}")
    string(REPLACE "." "${folder}/*.hpp" level "${level}")
    list(APPEND levels "${level}")
  endforeach()
  string(JOIN " < " level_text ${levels})
  string(APPEND rules "; inside ${folder}/: ${level_text}")
endforeach()

file(GLOB_RECURSE headers RELATIVE "${HEADERS}" "${HEADERS}/*.hpp")
list(SORT headers)
set(problems "")
set(n_includes 0)
foreach(rel IN LISTS headers)
  place("${rel}" from from_rank from_sub from_sub_rank)
  if(from_rank LESS 0)
    list(APPEND problems "${rel}: folder '${from}' is not in the order (add it to ORDER in tests/include_order.cmake)")
    continue()
  endif()
  get_filename_component(dir "${HEADERS}/${rel}" DIRECTORY)
  file(READ "${HEADERS}/${rel}" text)
  # One list element per line: the characters a CMake list treats specially
  # are replaced first (no include path holds them).
  string(REPLACE ";" "," text "${text}")
  string(REPLACE "[" "(" text "${text}")
  string(REPLACE "]" ")" text "${text}")
  string(REPLACE "\\" "/" text "${text}")
  string(REPLACE "\n" ";" lines "${text}")
  set(line_no 0)
  foreach(line IN LISTS lines)
    math(EXPR line_no "${line_no} + 1")
    if(NOT line MATCHES "^[ \t]*#[ \t]*include[ \t]*\"([^\"]+)\"")
      continue()
    endif()
    math(EXPR n_includes "${n_includes} + 1")
    set(inc "${CMAKE_MATCH_1}")
    get_filename_component(target "${dir}/${inc}" ABSOLUTE)
    file(RELATIVE_PATH target_rel "${HEADERS}" "${target}")
    set(where "${rel}:${line_no} -> ${target_rel}")
    if(NOT EXISTS "${target}")
      list(APPEND problems "${where}: no such header")
      continue()
    endif()
    if(target_rel MATCHES "^\\.\\./" AND NOT target_rel STREQUAL "../ffn.hpp")
      list(APPEND problems "${where}: outside include/apex/ffn/")
      continue()
    endif()
    place("${target_rel}" to to_rank to_sub to_sub_rank)
    if(from STREQUAL "(umbrella)" OR from STREQUAL to AND NOT DEFINED ORDER_${from})
      continue()
    endif()
    if(NOT from STREQUAL to)
      if(to_rank LESS 0)
        list(APPEND problems "${where}: folder '${to}' is not in the order")
      elseif(to STREQUAL "(umbrella)")
        list(APPEND problems "${where}: ${from}/ may not include an umbrella header (it includes every folder)")
      elseif(to_rank GREATER from_rank)
        list(APPEND problems "${where}: ${from}/ may not include ${to}/ (${to} is above ${from})")
      endif()
    elseif(NOT from_sub STREQUAL to_sub AND NOT to_sub_rank LESS from_sub_rank)
      set(a "${from}/${from_sub}")
      set(b "${to}/${to_sub}")
      if(from_sub STREQUAL ".")
        set(a "${from}/*.hpp")
      endif()
      if(to_sub STREQUAL ".")
        set(b "${from}/*.hpp")
      endif()
      if(to_sub_rank EQUAL from_sub_rank)
        list(APPEND problems "${where}: ${a} may not include ${b} (siblings: what both need belongs below them)")
      else()
        list(APPEND problems "${where}: ${a} may not include ${b} (${b} is above ${a})")
      endif()
    endif()
  endforeach()
endforeach()

list(LENGTH headers n_headers)
list(LENGTH problems n_problems)
if(n_problems GREATER 0)
  list(JOIN problems "\n  " listing)
  message(FATAL_ERROR "include order: ${n_problems} of ${n_includes} includes in ${n_headers} headers break the "
                      "rule (${rules}):\n  ${listing}")
endif()
message(STATUS "include order: ${n_includes} includes in ${n_headers} headers, none points up (${rules})")
