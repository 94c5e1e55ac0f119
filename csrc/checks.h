// Argument checks shared by the Python bindings of the I/O core (bindings.cpp)
// and the CUDA chain (cuda_chain.cpp). A failed check raises ValueError
// (pybind11) naming the call and the values.
#pragma once

#include <torch/extension.h>

#include <cstddef>
#include <cstdint>
#include <sstream>

#include "io_engine.h"

namespace tiermem {

// Raises ValueError unless `offset` is a non-negative multiple of kAlignBytes
// (NOTE [Alignment] in io_engine.h). `op` names the call in the message.
inline void check_offset(std::int64_t offset, const char* op) {
  if (offset < 0 || offset % static_cast<std::int64_t>(kAlignBytes) != 0) {
    std::ostringstream msg;
    msg << "tiermem: " << op << " offset " << offset << " is not a non-negative multiple of "
        << "ALIGN_BYTES (" << kAlignBytes << ")";
    throw pybind11::value_error(msg.str());
  }
}

// The bytes of a tensor's elements (numel times the element size).
inline std::size_t nbytes_of(const at::Tensor& t) {
  return static_cast<std::size_t>(t.numel()) * t.element_size();
}

}  // namespace tiermem
