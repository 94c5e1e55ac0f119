// tiermem I/O core. See io_engine.h for NOTE [Request lifetime] and
// NOTE [Alignment].
#include "io_engine.h"
#include "text.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <utility>

namespace tiermem {

namespace {

constexpr std::size_t kHugePageBytes = std::size_t(2) << 20;

std::string error_message(int err, const std::string& op, const std::string& path,
                          std::uint64_t nbytes, std::uint64_t offset,
                          const std::string& detail) {
  std::string msg = op == "open"
                        ? cat("tiermem: ", op, " of ", path)
                        : cat("tiermem: ", op, " of ", nbytes, " bytes at offset ", offset,
                              " in ", path);
  return msg + " failed: " + (detail.empty() ? std::string(std::strerror(err)) : detail);
}

bool is_aligned(const void* p) {
  return reinterpret_cast<std::uintptr_t>(p) % kAlignBytes == 0;
}

std::size_t round_up(std::size_t n, std::size_t a) { return (n + a - 1) / a * a; }

// A posix_memalign'ed buffer that grows on demand; one per worker.
class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  ~AlignedBuffer() { std::free(data_); }

  // A buffer of at least `nbytes` (aligned), or nullptr if out of memory.
  // Buffers of kHugePageBytes or more are aligned to it and advised to use
  // transparent huge pages: direct I/O then pins and maps fewer pages.
  char* get(std::size_t nbytes) {
    if (nbytes <= size_) return data_;
    const std::size_t align = nbytes >= kHugePageBytes ? kHugePageBytes : kAlignBytes;
    const std::size_t size = round_up(nbytes, align);
    void* p = nullptr;
    if (posix_memalign(&p, align, size) != 0) return nullptr;
    if (align == kHugePageBytes) ::madvise(p, size, MADV_HUGEPAGE);  // advice only
    std::free(data_);
    data_ = static_cast<char*>(p);
    size_ = size;
    return data_;
  }

 private:
  char* data_ = nullptr;
  std::size_t size_ = 0;
};

// Outcome of one step of a chunk: 0, or an errno plus an optional detail.
struct Status {
  int err = 0;
  std::string detail;
  bool ok() const { return err == 0; }
};

// pwrite until all of `len` is written (EINTR and partial writes retried).
Status pwrite_full(int fd, const char* buf, std::size_t len, std::uint64_t off) {
  while (len > 0) {
    ssize_t n = ::pwrite(fd, buf, len, static_cast<off_t>(off));
    if (n < 0) {
      if (errno == EINTR) continue;
      return {errno, ""};
    }
    if (n == 0) return {EIO, "the write made no progress"};
    buf += n;
    len -= static_cast<std::size_t>(n);
    off += static_cast<std::uint64_t>(n);
  }
  return {};
}

// pread until `len` bytes or end of file; *got receives the byte count.
Status pread_full(int fd, char* buf, std::size_t len, std::uint64_t off, std::size_t* got) {
  *got = 0;
  while (len > 0) {
    ssize_t n = ::pread(fd, buf, len, static_cast<off_t>(off));
    if (n < 0) {
      if (errno == EINTR) continue;
      return {errno, ""};
    }
    if (n == 0) break;  // end of file
    buf += n;
    len -= static_cast<std::size_t>(n);
    off += static_cast<std::uint64_t>(n);
    *got += static_cast<std::size_t>(n);
  }
  return {};
}

// A read found the end of the file before the end of the request.
Status short_read(int fd, std::uint64_t want_end) {
  struct stat st;
  std::string d = "short read: the file";
  if (::fstat(fd, &st) == 0) d += cat(" is ", st.st_size, " bytes long, it");
  d += cat(" ends before byte ", want_end, " (", std::strerror(EIO), ")");
  return {EIO, d};
}

const char kZeros[kAlignBytes] = {};

}  // namespace

IOError::IOError(int err, const std::string& op, const std::string& path, std::uint64_t nbytes,
                 std::uint64_t offset, const std::string& detail)
    : std::runtime_error(error_message(err, op, path, nbytes, offset, detail)),
      err_(err), op_(op), path_(path), offset_(offset) {}

// ---------------------------------------------------------------- state

