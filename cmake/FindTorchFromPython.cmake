# Finds LibTorch: an explicit Torch_DIR / CMAKE_PREFIX_PATH wins (a LibTorch zip, a CUDA
# build); otherwise ask the Python interpreter for the installed wheel's CMake prefix.
macro(dtensor_find_torch)
  find_package(Torch QUIET)
  if(NOT Torch_FOUND)
    find_package(Python3 COMPONENTS Interpreter REQUIRED)
    execute_process(
      COMMAND "${Python3_EXECUTABLE}" -c "import torch.utils; print(torch.utils.cmake_prefix_path)"
      OUTPUT_VARIABLE _dtensor_torch_prefix OUTPUT_STRIP_TRAILING_WHITESPACE
      RESULT_VARIABLE _dtensor_torch_rc)
    if(NOT _dtensor_torch_rc EQUAL 0)
      message(FATAL_ERROR "LibTorch not found: set Torch_DIR, or install the wheel "
                          "(scripts/setup does: pip install torch==2.13.0)")
    endif()
    list(APPEND CMAKE_PREFIX_PATH "${_dtensor_torch_prefix}")
    find_package(Torch REQUIRED)
  endif()
  # TORCH_INSTALL_PREFIX is set by TorchConfig.cmake.
  message(STATUS "dtensor: LibTorch ${Torch_VERSION} at ${TORCH_INSTALL_PREFIX}")
  if(TARGET torch_cuda OR TORCH_CUDA_LIBRARIES)
    set(DTENSOR_TORCH_HAS_CUDA ON)
  else()
    set(DTENSOR_TORCH_HAS_CUDA OFF)
  endif()
endmacro()
