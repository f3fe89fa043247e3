# c10d's ProcessGroupGloo.hpp includes gloo's headers, which LibTorch wheels do not ship.
# Prefer headers inside the LibTorch distribution; fall back to the system's (Debian
# libgloo-dev). Only src/comm/gloo_backend.cpp sees them, and only pointers to gloo types
# cross that translation unit, so a header version older than LibTorch's gloo is fine as
# long as it compiles (the newer store API is behind GLOO_STORE_HAS_STORE_V2).
find_path(DTENSOR_GLOO_INCLUDE_DIR gloo/config.h
  HINTS "${TORCH_INSTALL_PREFIX}/include" NO_DEFAULT_PATH)
if(NOT DTENSOR_GLOO_INCLUDE_DIR)
  find_path(DTENSOR_GLOO_INCLUDE_DIR gloo/config.h)
endif()
if(NOT DTENSOR_GLOO_INCLUDE_DIR)
  message(FATAL_ERROR "gloo headers not found: install libgloo-dev (scripts/setup does) "
                      "or set DTENSOR_GLOO_INCLUDE_DIR")
endif()
message(STATUS "dtensor: gloo headers in ${DTENSOR_GLOO_INCLUDE_DIR}")