struct FileState {
  std::string path;
  int fd = -1;
  std::atomic<bool> direct{false};
  std::mutex mu;
  std::condition_variable cv;
  std::size_t inflight = 0;  // requests submitted and not yet complete
  bool closed = false;

  ~FileState() {
    if (fd >= 0) ::close(fd);
  }
};

struct Request {
  bool is_write;
  std::shared_ptr<FileState> file;
  std::shared_ptr<FutureState> fut;
  std::uint64_t offset;   // of the whole request
  std::size_t nbytes;     // of the whole request
};

struct Chunk {
  std::shared_ptr<Request> req;
  char* buf;
  std::size_t len;
  std::uint64_t offset;
};

struct Pool {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<Chunk> queue;
  std::size_t workers = 1;
  bool stopping = false;
  pid_t owner_pid = ::getpid();  // NOTE [Engine after fork]
  bool forked() const { return ::getpid() != owner_pid; }
};

namespace {

// What a forked child gets from an engine or file of its parent (NOTE [Engine after fork]).
[[noreturn]] void throw_forked(const char* op, const std::string& path, std::uint64_t nbytes,
                               std::uint64_t offset, pid_t owner) {
  throw IOError(EBADF, op, path, nbytes, offset,
                cat("the I/O engine was made by process ", owner,
                    " and this is a forked child (", ::getpid(),
                    ") in which its threads do not exist; make a new engine here"));
}

}  // namespace

// ---------------------------------------------------------------- chunks

