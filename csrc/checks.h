// Argument checks shared by the Python bindings of the I/O core (bindings.cpp)
// and the CUDA chain (cuda_chain.cpp). A failed check raises ValueError
// (pybind11) naming the call and the values.
#pragma once

#include <torch/extension.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "io_engine.h"
#include "text.h"

namespace tiermem {

// Raises ValueError unless `offset` is a non-negative multiple of kAlignBytes
// (NOTE [Alignment] in io_engine.h). `op` names the call in the message.
inline void check_offset(std::int64_t offset, const char* op) {
  if (offset < 0 || offset % static_cast<std::int64_t>(kAlignBytes) != 0) {
    throw pybind11::value_error(cat("tiermem: ", op, " offset ", offset,
                                    " is not a non-negative multiple of ALIGN_BYTES (",
                                    kAlignBytes, ")"));
  }
}

// Sizes or strides as "[2, 3]" (NOTE [No iostreams in the engine] in text.h).
inline std::string str(c10::IntArrayRef v) {
  std::string out = "[";
  for (std::size_t i = 0; i < v.size(); ++i) out += cat(i ? ", " : "", v[i]);
  return out + "]";
}

// A layout by its torch name (NOTE [No iostreams in the engine] in text.h).
inline std::string str(c10::Layout l) {
  switch (l) {
    case c10::kStrided: return "Strided";
    case c10::kSparse: return "Sparse";
    case c10::kSparseCsr: return "SparseCsr";
    case c10::kMkldnn: return "Mkldnn";
    default: return cat("layout ", static_cast<int>(l));
  }
}

// The bytes of a tensor's elements (numel times the element size).
inline std::size_t nbytes_of(const at::Tensor& t) {
  return static_cast<std::size_t>(t.numel()) * t.element_size();
}

}  // namespace tiermem
