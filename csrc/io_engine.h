// tiermem I/O core: a worker pool doing positional pread/pwrite (O_DIRECT when
// the filesystem allows it) on behalf of non-blocking requests that return
// futures. No torch and no Python here (csrc/tests/stress_io.cpp builds it
// alone). Tensors and the GIL live in the files above it:
//
//   file                    owns                                  uses
//   bindings.cpp            the module init; Engine, File,        checks.h, tensor_release.h,
//                           Future; IOError -> OSError;           io_engine.h, ready_queue.h,
//                           _ReadyQueue (tests)                   cuda_bindings.h*
//   cuda_bindings.{h,cpp}*  Python classes CudaChain, CudaFuture  cuda_chain.h, tensor_release.h,
//                                                                 io_engine.h
//   cuda_chain.{h,cpp}*     the CUDA chain (NOTE [CUDA chain])    checks.h, tensor_release.h,
//                                                                 io_engine.h, ready_queue.h
//   checks.h                the offset check, nbytes_of           io_engine.h
//   ready_queue.h           reads in completion order (NOTE       -
//                           [Reads in completion order])
//   tensor_release.{h,cpp}  bury, hold, drain_buried (NOTE        -
//                           [Dropping tensors off the GIL])
//   io_engine.{h,cpp}       this I/O core                         -
//   (* CUDA builds only: tiermem/io/cpp.py, NOTE [CUDA build of the engine])
//
// Each file uses (includes, or calls into) only files listed below it, so
// there is no cycle:
//
//   bindings.cpp --(CUDA builds)--> cuda_bindings --> cuda_chain
//        |                               |                |
//        +-------------------------------+----------------+
//        |  each of these three uses some of
//        v
//   checks.h --> io_engine           tensor_release     ready_queue
//
// Outside the core: tensor_release needs ATen and the Python C API; checks.h
// and the bindings torch and pybind11; cuda_chain torch (pybind11 too, for
// its ValueErrors) and the CUDA runtime.
//
// NOTE [Request lifetime]
//   A request (one write or read call) is split into chunks of at least
//   kMinChunkBytes, each aligned to kAlignBytes, that run on any worker in any
//   order. Every chunk holds a shared_ptr to the request, which holds
//   - the FileState (so the fd stays open until its last chunk has run, even
//     if File::close() was called or the File was dropped), and
//   - the FutureState, whose `keepalive` owns the caller's buffer (bindings.cpp
//     and cuda_chain.cpp put the tensor there with tensor_release.h's hold()),
//     so the memory cannot be freed while a worker still touches it, even if
//     the caller drops the future without waiting.
//   The worker that runs a request's last chunk lets go of `keepalive` first,
//   then marks the request finished and wakes waiters: once done() is true the
//   engine no longer holds the caller's buffer (callers count on it to know
//   when memory is given back). No lock is held while a reference is dropped:
//   dropping a tensor may need the Python GIL; tensor_release.h's owners
//   (hold()) defer that to a Python thread (NOTE [Dropping tensors off the GIL]).
//
// NOTE [Alignment]
//   Offsets must be multiples of kAlignBytes (checked at submit). Lengths and
//   buffer addresses may be anything. On a direct (O_DIRECT) file a chunk's
//   whole 4096-byte blocks go straight between the caller's buffer and the
//   disk when the buffer address is 4096-aligned, and through the worker's
//   aligned bounce buffer otherwise; the partial last block of a request always
//   goes through the bounce buffer. A write whose length is not a multiple of
//   kAlignBytes writes the rest of its last block as zeros, on direct and
//   buffered files alike, so callers reserve extents rounded up to kAlignBytes.
//
// NOTE [Engine after fork]
//   fork() copies an engine's memory into the child but none of its threads:
//   joining them there crashed (SIGSEGV), and a request queued there never
//   ran (a wait hung). An engine remembers the process that made it; in any
//   other process (a forked child) open() and every File's write(), read()
//   throw IOError(EBADF) saying so, closed() is true, close() and
//   File::close() do nothing (the fds are closed when the last owner goes),
//   and ~Engine leaks the thread handles and the pool instead of touching
//   them (a lock may have been held by a worker at the fork). Python drops
//   its engines in a child (NOTE [Fork] in tiermem/offloader.py); this guards
//   an engine used there anyway. The CUDA chain (cuda_chain.cpp) follows the
//   same rules: in a child its requests throw IOError(EBADF), closed() is true,
//   close() does nothing and ~CudaChain leaks its threads and state.
#pragma once