namespace {

Status write_chunk(const FileState& f, const char* buf, std::size_t len, std::uint64_t off,
                   AlignedBuffer& bounce) {
  const std::size_t tail = len % kAlignBytes;
  if (!f.direct.load(std::memory_order_relaxed)) {
    Status s = pwrite_full(f.fd, buf, len, off);
    if (s.ok() && tail) s = pwrite_full(f.fd, kZeros, kAlignBytes - tail, off + len);
    return s;
  }
  const std::size_t body = len - tail;
  if (body && is_aligned(buf)) {
    Status s = pwrite_full(f.fd, buf, body, off);
    if (!s.ok()) return s;
  } else if (body) {
    char* b = bounce.get(std::min(body, kBounceBytes));
    if (!b) return {ENOMEM, ""};
    for (std::size_t done = 0; done < body;) {
      std::size_t k = std::min(body - done, kBounceBytes);
      std::memcpy(b, buf + done, k);
      Status s = pwrite_full(f.fd, b, k, off + done);
      if (!s.ok()) return s;
      done += k;
    }
  }
  if (tail) {
    char* b = bounce.get(kAlignBytes);
    if (!b) return {ENOMEM, ""};
    std::memcpy(b, buf + body, tail);
    std::memset(b + tail, 0, kAlignBytes - tail);
    return pwrite_full(f.fd, b, kAlignBytes, off + body);
  }
  return {};
}

// `end`: where the whole request ends (for the message of a short read).
Status read_chunk(const FileState& f, char* buf, std::size_t len, std::uint64_t off,
                  std::uint64_t end, AlignedBuffer& bounce) {
  std::size_t got = 0;
  if (!f.direct.load(std::memory_order_relaxed)) {
    Status s = pread_full(f.fd, buf, len, off, &got);
    if (s.ok() && got < len) s = short_read(f.fd, end);
    return s;
  }
  const std::size_t tail = len % kAlignBytes;
  const std::size_t body = len - tail;
  if (body && is_aligned(buf)) {
    Status s = pread_full(f.fd, buf, body, off, &got);
    if (s.ok() && got < body) s = short_read(f.fd, end);
    if (!s.ok()) return s;
  } else if (body) {
    char* b = bounce.get(std::min(body, kBounceBytes));
    if (!b) return {ENOMEM, ""};
    for (std::size_t done = 0; done < body;) {
      std::size_t k = std::min(body - done, kBounceBytes);
      Status s = pread_full(f.fd, b, k, off + done, &got);
      if (s.ok() && got < k) s = short_read(f.fd, end);
      if (!s.ok()) return s;
      std::memcpy(buf + done, b, k);
      done += k;
    }
  }
  if (tail) {
    char* b = bounce.get(kAlignBytes);
    if (!b) return {ENOMEM, ""};
    Status s = pread_full(f.fd, b, kAlignBytes, off + body, &got);
    if (s.ok() && got < tail) s = short_read(f.fd, end);
    if (!s.ok()) return s;
    std::memcpy(buf + body, b, tail);
  }
  return {};
}

// Runs one chunk and records its outcome. See NOTE [Request lifetime].
void run_chunk(Chunk chunk, AlignedBuffer& bounce) {
  std::shared_ptr<Request> req = std::move(chunk.req);
  FutureState& fut = *req->fut;
  bool skip;
  {
    std::lock_guard<std::mutex> lk(fut.mu);
    skip = fut.failed;  // the request already failed: do not touch the disk again
  }
  Status s;
  if (!skip) {
    s = req->is_write ? write_chunk(*req->file, chunk.buf, chunk.len, chunk.offset, bounce)
                      : read_chunk(*req->file, chunk.buf, chunk.len, chunk.offset,
                                 req->offset + req->nbytes, bounce);
  }
  bool request_done;
  // The caller's buffer owner, let go once the request is done (not when the
  // last Future dies: Futures may be kept long after, e.g. as a job's record).
  std::shared_ptr<void> released;
  {
    std::lock_guard<std::mutex> lk(fut.mu);
    if (!s.ok() && !fut.failed) {
      fut.failed = true;
      fut.err = s.err;
      fut.detail = s.detail;
    }
    request_done = --fut.chunks_left == 0;
    if (request_done) released = std::move(fut.keepalive);
  }
  if (!request_done) return;
  released.reset();  // before finished: see NOTE [Request lifetime]; no lock held
  std::function<void()> on_done;
  {
    std::lock_guard<std::mutex> lk(fut.mu);
    fut.finished = true;
    on_done = std::move(fut.on_done);
  }
  fut.cv.notify_all();
  if (on_done) on_done();  // no lock held (Future::on_done)
  FileState& file = *req->file;
  {
    std::lock_guard<std::mutex> lk(file.mu);
    --file.inflight;
  }
  file.cv.notify_all();
  // `req` is released here, no lock held.
}

void worker_main(std::shared_ptr<Pool> pool) {
  AlignedBuffer bounce;
  for (;;) {
    Chunk chunk;
    {
      std::unique_lock<std::mutex> lk(pool->mu);
      pool->cv.wait(lk, [&] { return pool->stopping || !pool->queue.empty(); });
      if (pool->queue.empty()) return;  // stopping, and nothing left to run
      chunk = std::move(pool->queue.front());
      pool->queue.pop_front();
    }
    run_chunk(std::move(chunk), bounce);
  }
}

}  // namespace

// ---------------------------------------------------------------- Future

void Future::wait() const {
  if (!state_) return;
  std::unique_lock<std::mutex> lk(state_->mu);
  state_->cv.wait(lk, [&] { return state_->finished; });
  if (state_->failed) {
    throw IOError(state_->err, state_->op, state_->path, state_->nbytes, state_->offset,
                  state_->detail);
  }
}

bool Future::done() const {
  if (!state_) return true;
  std::lock_guard<std::mutex> lk(state_->mu);
  return state_->finished;
}

void Future::on_done(std::function<void()> fn) const {
  if (!fn) return;
  if (state_) {
    std::lock_guard<std::mutex> lk(state_->mu);
    if (!state_->finished) {
      state_->on_done = std::move(fn);  // run by the worker that finishes it
      return;
    }
  }
  fn();  // already finished: here, no lock held
}

// ---------------------------------------------------------------- File

File::File(std::shared_ptr<Pool> pool, std::shared_ptr<FileState> state)
    : pool_(std::move(pool)), state_(std::move(state)) {}

// The fd is closed by ~FileState once the last request holding it has run.
File::~File() = default;

const std::string& File::path() const { return state_->path; }
bool File::direct() const { return state_->direct.load(); }

Future File::write(const void* buf, std::size_t nbytes, std::uint64_t offset,
                   std::shared_ptr<void> keepalive) {
  return submit(true, const_cast<void*>(buf), nbytes, offset, std::move(keepalive));
}

