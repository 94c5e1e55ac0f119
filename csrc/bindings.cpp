// Python bindings of the tiermem I/O core. With cuda_chain.cpp (CUDA builds
// only), the only files that include torch.
//
// Every call that can block (open, wait, resize, size, close) releases the GIL.
// A submitted tensor is owned by the request until its last chunk has run
// (see NOTE [Request lifetime] in io_engine.h), so dropping a future without
// waiting cannot free memory the workers still use. IOError becomes OSError
// with errno set (Python picks the subclass: FileNotFoundError, ...).
#include <torch/extension.h>

#include <cstdint>
#include <memory>
#include <sstream>
#include <string>

#include "io_engine.h"

namespace py = pybind11;

#ifdef TIERMEM_WITH_CUDA
namespace tiermem {
// csrc/cuda_chain.cpp: the classes CudaChain and CudaFuture.
void register_cuda_chain(py::module_& m);
}  // namespace tiermem
#endif

namespace {

struct Buffer {
  void* data;
  std::size_t nbytes;
  std::shared_ptr<void> owner;
};

// Validates the tensor and offset of a write/read; raises ValueError with the values.
Buffer check_request(const at::Tensor& buf, std::int64_t offset, const char* op) {
  if (offset < 0 || offset % static_cast<std::int64_t>(tiermem::kAlignBytes) != 0) {
    std::ostringstream msg;
    msg << "tiermem: " << op << " offset " << offset << " is not a non-negative multiple of "
        << "ALIGN_BYTES (" << tiermem::kAlignBytes << ")";
    throw py::value_error(msg.str());
  }
  if (buf.layout() != at::kStrided || !buf.device().is_cpu()) {
    std::ostringstream msg;
    msg << "tiermem: " << op << " needs a dense CPU tensor, got layout " << buf.layout()
        << " on device " << buf.device();
    throw py::value_error(msg.str());
  }
  if (!buf.is_contiguous()) {
    std::ostringstream msg;
    msg << "tiermem: " << op << " needs a contiguous tensor, got sizes " << buf.sizes()
        << " and strides " << buf.strides() << " (call .contiguous())";
    throw py::value_error(msg.str());
  }
  const std::size_t nbytes = static_cast<std::size_t>(buf.numel()) * buf.element_size();
  void* data = nbytes ? buf.data_ptr() : nullptr;
  return {data, nbytes, std::make_shared<at::Tensor>(buf)};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "tiermem C++ I/O engine (thread pool, O_DIRECT pread/pwrite, futures)";
  m.attr("ALIGN_BYTES") = tiermem::kAlignBytes;
#ifdef TIERMEM_WITH_CUDA
  // The engine moves CUDA tensors itself (CudaChain); see NOTE [CUDA chain].
  m.attr("WITH_CUDA") = true;
#else
  m.attr("WITH_CUDA") = false;
#endif

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const tiermem::IOError& e) {
      PyObject* args = Py_BuildValue("(is)", e.err(), e.what());
      if (args) {
        PyErr_SetObject(PyExc_OSError, args);
        Py_DECREF(args);
      }
    }
  });

  py::class_<tiermem::Future>(m, "Future")
      .def("wait", &tiermem::Future::wait, py::call_guard<py::gil_scoped_release>(),
           "Block until the request has completed; raise OSError if it failed.")
      .def("done", &tiermem::Future::done, "True when the request has completed.");

  py::class_<tiermem::File, std::shared_ptr<tiermem::File>>(m, "File")
      .def_property_readonly("path", &tiermem::File::path)
      .def_property_readonly("direct", &tiermem::File::direct)
      .def(
          "write",
          [](tiermem::File& f, const at::Tensor& buf, std::int64_t offset) {
            Buffer b = check_request(buf, offset, "write");
            return f.write(b.data, b.nbytes, static_cast<std::uint64_t>(offset),
                           std::move(b.owner));
          },
          py::arg("buf"), py::arg("offset"))
      .def(
          "read",
          [](tiermem::File& f, const at::Tensor& buf, std::int64_t offset) {
            Buffer b = check_request(buf, offset, "read");
            return f.read(b.data, b.nbytes, static_cast<std::uint64_t>(offset),
                          std::move(b.owner));
          },
          py::arg("buf"), py::arg("offset"))
      .def("resize", &tiermem::File::resize, py::arg("size_bytes"),
           py::call_guard<py::gil_scoped_release>())
      .def("size", &tiermem::File::size, py::call_guard<py::gil_scoped_release>())
      .def("close", &tiermem::File::close, py::call_guard<py::gil_scoped_release>());

  py::class_<tiermem::Engine, std::shared_ptr<tiermem::Engine>>(m, "Engine")
      .def(py::init<int>(), py::arg("threads"))
      .def_property_readonly("threads", &tiermem::Engine::threads)
      .def_property_readonly("closed", &tiermem::Engine::closed)
      .def("open", &tiermem::Engine::open, py::arg("path"), py::arg("size_bytes") = 0,
           py::call_guard<py::gil_scoped_release>())
      .def("close", &tiermem::Engine::close, py::call_guard<py::gil_scoped_release>());

#ifdef TIERMEM_WITH_CUDA
  tiermem::register_cuda_chain(m);  // after File: its methods take a File
#endif
}
