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
  # NcclHeaders.cmake compiles the NCCL backend in only for a CUDA LibTorch.
  if(TARGET torch_cuda OR TORCH_CUDA_LIBRARIES)
    set(DTENSOR_TORCH_HAS_CUDA ON)
  else()
    set(DTENSOR_TORCH_HAS_CUDA OFF)
  endif()
  # The 2.11 wheels' libtorch.so exports std::filesystem functions from the libstdc++ it was
  # built with, which call libstdc++ internals (weak symbols) that this toolchain's libstdc++
  # lacks. Listed before libstdc++ among a program's libraries, it takes our calls:
  # std::filesystem::remove_all jumped to address 0. With libstdc++ first, the dynamic linker
  # binds every caller (LibTorch's too) to libstdc++'s own. Other versions need nothing.
  find_library(_dtensor_libtorch torch PATHS "${TORCH_INSTALL_PREFIX}/lib" NO_DEFAULT_PATH)
  if(_dtensor_libtorch AND CMAKE_NM)
    execute_process(COMMAND "${CMAKE_NM}" -D "${_dtensor_libtorch}"
                    OUTPUT_VARIABLE _dtensor_torch_symbols ERROR_QUIET)
    if(_dtensor_torch_symbols MATCHES " w _ZNSt10filesystem")
      add_link_options("SHELL:-Wl,--push-state,--no-as-needed -lstdc++ -Wl,--pop-state")
      message(STATUS "dtensor: ${_dtensor_libtorch} carries its own std::filesystem; "
                     "libstdc++ is linked first so that programs use libstdc++'s")
    endif()
    unset(_dtensor_torch_symbols)
  endif()
endmacro()
