// The CUDA chain of the tiermem engine: device <-> pinned staging <-> file,
// with no Python per request. Implements cuda_chain.h. Compiled only into the
// CUDA build of the extension (tiermem/io/cpp.py passes -DTIERMEM_WITH_CUDA and
// adds this file and cuda_bindings.cpp, which binds its classes for Python).
// The I/O core (io_engine.*) stays free of torch and CUDA: this file only
// submits requests to it.
//
// NOTE [CUDA chain]
//   Write (forward, `CudaChain.write_from_device`), all on the calling thread
//   and none of it blocking the host or the compute stream:
//     0. a gapped, conjugate or negative view is made contiguous and resolved
//        by torch on `after` (NOTE [Temporaries on the compute stream] in
//        runtime/copier.py), into `resolved`, which the request holds with `src`;
//     1. event A recorded on `after` (the stream that produced `src`), and
//        `stream` (the D2H side stream) made to wait on A;
//     2. the copy src (or `resolved`) -> staging on `stream` (cudaMemcpyAsync);
//     3. event C recorded on `stream`; the request is queued for the out thread.
//   The out thread takes requests in order (one D2H stream completes its
//   copies in order), sleeps in cudaEventSynchronize(C) (C is a blocking-sync
//   event), lets go of `src` and submits the pwrite of staging to the engine's
//   pool. The future is copied() from then on, and done() when the pwrite
//   is done.
//   Read (backward, `CudaChain.read_to_device`): on the calling thread, event
//   A recorded on `after` (the stream `dst` was allocated on) and the pread
//   into staging submitted to the pool at once. The in thread takes requests
//   in the order their preads finish (NOTE [Reads in completion order] in
//   ready_queue.h), makes `stream` (the H2D side stream) wait on
//   A (the block may be one just freed that queued kernels still read), issues
//   the copy staging -> dst on `stream` and records C. wait() returns once C is
//   recorded; the consumer then orders its stream after the copy with
//   `stream_wait(current_stream)` (cudaStreamWaitEvent: no host block), or the
//   host waits with synchronize(). done() is true once C has completed.
//   C stays inside the engine: Python orders a stream after it with
//   stream_wait() rather than holding a raw cudaEvent_t, whose lifetime would
//   then be Python's to get right. The CUDA work is issued by the chain's own
//   threads, not by the I/O workers, so that io_engine.* knows nothing of CUDA
//   and a worker never sits on a GPU event while reads or writes are queued.
//
// NOTE [CUDA chain lifetime]
//   A request owns its tensors (device tensor and staging) until the host has
//   seen its copy complete: the out thread drops `src` after C, the pwrite's
//   keepalive holds staging until the pwrite is done, and the in thread keeps
//   a read's `dst` and staging until it sees C complete (it polls the copies
//   in flight with cudaEventQuery, every kReapInterval while idle). So
//   Python may drop a future, a source or a destination at any time without
//   record_stream: no block is handed out again while a copy of this chain
//   may still touch it. As in io_engine.h, a thread never holds a lock while
//   dropping a tensor (that may take the GIL).
//   Except a consumed read: once a stream has been made to wait on C
//   (stream_wait) or the host has seen C complete (synchronize, done), the
//   read lets go of `dst` at once, in that binding call, with the GIL held
//   (op_release_consumed), as the Python copier frees a consumed restore (NOTE
//   [Stream lifetime] 2 in runtime/copier.py): `dst` was allocated on `after`, and
//   its consumer's stream is ordered after the copy (on `after` itself, or
//   on another stream that Python record_stream()s it on), so any reuse of
//   its block is ordered after the copy too. Staging stays held until C is
//   seen complete (a host buffer: nothing orders its reuse but the host).
//   Events are created per request and destroyed with it; destroying an event
//   whose work is pending is allowed (CUDA frees it when the work completes).
//
// No CUDA function is called before the first request: importing the module
// and constructing a CudaChain work on a machine without a GPU.
#include <torch/extension.h>

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

#include "checks.h"
#include "cuda_chain.h"
#include "io_engine.h"
#include "ready_queue.h"
#include "tensor_release.h"

namespace py = pybind11;

