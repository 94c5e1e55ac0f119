// A queue of requests handed out in the order they complete, not the order
// they were submitted. Header only, free of torch, CUDA and Python: the CUDA
// chain's in thread uses it for its reads (cuda_chain.cpp), and the CPU build
// binds ReadyQueue<std::int64_t> for tests (bindings.cpp, _ReadyQueue), so the
// protocol runs in CI without a GPU.
//
// NOTE [Reads in completion order]
//   The in thread used to take reads in submission order and wait on the
//   first one's pread: a slow read held back every read queued after it, even
//   those already in staging, and so their host-to-device copies and the
//   backward thread that waits for them. Now a read's Future calls complete()
//   when its pread finishes (Future::on_done, on the I/O worker), and the in
//   thread pops reads in that order: a finished read waits only for the
//   copies issued before it, never for a read still on the disk.
//   Shutdown: stop() refuses new items (add_pending returns false), and pop()
//   reports Finished only once every pending item has completed and been
//   popped, so that no request is left without its copy or its error.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <mutex>
#include <utility>

namespace tiermem {

template <class T>
class ReadyQueue {
 public:
  enum class Pop { Item, Timeout, Finished };

  // Counts one more item that will complete(); false (nothing counted) once
  // stopped. Call it before the item can complete.
  bool add_pending() {
    std::lock_guard<std::mutex> lk(mu_);
    if (stopping_) return false;
    ++pending_;
    return true;
  }

  // A pending item has completed (any thread, no lock of the caller's
  // needed): it becomes ready after those that completed before it.
  void complete(T item) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      ready_.push_back(std::move(item));
      if (pending_ > 0) --pending_;
    }
    cv_.notify_all();
  }

  // An item counted by add_pending() will never complete (its submit failed).
  void cancel_pending() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (pending_ > 0) --pending_;
    }
    cv_.notify_all();
  }

  // The earliest completed item not yet popped: Item (in `out`), or Timeout
  // after `timeout` with none, or Finished: stopped with nothing pending or
  // ready. A negative timeout waits without limit.
  Pop pop(T& out, std::chrono::microseconds timeout) {
    std::unique_lock<std::mutex> lk(mu_);
    auto has_news = [&] { return !ready_.empty() || (stopping_ && pending_ == 0); };
    if (timeout.count() < 0) {
      cv_.wait(lk, has_news);
    } else if (!cv_.wait_for(lk, timeout, has_news)) {
      return Pop::Timeout;
    }
    if (ready_.empty()) return Pop::Finished;
    out = std::move(ready_.front());
    ready_.pop_front();
    return Pop::Item;
  }

  // No new items from now on; pop() reports Finished once the rest are out.
  void stop() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
  }

  bool stopped() const {
    std::lock_guard<std::mutex> lk(mu_);
    return stopping_;
  }

  // Items counted and not completed yet.
  std::size_t pending() const {
    std::lock_guard<std::mutex> lk(mu_);
    return pending_;
  }

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<T> ready_;
  std::size_t pending_ = 0;
  bool stopping_ = false;
};

}  // namespace tiermem
