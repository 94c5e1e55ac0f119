// Python bindings of the tiermem I/O core (Engine, File, Future) and the
// module init, which in CUDA builds also registers the CUDA chain's classes
// (register_cuda_chain, cuda_bindings.cpp).
//
// Every call that can block (open, wait, resize, size, close) releases the GIL
// (wait only if the request is not done yet: taking the GIL back costs up to
// a switch interval while another thread runs Python). A submitted tensor is
// owned by the request until its last chunk has run (see NOTE [Request
// lifetime] in io_engine.h), so dropping a future without waiting cannot free
// memory the workers still use; the workers hand it back through
// tensor_release.h (NOTE [Dropping tensors off the GIL]) and every call here
// destroys what they handed back. IOError becomes OSError with errno set
// (Python picks the subclass: FileNotFoundError, ...).
#include <torch/extension.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "checks.h"
#include "io_engine.h"
#include "ready_queue.h"
#include "tensor_release.h"
#ifdef TIERMEM_WITH_CUDA
#include "cuda_bindings.h"  // CudaChain, CudaFuture
#endif

namespace py = pybind11;

namespace {

struct Buffer {
  void* data;
  std::size_t nbytes;
  std::shared_ptr<void> owner;
};

// Validates the tensor and offset of a write/read; raises ValueError with the values.
Buffer check_request(const at::Tensor& buf, std::int64_t offset, const char* op) {
  tiermem::check_offset(offset, op);
  if (buf.layout() != at::kStrided || !buf.device().is_cpu()) {
    throw py::value_error(tiermem::cat("tiermem: ", op, " needs a dense CPU tensor, got layout ",
                                       tiermem::str(buf.layout()), " on device ",
                                       buf.device().str()));
  }
  if (!buf.is_contiguous()) {
    throw py::value_error(tiermem::cat("tiermem: ", op, " needs a contiguous tensor, got sizes ",
                                       tiermem::str(buf.sizes()), " and strides ",
                                       tiermem::str(buf.strides()),
                                       " (call .contiguous())"));
  }
  const std::size_t nbytes = tiermem::nbytes_of(buf);
  void* data = nbytes ? buf.data_ptr() : nullptr;
  return {data, nbytes, tiermem::hold(buf)};
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
      .def(
          "wait",
          [](const tiermem::Future& f) {
            tiermem::DrainOnExit drain;  // also when wait() raises
            if (!f.done()) {
              py::gil_scoped_release nogil;
              f.wait();
            } else {
              f.wait();  // raises the request's error, if any
            }
          },
          "Block until the request has completed; raise OSError if it failed.")
      .def(
          "done",
          [](const tiermem::Future& f) {
            const bool done = f.done();
            tiermem::drain_buried();  // after: what a finished request let go of is gone
            return done;
          },
          "True when the request has completed (the engine holds its buffer no more).");

  py::class_<tiermem::File, std::shared_ptr<tiermem::File>>(m, "File")
      .def_property_readonly("path", &tiermem::File::path)
      .def_property_readonly("direct", &tiermem::File::direct)
      .def(
          "write",
          [](tiermem::File& f, const at::Tensor& buf, std::int64_t offset) {
            tiermem::drain_buried();
            Buffer b = check_request(buf, offset, "write");
            return f.write(b.data, b.nbytes, static_cast<std::uint64_t>(offset),
                           std::move(b.owner));
          },
          py::arg("buf"), py::arg("offset"))
      .def(
          "read",
          [](tiermem::File& f, const at::Tensor& buf, std::int64_t offset) {
            tiermem::drain_buried();
            Buffer b = check_request(buf, offset, "read");
            return f.read(b.data, b.nbytes, static_cast<std::uint64_t>(offset),
                          std::move(b.owner));
          },
          py::arg("buf"), py::arg("offset"))
      .def("resize", &tiermem::File::resize, py::arg("size_bytes"),
           py::call_guard<py::gil_scoped_release>())
      .def("size", &tiermem::File::size, py::call_guard<py::gil_scoped_release>())
      .def(
          "close",
          [](tiermem::File& f) {
            {
              py::gil_scoped_release nogil;
              f.close();
            }
            tiermem::drain_buried();
          });

  py::class_<tiermem::Engine, std::shared_ptr<tiermem::Engine>>(m, "Engine")
      .def(py::init<int>(), py::arg("threads"))
      .def_property_readonly("threads", &tiermem::Engine::threads)
      .def_property_readonly("closed", &tiermem::Engine::closed)
      .def("open", &tiermem::Engine::open, py::arg("path"), py::arg("size_bytes") = 0,
           py::call_guard<py::gil_scoped_release>())
      .def(
          "close",
          [](tiermem::Engine& e) {
            {
              py::gil_scoped_release nogil;
              e.close();
            }
            tiermem::drain_buried();
          });
  // The CUDA chain's read queue (NOTE [Reads in completion order] in
  // ready_queue.h) over tickets, so that CPU tests drive the protocol and its
  // hook into engine futures without a GPU.
  using TicketQueue = tiermem::ReadyQueue<std::int64_t>;
  py::class_<TicketQueue, std::shared_ptr<TicketQueue>>(
      m, "_ReadyQueue", "For tests: the CUDA chain's read queue over int tickets.")
      .def(py::init<>())
      .def("add_pending", &TicketQueue::add_pending)
      .def("complete", &TicketQueue::complete, py::arg("ticket"))
      .def(
          "watch",
          [](const std::shared_ptr<TicketQueue>& q, const tiermem::Future& f,
             std::int64_t ticket) {
            if (!q->add_pending()) return false;
            f.on_done([q, ticket] { q->complete(ticket); });  // as read_to_device does
            return true;
          },
          py::arg("future"), py::arg("ticket"),
          "Count `ticket` as pending; it becomes ready when `future` is done. False "
          "once stopped.")
      .def(
          "pop",
          [](TicketQueue& q, double timeout_s) -> py::tuple {
            std::int64_t ticket = -1;
            TicketQueue::Pop r;
            {
              py::gil_scoped_release nogil;
              r = q.pop(ticket, std::chrono::microseconds(
                                    static_cast<std::int64_t>(timeout_s * 1e6)));
            }
            if (r == TicketQueue::Pop::Item) return py::make_tuple("item", ticket);
            return py::make_tuple(r == TicketQueue::Pop::Timeout ? "timeout" : "finished",
                                  py::none());
          },
          py::arg("timeout_s"), "('item', ticket) | ('timeout', None) | ('finished', None)")
      .def("stop", &TicketQueue::stop)
      .def_property_readonly("pending", &TicketQueue::pending);

  m.def("drain_buried", &tiermem::drain_buried,
        "Destroy the tensors engine threads let go of since the last call (see "
        "NOTE [Dropping tensors off the GIL]); every other call does this too.");

#ifdef TIERMEM_WITH_CUDA
  tiermem::register_cuda_chain(m);  // after File: its methods take a File
#endif
}
