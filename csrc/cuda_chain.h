// The CUDA chain of the tiermem engine: device <-> pinned staging <-> file,
// with no Python per request (see NOTE [CUDA chain] in cuda_chain.cpp).
// Compiled only into the CUDA build of the extension; its Python classes are
// bound in cuda_bindings.cpp. Needs torch (ATen) and the CUDA runtime; the
// I/O core (io_engine.h) it submits requests to stays free of both.
#pragma once

#include <ATen/core/Tensor.h>
#include <cuda_runtime_api.h>

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "io_engine.h"

namespace tiermem {

// One write_from_device or read_to_device request (Python: CudaFuture). See
// NOTE [CUDA chain].
struct CudaOp {
  bool is_write = false;
  c10::DeviceIndex device = 0;
  std::string path;
  std::uint64_t offset = 0;
  std::size_t nbytes = 0;
  void* host = nullptr;            // staging's bytes
  void* dev = nullptr;             // the device tensor's bytes
  cudaStream_t stream = nullptr;   // the side stream that copies
  cudaEvent_t after = nullptr;     // recorded on `after`; the copy's stream waits on it
  cudaEvent_t copied = nullptr;    // recorded after the copy
  // Owned by the chain's threads once queued (see NOTE [CUDA chain lifetime]).
  std::shared_ptr<File> file;      // writes: until the pwrite is submitted
  at::Tensor device_tensor;
  at::Tensor resolved;             // writes: a non-contiguous/conj/neg source made dense
  at::Tensor staging;

  std::mutex mu;
  std::condition_variable cv;
  bool issued = false;     // write: pwrite submitted; read: H2D copy issued (or failed)
  bool copy_done = false;  // reads: `copied` seen complete
  // Guarded by `mu` for reads (op_release_consumed): device_tensor, resolved,
  // staging, file.
  std::exception_ptr error;
  Future io;               // the pwrite or pread

  CudaOp() = default;
  CudaOp(const CudaOp&) = delete;
  CudaOp& operator=(const CudaOp&) = delete;
  ~CudaOp();  // destroys the events
};

struct ChainState;

// Two threads (out: writes, in: reads) that carry requests from a CUDA event
// or a file read to the next step. See NOTE [CUDA chain]. Streams are passed
// as integers (torch.cuda.Stream.cuda_stream). The requests check their
// arguments and raise ValueError (pybind11) when they are wrong, and IOError
// when the chain is closed or a CUDA call fails.
class CudaChain {
 public:
  CudaChain();
  // Like Engine::~Engine: the threads finish their queues and exit on their
  // own (they may wait for the pool's requests, whose keepalives this file
  // does not control).
  ~CudaChain();
  CudaChain(const CudaChain&) = delete;
  CudaChain& operator=(const CudaChain&) = delete;

  // Runs every queued request to its end (reads: until their copies have
  // completed), then joins the threads. Idempotent.
  void close();
  bool closed() const;

  std::shared_ptr<CudaOp> write_from_device(const std::shared_ptr<File>& file,
                                            std::int64_t offset, const at::Tensor& src,
                                            const at::Tensor& staging, std::uintptr_t stream,
                                            std::uintptr_t after);
  std::shared_ptr<CudaOp> read_to_device(const std::shared_ptr<File>& file, std::int64_t offset,
                                         const at::Tensor& staging, const at::Tensor& dst,
                                         std::uintptr_t stream, std::uintptr_t after);

 private:
  void stop();

  std::shared_ptr<ChainState> state_;
  std::thread out_, in_;
};

// A request's completion, for CudaFuture (cuda_bindings.cpp documents each).
// Blocking ones are called without the GIL.
void op_wait(CudaOp& op);          // until issued; rethrows its error
bool op_done(CudaOp& op);          // never blocks
bool op_copied(CudaOp& op);        // writes: the device tensor is let go of; never blocks
void op_synchronize(CudaOp& op);   // op_wait, then (reads) the copy
void op_stream_wait(CudaOp& op, std::uintptr_t stream);  // op_wait, then (reads) `stream` waits
// Reads ordered before a consumer (after op_stream_wait or op_synchronize, or
// op_done true): lets go of the device tensor (and of staging once the copy
// is seen complete) now. Call with the GIL held. NOTE [CUDA chain lifetime].
void op_release_consumed(CudaOp& op);

}  // namespace tiermem