#include <sys/types.h>

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace tiermem {

constexpr std::size_t kAlignBytes = 4096;
// Requests are split in chunks of at least this size (except a smaller request).
constexpr std::size_t kMinChunkBytes = std::size_t(1) << 20;
// ... and at most this size, so that one large request still spreads evenly.
constexpr std::size_t kMaxChunkBytes = std::size_t(8) << 20;
// Per-worker aligned staging buffer for unaligned buffers and partial blocks.
constexpr std::size_t kBounceBytes = std::size_t(4) << 20;

// A failed I/O call. what() is the full message:
//   "tiermem: <op> of <n> bytes at offset <off> in <path> failed: <reason>"
// where <reason> is strerror(err) unless a detail is given.
class IOError : public std::runtime_error {
 public:
  IOError(int err, const std::string& op, const std::string& path, std::uint64_t nbytes,
          std::uint64_t offset, const std::string& detail = "");
  int err() const noexcept { return err_; }
  const std::string& op() const noexcept { return op_; }
  const std::string& path() const noexcept { return path_; }
  std::uint64_t offset() const noexcept { return offset_; }

 private:
  int err_;
  std::string op_;
  std::string path_;
  std::uint64_t offset_;
};

// Shared state of one request's completion. See NOTE [Request lifetime].
struct FutureState {
  std::mutex mu;
  std::condition_variable cv;
  std::size_t chunks_left = 0;          // chunks not yet run
  bool finished = false;                // every chunk ran and keepalive is let go
  bool failed = false;
  int err = 0;
  std::string detail;                   // of the first failure ("" = strerror(err))
  std::string op, path;
  std::uint64_t nbytes = 0, offset = 0;
  std::shared_ptr<void> keepalive;      // the caller's buffer owner (opaque here)
  std::function<void()> on_done;        // Future::on_done's, run once after finished
};

// Handle on a request. wait() blocks until every chunk has run and throws the
// first failure as IOError; done() never blocks.
class Future {
 public:
  Future() = default;
  explicit Future(std::shared_ptr<FutureState> state) : state_(std::move(state)) {}
  void wait() const;
  bool done() const;
  // Runs `fn` once the request is finished (done() true, keepalive let go):
  // on the worker that finished it, with no lock held, or here at once if it
  // already is. One callback per request (a second replaces the first). `fn`
  // must not block, and must not own this request's Future (a cycle until it
  // runs). Used by the CUDA chain to take reads in completion order (NOTE
  // [Reads in completion order] in ready_queue.h).
  void on_done(std::function<void()> fn) const;

 private:
  std::shared_ptr<FutureState> state_;
};

struct FileState;
struct Pool;

class File {
 public:
  File(std::shared_ptr<Pool> pool, std::shared_ptr<FileState> state);
  ~File();
  File(const File&) = delete;
  File& operator=(const File&) = delete;

  // Non-blocking. `buf` must stay valid until the future is done: pass its
  // owner as `keepalive`. `offset` must be a multiple of kAlignBytes.
  Future write(const void* buf, std::size_t nbytes, std::uint64_t offset,
               std::shared_ptr<void> keepalive = nullptr);
  Future read(void* buf, std::size_t nbytes, std::uint64_t offset,
              std::shared_ptr<void> keepalive = nullptr);
  // Set the file length: growing allocates the blocks (fallocate, so that
  // ENOSPC shows now; ftruncate where fallocate is unsupported).
  void resize(std::uint64_t size_bytes);
  std::uint64_t size() const;
  // Waits for this file's outstanding requests, then closes the fd. Idempotent.
  void close();

  const std::string& path() const;
  bool direct() const;

 private:
  Future submit(bool is_write, void* buf, std::size_t nbytes, std::uint64_t offset,
                std::shared_ptr<void> keepalive);

  std::shared_ptr<Pool> pool_;
  std::shared_ptr<FileState> state_;
};

class Engine {
 public:
  explicit Engine(int threads);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Creates `path` (O_RDWR|O_CREAT|O_EXCL|O_CLOEXEC|O_NOFOLLOW, mode 0600),
  // with O_DIRECT when the filesystem supports it (probed with one aligned
  // write of zeros), and sizes it to size_bytes. On failure nothing is left.
  std::shared_ptr<File> open(const std::string& path, std::uint64_t size_bytes);
  // Runs the queued requests, then stops and joins the workers. Idempotent.
  // In a forked child: nothing (NOTE [Engine after fork]).
  void close();
  int threads() const noexcept { return threads_; }
  bool closed() const;

 private:
  int threads_;
  std::shared_ptr<Pool> pool_;
  std::vector<std::thread> workers_;
};

}  // namespace tiermem