namespace tiermem {

CudaOp::~CudaOp() {
  // Errors are ignored: at interpreter exit the CUDA runtime may be gone.
  if (after) cudaEventDestroy(after);
  if (copied) cudaEventDestroy(copied);
}

struct OpQueue {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::shared_ptr<CudaOp>> ops;
  bool stopping = false;
};

struct ChainState {
  OpQueue out;                                 // writes, for the out thread
  ReadyQueue<std::shared_ptr<CudaOp>> in;      // reads whose pread is done, for the in thread
  pid_t owner_pid = ::getpid();  // NOTE [Engine after fork] (io_engine.h), applied to the chain
  bool forked() const { return ::getpid() != owner_pid; }
};

namespace {

// How often the in thread looks at the copies in flight while it has nothing
// else to do (they are released when seen complete).
constexpr auto kReapInterval = std::chrono::microseconds(500);

IOError cuda_error(const CudaOp& op, const char* what, const char* call, cudaError_t e) {
  cudaGetLastError();  // clear a non-sticky error so that torch does not report it later
  return IOError(EIO, op.is_write ? "write" : "read", op.path, op.nbytes, op.offset,
                 cat(what, ": CUDA error in ", call, ": ", cudaGetErrorString(e), " (",
                     std::strerror(EIO), ")"));
}

// Lets go of the op's tensors (and file): taken out under op.mu (a consumed
// read's device tensor may be let go of by a binding call at the same time,
// op_release_consumed), dropped with no lock held; on a thread without the
// GIL they are only queued: NOTE [Dropping tensors off the GIL].
void release(CudaOp& op) {
  at::Tensor device_tensor, resolved, staging;
  std::shared_ptr<File> file;
  {
    std::lock_guard<std::mutex> lk(op.mu);
    device_tensor = std::move(op.device_tensor);
    resolved = std::move(op.resolved);
    staging = std::move(op.staging);
    file = std::move(op.file);
  }
  bury(std::move(device_tensor));
  bury(std::move(resolved));
  bury(std::move(staging));
}

void finish(CudaOp& op, Future io, std::exception_ptr error, bool copy_done) {
  Future previous;  // destroyed after the lock is released
  {
    std::lock_guard<std::mutex> lk(op.mu);
    previous = std::move(op.io);
    op.io = std::move(io);
    op.error = std::move(error);
    op.copy_done = copy_done;
    op.issued = true;
  }
  op.cv.notify_all();
}

// Out thread: wait for the D2H copy, then submit the pwrite.
void run_write(CudaOp& op) {
  // This thread's runtime calls belong to the op's device (without it, the
  // first call may create a context on device 0 in every rank).
  cudaSetDevice(op.device);
  const cudaError_t e = cudaEventSynchronize(op.copied);
  Future io;
  std::exception_ptr error;
  if (e != cudaSuccess) {
    error = std::make_exception_ptr(
        cuda_error(op, "the device-to-host copy failed", "cudaEventSynchronize", e));
  } else {
    // The copy has landed: the device memory can go now, before the pwrite.
    // (Writes' tensors are touched by this thread only: no lock.)
    bury(std::move(op.device_tensor));
    bury(std::move(op.resolved));
    try {
      // The request's keepalive holds staging until the pwrite is done.
      // Moved, not copied: a copy made here would take the GIL (tensor_release.h).
      io = op.file->write(op.host, op.nbytes, op.offset, hold(std::move(op.staging)));
    } catch (...) {
      error = std::current_exception();  // IOError: the file or engine is closed
    }
  }
  finish(op, std::move(io), std::move(error), true);
  release(op);
}

// In thread: the pread is done (the ready queue hands out only those); issue
// the H2D copy. True if issued.
bool issue_read(CudaOp& op) {
  std::exception_ptr error;
  try {
    op.io.wait();  // returns at once; raises the pread's error
  } catch (...) {
    error = std::current_exception();
  }
  bool issued = false;
  if (!error) {
    cudaError_t e = cudaSetDevice(op.device);
    const char* call = "cudaSetDevice";
    if (e == cudaSuccess && op.after) {
      e = cudaStreamWaitEvent(op.stream, op.after, 0);
      call = "cudaStreamWaitEvent";
    }
    if (e == cudaSuccess && op.nbytes) {
      e = cudaMemcpyAsync(op.dev, op.host, op.nbytes, cudaMemcpyHostToDevice, op.stream);
      call = "cudaMemcpyAsync";
    }
    if (e == cudaSuccess) {
      e = cudaEventRecord(op.copied, op.stream);
      call = "cudaEventRecord";
      if (e != cudaSuccess && op.nbytes) {
        // The copy is queued but cannot be tracked: wait for it here (error path
        // only) before the buffers may be released.
        cudaStreamSynchronize(op.stream);
      }
    }
    if (e == cudaSuccess) {
      issued = true;
    } else {
      error = std::make_exception_ptr(
          cuda_error(op, "the host-to-device copy could not be issued", call, e));
    }
  }
  finish(op, Future(), std::move(error), !issued);
  return issued;
}

// In thread: true once the read's copy has completed (or failed: either way
// its buffers are no longer used).
bool copy_finished(CudaOp& op) {
  {
    std::lock_guard<std::mutex> lk(op.mu);
    if (op.copy_done) return true;
  }
  const cudaError_t e = cudaEventQuery(op.copied);
  if (e == cudaErrorNotReady) return false;
  if (e != cudaSuccess) cudaGetLastError();
  return true;
}

std::shared_ptr<CudaOp> pop(OpQueue& q) {
  std::unique_lock<std::mutex> lk(q.mu);
  q.cv.wait(lk, [&] { return q.stopping || !q.ops.empty(); });
  if (q.ops.empty()) return nullptr;  // stopping, and nothing left
  std::shared_ptr<CudaOp> op = std::move(q.ops.front());
  q.ops.pop_front();
  return op;
}

void out_main(std::shared_ptr<ChainState> st) {
  while (std::shared_ptr<CudaOp> op = pop(st->out)) run_write(*op);
}

// Releases the buffers of every copy seen complete (several streams may
// complete out of order; no lock is held here).
void reap(std::deque<std::shared_ptr<CudaOp>>& copying) {
  for (auto it = copying.begin(); it != copying.end();) {
    if (!copy_finished(**it)) {
      ++it;
      continue;
    }
    std::shared_ptr<CudaOp> done = std::move(*it);
    it = copying.erase(it);
    {
      std::lock_guard<std::mutex> lk(done->mu);
      done->copy_done = true;
    }
    release(*done);
  }
}

void in_main(std::shared_ptr<ChainState> st) {
  using Pop = ReadyQueue<std::shared_ptr<CudaOp>>::Pop;
  std::deque<std::shared_ptr<CudaOp>> copying;  // H2D copies issued, not seen complete
  bool finished = false;  // stopped, and every read popped
  while (!finished || !copying.empty()) {
    std::shared_ptr<CudaOp> op;
    if (!finished) {
      // Copies in flight: look at them again soon, or at once for a read
      // that is done. (Stopping waits for them: close() returns once every
      // copy is done.)
      const auto timeout = copying.empty() ? std::chrono::microseconds(-1) : kReapInterval;
      finished = st->in.pop(op, timeout) == Pop::Finished;
    } else {
      std::this_thread::sleep_for(kReapInterval);
    }
    if (op) {
      if (issue_read(*op)) {
        copying.push_back(std::move(op));
      } else {
        release(*op);
      }
    }
    reap(copying);
  }
}

// ---------------------------------------------------------------- checks
// (the offset check and nbytes_of are checks.h's, shared with bindings.cpp)

void check_staging(const at::Tensor& t, const char* op) {
  const char* problem = nullptr;
  if (t.layout() != at::kStrided || !t.device().is_cpu()) {
    problem = "not a dense CPU tensor";
  } else if (!t.is_contiguous()) {
    problem = "not contiguous";
  } else if (!t.is_pinned()) {
    problem = "not pinned (a copy from pageable memory would block the host)";
  }
  if (problem) {
    throw py::value_error(cat("tiermem: ", op,
                              " needs a contiguous pinned CPU staging tensor, got one that is ",
                              problem, " (layout ", str(t.layout()), ", device ", t.device().str(),
                              ")"));
  }
}

void check_device(const at::Tensor& t, const char* op, bool contiguous) {
  if (t.layout() != at::kStrided || !t.device().is_cuda() || (contiguous && !t.is_contiguous())) {
    throw py::value_error(cat("tiermem: ", op, " needs a ", contiguous ? "contiguous " : "",
                              "dense CUDA tensor, got layout ", str(t.layout()), " on device ",
                              t.device().str()));
  }
}

cudaEvent_t new_event(const CudaOp& op, unsigned flags) {
  cudaEvent_t ev = nullptr;
  const cudaError_t e = cudaEventCreateWithFlags(&ev, flags);
  if (e != cudaSuccess) throw cuda_error(op, "no event", "cudaEventCreateWithFlags", e);
  return ev;
}

cudaStream_t as_stream(std::uintptr_t s) { return reinterpret_cast<cudaStream_t>(s); }

// ---------------------------------------------------------------- request setup
// Shared by write_from_device and read_to_device, in this order: new_op,
// a check that the chain is open (lock_open for writes, add_pending for
// reads), then (on the op's device) new_events.

// A request's fields common to both directions. `device_tensor` is a write's
// source or a read's destination; the caller sets the rest (a write's file, a
// read's device pointer).
std::shared_ptr<CudaOp> new_op(bool is_write, const std::shared_ptr<File>& file,
                               std::int64_t offset, std::size_t nbytes,
                               const at::Tensor& device_tensor, const at::Tensor& staging,
                               std::uintptr_t stream) {
  auto op = std::make_shared<CudaOp>();
  op->is_write = is_write;
  op->device = device_tensor.device().index();
  op->path = file->path();
  op->offset = static_cast<std::uint64_t>(offset);
  op->nbytes = nbytes;
  op->host = nbytes ? staging.data_ptr() : nullptr;
  op->stream = as_stream(stream);
  op->device_tensor = device_tensor;
  op->staging = staging;
  return op;
}

// Locks the queue that `op` goes to (its thread only pops under the lock);
// raises IOError (EBADF) if the chain is closed.
std::unique_lock<std::mutex> lock_open(OpQueue& q, const CudaOp& op) {
  std::unique_lock<std::mutex> lk(q.mu);
  if (q.stopping) {
    throw IOError(EBADF, op.is_write ? "write" : "read", op.path, op.nbytes, op.offset,
                  "the CUDA chain is closed");
  }
  return lk;
}

// Creates the op's events on the current device: `copied`, and, unless
// `after` is the copy's own stream, `after` recorded on it now. A write's
// stream waits on it at once (its copy is issued next, on this thread); a
// read's stream waits on it in the in thread, once the pread is done
// (issue_read). See NOTE [CUDA chain].
void new_events(CudaOp& op, std::uintptr_t after) {
  op.copied = new_event(op, cudaEventDisableTiming | cudaEventBlockingSync);
  if (as_stream(after) == op.stream) return;
  op.after = new_event(op, cudaEventDisableTiming);
  const char* call = "cudaEventRecord";
  cudaError_t e = cudaEventRecord(op.after, as_stream(after));
  if (e == cudaSuccess && op.is_write) {
    call = "cudaStreamWaitEvent";
    e = cudaStreamWaitEvent(op.stream, op.after, 0);
  }
  if (e != cudaSuccess) {
    throw cuda_error(op,
                     op.is_write ? "the copy could not wait for its source"
                                 : "the copy could not wait for its destination",
                     call, e);
  }
}

// A chain used in a forked child: its threads do not exist there, so a
// request would never run (NOTE [Engine after fork]). Raises IOError(EBADF).
void check_not_forked(const ChainState& state, const char* op,
                      const std::shared_ptr<File>& file, std::int64_t offset,
                      std::size_t nbytes) {
  if (!state.forked()) return;
  throw IOError(EBADF, op, file ? file->path() : std::string(), nbytes,
                static_cast<std::uint64_t>(offset < 0 ? 0 : offset),
                cat("the CUDA chain was made by process ", state.owner_pid,
                    " and this is a forked child (", ::getpid(),
                    ") in which its threads do not exist; make a new chain here"));
}

}  // namespace

// ---------------------------------------------------------------- CudaChain

CudaChain::CudaChain() : state_(std::make_shared<ChainState>()) {
  out_ = std::thread(out_main, state_);
  in_ = std::thread(in_main, state_);
}

CudaChain::~CudaChain() {
  if (state_->forked()) {
    // NOTE [Engine after fork]: the threads are the parent's and a lock may
    // have been held at the fork: leak the handles and the state untouched.
    new std::thread(std::move(out_));
    new std::thread(std::move(in_));
    new std::shared_ptr<ChainState>(std::move(state_));
    return;
  }
  stop();
  if (out_.joinable()) out_.detach();
  if (in_.joinable()) in_.detach();
}

void CudaChain::close() {
  if (state_->forked()) return;  // nothing of it runs here: NOTE [Engine after fork]
  stop();
  if (out_.joinable()) out_.join();
  if (in_.joinable()) in_.join();
}

bool CudaChain::closed() const {
  if (state_->forked()) return true;  // NOTE [Engine after fork]
  std::lock_guard<std::mutex> lk(state_->out.mu);
  return state_->out.stopping;
}

void CudaChain::stop() {
  {
    std::lock_guard<std::mutex> lk(state_->out.mu);
    state_->out.stopping = true;
  }
  state_->out.cv.notify_all();
  state_->in.stop();
}

std::shared_ptr<CudaOp> CudaChain::write_from_device(const std::shared_ptr<File>& file,
                                                     std::int64_t offset, const at::Tensor& src,
                                                     const at::Tensor& staging,
                                                     std::uintptr_t stream, std::uintptr_t after) {
  const char* name = "write_from_device";
  check_not_forked(*state_, "write", file, offset, nbytes_of(src));
  check_offset(offset, name);
  check_device(src, name, false);
  check_staging(staging, name);
  const std::size_t nbytes = nbytes_of(src);
  // Raw bytes can be copied as they are; a gapped view, or a lazy conjugate
  // or negative view (a bit on the tensor, not in memory), goes through
  // torch's copy_, which gathers and resolves it into a staging tensor of
  // the same sizes and dtype.
  const bool raw = src.is_contiguous() && !src.is_conj() && !src.is_neg();
  if (nbytes_of(staging) != nbytes ||
      (!raw && (staging.sizes() != src.sizes() || staging.scalar_type() != src.scalar_type()))) {
    throw py::value_error(cat(
        "tiermem: ", name, " needs a staging tensor of the source's bytes (and, for a ",
        "non-contiguous, conjugate or negative view, its sizes and dtype), got ",
        nbytes_of(staging), " bytes ", str(staging.sizes()), " ",
        c10::toString(staging.scalar_type()), " for ", nbytes, " bytes ", str(src.sizes()), " ",
        c10::toString(src.scalar_type())));
  }
  std::shared_ptr<CudaOp> op = new_op(true, file, offset, nbytes, src, staging, stream);
  op->file = file;

  // NOTE [No lock around torch calls]
  // `out.mu` is held only to check that the chain is open and to push the request, never across the copies: the
  // copy_ below may call into Python (a dispatch mode), which may hand the GIL
  // to a thread that then waits on `out.mu` while holding the GIL: a hang.
  // Two callers may then push in another order than they issued their copies:
  // the out thread waits on each request's own event, so order only affects
  // how soon a write starts, never what it writes.
  lock_open(state_->out, *op).unlock();
  c10::cuda::CUDAGuard guard(op->device);
  if (nbytes && !raw) {
    // Made by torch on `after`, before A is recorded there: its block comes
    // from (and goes back to) the compute stream's pool, not the side
    // stream's (NOTE [Temporaries on the compute stream] in runtime/copier.py).
    // Conjugate/negative views are resolved on the device: torch's D2H
    // copy_ of such a view applies the conj/neg on the host right after
    // queueing the copy, before the bytes land (pytorch#146286).
    c10::cuda::CUDAStreamGuard sguard(
        c10::cuda::getStreamFromExternal(as_stream(after), op->device));
    op->resolved = src.resolve_conj().resolve_neg().contiguous();
  }
  new_events(*op, after);
  if (nbytes) {
    const void* from = raw ? src.data_ptr() : op->resolved.data_ptr();
    const cudaError_t e = cudaMemcpyAsync(op->host, from, nbytes, cudaMemcpyDeviceToHost,
                                          op->stream);
    if (e != cudaSuccess) {
      throw cuda_error(*op, "the device-to-host copy could not be issued", "cudaMemcpyAsync", e);
    }
  }
  const cudaError_t e = cudaEventRecord(op->copied, op->stream);
  if (e != cudaSuccess) {
    if (nbytes) cudaStreamSynchronize(op->stream);  // error path: see issue_read
    throw cuda_error(*op, "the device-to-host copy could not be tracked", "cudaEventRecord", e);
  }
  {
    std::unique_lock<std::mutex> lk(state_->out.mu);
    if (state_->out.stopping) {
      // Closed while the copy was issued: nothing will wait for it but us.
      lk.unlock();
      if (nbytes) cudaEventSynchronize(op->copied);
      lock_open(state_->out, *op);  // throws: the chain is closed
    }
    state_->out.ops.push_back(op);
  }
  state_->out.cv.notify_one();
  return op;
}

std::shared_ptr<CudaOp> CudaChain::read_to_device(const std::shared_ptr<File>& file,
                                                  std::int64_t offset, const at::Tensor& staging,
                                                  const at::Tensor& dst, std::uintptr_t stream,
                                                  std::uintptr_t after) {
  const char* name = "read_to_device";
  check_not_forked(*state_, "read", file, offset, nbytes_of(dst));
  check_offset(offset, name);
  check_staging(staging, name);
  check_device(dst, name, true);
  const std::size_t nbytes = nbytes_of(dst);
  if (nbytes_of(staging) != nbytes) {
    throw py::value_error(cat("tiermem: ", name,
                              " needs a staging tensor of the destination's bytes, got ",
                              nbytes_of(staging), " bytes for ", nbytes));
  }
  std::shared_ptr<CudaOp> op = new_op(false, file, offset, nbytes, dst, staging, stream);
  op->dev = nbytes ? dst.data_ptr() : nullptr;

  // Counted before its pread can finish, so that the in thread does not end
  // while the read is on the disk; no lock held while submitting (a pread of
  // 0 bytes finishes, and hands itself to the queue, inside submit).
  if (!state_->in.add_pending()) {
    throw IOError(EBADF, "read", op->path, op->nbytes, op->offset, "the CUDA chain is closed");
  }
  try {
    c10::cuda::CUDAGuard guard(op->device);
    new_events(*op, after);
    // Submitted now, so that the disk works at once. Throws IOError if the
    // file or the engine is closed.
    op->io = file->read(op->host, nbytes, op->offset, hold(staging));
  } catch (...) {
    state_->in.cancel_pending();
    throw;
  }
  // To the in thread once the pread is done: NOTE [Reads in completion order]
  // in ready_queue.h. The callback owns the op until it runs (a cycle through
  // op->io that ends then: every submitted request runs, Engine::close too).
  std::weak_ptr<ChainState> st = state_;
  op->io.on_done([st, op] {
    if (std::shared_ptr<ChainState> s = st.lock()) s->in.complete(op);
  });
  return op;
}

// ---------------------------------------------------------------- CudaFuture

void op_wait(CudaOp& op) {
  Future io;
  {
    std::unique_lock<std::mutex> lk(op.mu);
    op.cv.wait(lk, [&] { return op.issued; });
    if (op.error) std::rethrow_exception(op.error);
    io = op.io;
  }
  io.wait();  // writes: the pwrite (reads: already waited for by the in thread)
}

bool op_done(CudaOp& op) {
  Future io;
  {
    std::lock_guard<std::mutex> lk(op.mu);
    if (!op.issued) return false;
    if (op.error) return true;
    if (!op.is_write) {
      if (op.copy_done) return true;
      const cudaError_t e = cudaEventQuery(op.copied);
      if (e == cudaErrorNotReady) return false;
      if (e != cudaSuccess) {
        op.error = std::make_exception_ptr(
            cuda_error(op, "the host-to-device copy failed", "cudaEventQuery", e));
      }
      op.copy_done = true;
      return true;
    }
    io = op.io;
  }
  return io.done();  // writes: the pwrite
}

void op_synchronize(CudaOp& op) {
  op_wait(op);
  if (op.is_write) return;
  const cudaError_t e = cudaEventSynchronize(op.copied);
  if (e != cudaSuccess) {
    throw cuda_error(op, "the host-to-device copy failed", "cudaEventSynchronize", e);
  }
}

void op_release_consumed(CudaOp& op) {
  if (op.is_write) return;
  at::Tensor device_tensor, staging;
  {
    std::lock_guard<std::mutex> lk(op.mu);
    if (!op.issued || op.error) return;  // not ordered after a copy: the chain keeps it
    device_tensor = std::move(op.device_tensor);
    if (op.copy_done) staging = std::move(op.staging);
  }
  // Dropped here, no lock held (the caller holds the GIL: at once).
}

void op_stream_wait(CudaOp& op, std::uintptr_t stream) {
  op_wait(op);
  if (op.is_write) return;
  c10::cuda::CUDAGuard guard(op.device);
  const cudaError_t e = cudaStreamWaitEvent(as_stream(stream), op.copied, 0);
  if (e != cudaSuccess) {
    throw cuda_error(op, "the consumer could not wait for the copy", "cudaStreamWaitEvent", e);
  }
}

bool op_copied(CudaOp& op) {
  std::lock_guard<std::mutex> lk(op.mu);
  return op.is_write && op.issued && !op.error;
}

}  // namespace tiermem
