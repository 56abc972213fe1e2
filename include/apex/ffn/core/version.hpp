#pragma once
/// \file core/version.hpp
/// The library's version, written only here: CMake reads it for the package
/// version, so `find_package(apex_ffn 0.1)` and this header always agree.
#define APEX_FFN_VERSION_MAJOR 0
#define APEX_FFN_VERSION_MINOR 1
#define APEX_FFN_VERSION_PATCH 0

/// The version as one comparable number: major·10000 + minor·100 + patch.
#define APEX_FFN_VERSION (APEX_FFN_VERSION_MAJOR * 10000 + APEX_FFN_VERSION_MINOR * 100 + APEX_FFN_VERSION_PATCH)
