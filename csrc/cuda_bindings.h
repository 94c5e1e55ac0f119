// The Python classes of the CUDA chain (CudaChain, CudaFuture), registered
// into the extension module by bindings.cpp's module init. CUDA builds only
// (TIERMEM_WITH_CUDA); implemented in cuda_bindings.cpp.
#pragma once

#include <torch/extension.h>

namespace tiermem {

// Binds CudaFuture and CudaChain into `m`. Call after File is bound: the
// chain's methods take a File.
void register_cuda_chain(pybind11::module_& m);

}  // namespace tiermem