Future File::read(void* buf, std::size_t nbytes, std::uint64_t offset,
                  std::shared_ptr<void> keepalive) {
  return submit(false, buf, nbytes, offset, std::move(keepalive));
}

Future File::submit(bool is_write, void* buf, std::size_t nbytes, std::uint64_t offset,
                    std::shared_ptr<void> keepalive) {
  const char* op = is_write ? "write" : "read";
  if (offset % kAlignBytes != 0) {
    throw IOError(EINVAL, op, state_->path, nbytes, offset,
                  cat("the offset ", offset, " is not a multiple of ", kAlignBytes));
  }
  auto fut = std::make_shared<FutureState>();
  fut->op = op;
  fut->path = state_->path;
  fut->nbytes = nbytes;
  fut->offset = offset;
  if (nbytes == 0) {
    fut->finished = true;  // nothing to run
    return Future(fut);
  }
  fut->keepalive = std::move(keepalive);

  // Split evenly over the workers, in aligned chunks of kMinChunkBytes..kMaxChunkBytes.
  const std::size_t workers = std::max<std::size_t>(1, pool_->workers);
  std::size_t chunk = round_up((nbytes + workers - 1) / workers, kAlignBytes);
  chunk = std::clamp(chunk, kMinChunkBytes, kMaxChunkBytes);
  const std::size_t n_chunks = (nbytes + chunk - 1) / chunk;
  fut->chunks_left = n_chunks;

  if (pool_->forked()) throw_forked(op, state_->path, nbytes, offset, pool_->owner_pid);
  {
    std::lock_guard<std::mutex> lk(state_->mu);
    if (state_->closed) {
      throw IOError(EBADF, op, state_->path, nbytes, offset, "the file is closed");
    }
    ++state_->inflight;
  }
  auto req = std::make_shared<Request>(Request{is_write, state_, fut, offset, nbytes});
  {
    std::lock_guard<std::mutex> lk(pool_->mu);
    if (pool_->stopping) {
      std::lock_guard<std::mutex> flk(state_->mu);
      --state_->inflight;
      throw IOError(EBADF, op, state_->path, nbytes, offset, "the I/O engine is closed");
    }
    char* p = static_cast<char*>(buf);
    for (std::size_t i = 0; i < n_chunks; ++i) {
      const std::size_t start = i * chunk;
      pool_->queue.push_back(Chunk{req, p + start, std::min(chunk, nbytes - start),
                                   offset + start});
    }
  }
  if (n_chunks == 1) {
    pool_->cv.notify_one();
  } else {
    pool_->cv.notify_all();
  }
  return Future(fut);
}

void File::resize(std::uint64_t size_bytes) {
  std::lock_guard<std::mutex> lk(state_->mu);
  if (state_->closed) {
    throw IOError(EBADF, "resize", state_->path, size_bytes, 0, "the file is closed");
  }
  const int fd = state_->fd;
  struct stat st;
  if (::fstat(fd, &st) != 0) throw IOError(errno, "resize", state_->path, size_bytes, 0);
  const std::uint64_t cur = static_cast<std::uint64_t>(st.st_size);
  if (size_bytes > cur) {
    int r;
    do {
      r = ::fallocate(fd, 0, static_cast<off_t>(cur), static_cast<off_t>(size_bytes - cur));
    } while (r != 0 && errno == EINTR);
    if (r == 0) return;
    if (errno != EOPNOTSUPP && errno != ENOSYS) {
      throw IOError(errno, "resize", state_->path, size_bytes - cur, cur);
    }
    // No fallocate on this filesystem: a sparse extension (ENOSPC shows on write).
  }
  if (size_bytes != cur && ::ftruncate(fd, static_cast<off_t>(size_bytes)) != 0) {
    throw IOError(errno, "resize", state_->path, size_bytes, 0);
  }
}

std::uint64_t File::size() const {
  std::lock_guard<std::mutex> lk(state_->mu);
  if (state_->closed) {
    throw IOError(EBADF, "size", state_->path, 0, 0, "the file is closed");
  }
  struct stat st;
  if (::fstat(state_->fd, &st) != 0) throw IOError(errno, "size", state_->path, 0, 0);
  return static_cast<std::uint64_t>(st.st_size);
}

