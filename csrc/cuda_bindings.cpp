// Python bindings of the CUDA chain (cuda_chain.h): the classes CudaChain and
// CudaFuture, registered into the extension module by bindings.cpp's module
// init (register_cuda_chain, after File). CUDA builds only.
//
// As in bindings.cpp, every call destroys the tensors that the chain's threads
// let go of (drain_buried, NOTE [Dropping tensors off the GIL]), and the calls
// that block (wait, synchronize, stream_wait, close) release the GIL. The
// chain's IOError becomes OSError by bindings.cpp's exception translator.
#include <torch/extension.h>

#include <cstdint>
#include <memory>
#include <mutex>

#include "cuda_bindings.h"
#include "cuda_chain.h"
#include "io_engine.h"
#include "tensor_release.h"

namespace py = pybind11;

namespace tiermem {

void register_cuda_chain(py::module_& m) {
  py::class_<CudaOp, std::shared_ptr<CudaOp>>(
      m, "CudaFuture",
      "A request of CudaChain. Streams are passed as ints (torch.cuda.Stream.cuda_stream).")
      .def(
          "wait",
          [](CudaOp& op) {
            DrainOnExit drain;  // also when it raises
            py::gil_scoped_release nogil;
            op_wait(op);
          },
          "Writes: block until the bytes are on disk. Reads: block until the bytes are "
          "read and the host-to-device copy is issued (not complete). Raise OSError if "
          "the request failed.")
      .def(
          "done",
          [](CudaOp& op) {
            const bool done = op_done(op);
            if (done) op_release_consumed(op);  // reads: the copy is complete
            drain_buried();  // after: what a finished request let go of is gone
            return done;
          },
          "True once everything has completed (reads: the copy too), or failed. Never blocks. "
          "A read lets go of its destination and staging then.")
      .def(
          "issued",
          [](CudaOp& op) {
            std::lock_guard<std::mutex> lk(op.mu);
            return op.issued;
          },
          "Reads: true once the pread is done and the host-to-device copy issued (or the "
          "request failed): stream_wait() then no longer blocks the host. Never blocks.")
      .def(
          "copied",
          [](CudaOp& op) {
            const bool copied = op_copied(op);
            drain_buried();  // the device tensor, let go of once copied
            return copied;
          },
          "Writes: true once the device-to-host copy has landed in staging and the "
          "write is submitted (the device tensor is no longer needed). Never blocks.")
      .def(
          "synchronize",
          [](CudaOp& op) {
            DrainOnExit drain;  // also when it raises
            {
              py::gil_scoped_release nogil;
              op_synchronize(op);
            }
            op_release_consumed(op);  // GIL held: dropped now
          },
          "wait(), then (reads) block until the copy has completed; a read then lets go of "
          "its destination and staging.")
      .def(
          "stream_wait",
          [](CudaOp& op, std::uintptr_t stream) {
            DrainOnExit drain;  // also when it raises
            {
              py::gil_scoped_release nogil;
              op_stream_wait(op, stream);
            }
            op_release_consumed(op);  // GIL held: dropped now
          },
          py::arg("stream"),
          "wait(), then (reads) make `stream` wait for the copy without blocking the host, "
          "and let go of the destination at once (NOTE [CUDA chain lifetime]): its reuse is "
          "ordered after the copy on the stream it was allocated on. Consumed on another "
          "stream, it must be record_stream()-ed there, as torch asks of any tensor.")
      .def_property_readonly("is_write", [](const CudaOp& op) { return op.is_write; });

  py::class_<CudaChain, std::shared_ptr<CudaChain>>(
      m, "CudaChain", "Device <-> pinned staging <-> file requests; see NOTE [CUDA chain].")
      .def(py::init<>())
      .def_property_readonly("closed", &CudaChain::closed)
      .def("write_from_device",
           [](CudaChain& c, const std::shared_ptr<File>& file, std::int64_t offset,
              const at::Tensor& src, const at::Tensor& staging, std::uintptr_t stream,
              std::uintptr_t after) {
             drain_buried();
             return c.write_from_device(file, offset, src, staging, stream, after);
           },
           py::arg("file"),
           py::arg("offset"), py::arg("src"), py::arg("staging"), py::arg("stream"),
           py::arg("after"),
           "Copy `src` (CUDA) to `staging` (pinned) on `stream` after `after`, then write "
           "staging at `offset` of `file`. Returns a CudaFuture at once.")
      .def("read_to_device",
           [](CudaChain& c, const std::shared_ptr<File>& file, std::int64_t offset,
              const at::Tensor& staging, const at::Tensor& dst, std::uintptr_t stream,
              std::uintptr_t after) {
             drain_buried();
             return c.read_to_device(file, offset, staging, dst, stream, after);
           },
           py::arg("file"), py::arg("offset"),
           py::arg("staging"), py::arg("dst"), py::arg("stream"), py::arg("after"),
           "Read `staging`'s bytes at `offset` of `file`, then copy them to `dst` (CUDA) on "
           "`stream` after `after`. Returns a CudaFuture at once.")
      .def("close", [](CudaChain& c) {
        {
          py::gil_scoped_release nogil;
          c.close();
        }
        drain_buried();
      });
}

}  // namespace tiermem
