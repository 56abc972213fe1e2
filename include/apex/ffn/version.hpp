#pragma once
/// \file version.hpp
#define APEX_FFN_VERSION_MAJOR 0
#define APEX_FFN_VERSION_MINOR 1
#define APEX_FFN_VERSION_PATCH 0
