# NCCL is compiled in when LibTorch has CUDA. nccl.h comes from the CUDA toolkit or from the
# nvidia-nccl wheel that CUDA builds of torch depend on.
set(DTENSOR_WITH_NCCL OFF)
if(DTENSOR_TORCH_HAS_CUDA)
  find_package(Python3 COMPONENTS Interpreter QUIET)
  set(_nccl_hints "${TORCH_INSTALL_PREFIX}/include")
  if(Python3_FOUND)
    execute_process(
      COMMAND "${Python3_EXECUTABLE}" -c
              "import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], 'include'))"
      OUTPUT_VARIABLE _nccl_wheel_inc OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
    list(APPEND _nccl_hints "${_nccl_wheel_inc}")
  endif()
  find_path(DTENSOR_NCCL_INCLUDE_DIR nccl.h HINTS ${_nccl_hints} ${CUDAToolkit_INCLUDE_DIRS}
            /usr/local/cuda/include)
  # ProcessGroupNCCL.hpp pulls in ATen's CUDA context, which needs the cuSPARSE/cuBLAS
  # headers: a compiler-only toolkit lacks them, the torch wheel's nvidia packages have them.
  set(_cuda_lib_hints ${CUDAToolkit_INCLUDE_DIRS} /usr/local/cuda/include)
  if(Python3_FOUND)
    execute_process(
      COMMAND "${Python3_EXECUTABLE}" -c
              "import nvidia, os, glob; print(';'.join(d for p in nvidia.__path__ for d in glob.glob(os.path.join(p, '*', 'include'))))"
      OUTPUT_VARIABLE _wheel_cuda_incs OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
    list(APPEND _cuda_lib_hints ${_wheel_cuda_incs})
  endif()
  find_path(DTENSOR_CUSPARSE_INCLUDE_DIR cusparse.h HINTS ${_cuda_lib_hints})
  set(DTENSOR_NCCL_INCLUDE_DIRS ${DTENSOR_NCCL_INCLUDE_DIR})
  if(DTENSOR_CUSPARSE_INCLUDE_DIR)
    list(APPEND DTENSOR_NCCL_INCLUDE_DIRS ${DTENSOR_CUSPARSE_INCLUDE_DIR})
  endif()
  if(DTENSOR_NCCL_INCLUDE_DIR AND NOT DTENSOR_CUSPARSE_INCLUDE_DIR)
    message(WARNING "LibTorch has CUDA but cusparse.h (CUDA toolkit libraries) was not found: "
                    "the NCCL backend cannot compile. Set DTENSOR_CUSPARSE_INCLUDE_DIR.")
  elseif(DTENSOR_NCCL_INCLUDE_DIR)
    set(DTENSOR_WITH_NCCL ON)
    message(STATUS "dtensor: NCCL headers in ${DTENSOR_NCCL_INCLUDE_DIRS}")
  else()
    message(WARNING "LibTorch has CUDA but nccl.h was not found: CUDA tensors will have no "
                    "process group. Set DTENSOR_NCCL_INCLUDE_DIR.")
  endif()
endif()
