# The MPI backend for CPU tensors is compiled in when an MPI C library is found (Debian:
# libopenmpi-dev). Only src/comm/mpi_backend.cpp sees mpi.h.
option(DTENSOR_ENABLE_MPI "Build the MPI backend when an MPI library is found" ON)
set(DTENSOR_WITH_MPI OFF)
if(DTENSOR_ENABLE_MPI)
  # The CXX component finds the C library for a C++-only project; no C++ bindings wanted.
  set(MPI_CXX_SKIP_MPICXX ON)
  find_package(MPI COMPONENTS CXX QUIET)
  if(MPI_CXX_FOUND)
    set(DTENSOR_WITH_MPI ON)
    # Just the C library (not Open MPI's deprecated C++ bindings that FindMPI adds).
    set(DTENSOR_MPI_LIBRARIES ${MPI_CXX_LIBRARIES})
    if(MPI_mpi_LIBRARY)
      set(DTENSOR_MPI_LIBRARIES ${MPI_mpi_LIBRARY})
    endif()
    message(STATUS "dtensor: MPI backend on (${MPI_CXX_LIBRARY_VERSION_STRING}); launcher "
                   "${MPIEXEC_EXECUTABLE}")
  else()
    message(STATUS "dtensor: no MPI found (install libopenmpi-dev): CPU tensors use Gloo only")
  endif()
endif()