void File::close() {
  // In a forked child no worker will finish the parent's requests (and a lock
  // may have been held at the fork): the fd is closed by ~FileState instead.
  if (pool_->forked()) return;
  std::unique_lock<std::mutex> lk(state_->mu);
  state_->closed = true;  // no new requests from here on
  state_->cv.wait(lk, [&] { return state_->inflight == 0; });
  if (state_->fd >= 0) {
    ::close(state_->fd);
    state_->fd = -1;
  }
}

// ---------------------------------------------------------------- Engine

Engine::Engine(int threads) : threads_(threads), pool_(std::make_shared<Pool>()) {
  if (threads < 1) throw std::invalid_argument("tiermem: threads must be >= 1");
  pool_->workers = static_cast<std::size_t>(threads);
  workers_.reserve(static_cast<std::size_t>(threads));
  for (int i = 0; i < threads; ++i) workers_.emplace_back(worker_main, pool_);
}

Engine::~Engine() {
  if (pool_->forked()) {
    // NOTE [Engine after fork]: the threads are the parent's; a lock may have
    // been held at the fork. Leak the handles and the pool rather than touch them.
    new std::vector<std::thread>(std::move(workers_));
    new std::shared_ptr<Pool>(std::move(pool_));
    return;
  }
  // Not joined here: the destructor may run with the Python GIL held, and a
  // caller's keepalive may need that lock when a worker lets go of it (the
  // bindings' keepalives do not, see tensor_release.h, but this core does not
  // assume it). The workers own the pool, finish the queue and exit on their own.
  {
    std::lock_guard<std::mutex> lk(pool_->mu);
    pool_->stopping = true;
  }
  pool_->cv.notify_all();
  for (auto& t : workers_) {
    if (t.joinable()) t.detach();
  }
}

void Engine::close() {
  if (pool_->forked()) return;  // nothing of it runs here: NOTE [Engine after fork]
  {
    std::lock_guard<std::mutex> lk(pool_->mu);
    pool_->stopping = true;
  }
  pool_->cv.notify_all();
  for (auto& t : workers_) {
    if (t.joinable()) t.join();
  }
}

bool Engine::closed() const {
  if (pool_->forked()) return true;  // NOTE [Engine after fork]
  std::lock_guard<std::mutex> lk(pool_->mu);
  return pool_->stopping;
}

std::shared_ptr<File> Engine::open(const std::string& path, std::uint64_t size_bytes) {
  if (pool_->forked()) throw_forked("open", path, 0, 0, pool_->owner_pid);
  if (closed()) throw IOError(EBADF, "open", path, 0, 0, "the I/O engine is closed");
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (fd < 0) throw IOError(errno, "open", path, 0, 0);
  auto state = std::make_shared<FileState>();
  state->path = path;
  state->fd = fd;
  // O_DIRECT is set after the exclusive create: a filesystem that rejects it
  // at open (ramfs) may have created the file already. A first aligned write
  // of zeros (harmless: the file is new) tells whether direct writes work.
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags >= 0 && ::fcntl(fd, F_SETFL, flags | O_DIRECT) == 0) {
    void* probe = nullptr;
    if (posix_memalign(&probe, kAlignBytes, kAlignBytes) == 0) {
      std::memset(probe, 0, kAlignBytes);
      ssize_t n;
      do {
        n = ::pwrite(fd, probe, kAlignBytes, 0);
      } while (n < 0 && errno == EINTR);
      const bool rejected = n < 0 && errno == EINVAL;
      std::free(probe);
      if (rejected) {
        ::fcntl(fd, F_SETFL, flags);
      } else {
        state->direct = true;
      }
    } else {
      ::fcntl(fd, F_SETFL, flags);
    }
  }
  auto file = std::make_shared<File>(pool_, state);
  try {
    if (::ftruncate(fd, 0) != 0) throw IOError(errno, "resize", path, 0, 0);
    if (size_bytes) file->resize(size_bytes);
  } catch (...) {
    file->close();
    ::unlink(path.c_str());
    throw;
  }
  return file;
}

}  // namespace tiermem
