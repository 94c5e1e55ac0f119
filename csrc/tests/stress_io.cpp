// Stress driver of the I/O core without torch or Python, built by
// tests/test_io.py with -fsanitize=thread (and usable with address/undefined):
//   g++ -std=c++17 -O1 -g -fsanitize=thread -Icsrc csrc/tests/stress_io.cpp \
//       csrc/io_engine.cpp -o stress && ./stress <dir>
// Several threads submit writes of odd sizes from unaligned buffers to one
// file, wait, read back and compare; then requests are left in flight while
// the file is closed, and the engine is destroyed with and without close().
// Every request's keepalive must be let go before its future says done
// (NOTE [Request lifetime]). Then reads hand themselves to a ReadyQueue from
// their Future::on_done, as the CUDA chain's reads do (NOTE [Reads in
// completion order] in ready_queue.h): each comes out once, done, while
// other threads pop.
// Exit status 0 and "stress_io: ok" on success.
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "io_engine.h"
#include "ready_queue.h"

namespace {

constexpr std::uint64_t kSlot = std::uint64_t(4) << 20;

bool round_trips(tiermem::File& f, int t, int ops) {
  std::vector<std::vector<char>> bufs;
  std::vector<tiermem::Future> futs;
  std::vector<std::shared_ptr<std::atomic<bool>>> released;
  for (int i = 0; i < ops; ++i) {
    const std::size_t n = 1 + (std::size_t(i) * 7919 + std::size_t(t) * 104729) % (3 << 20);
    bufs.emplace_back(n + 1);
    for (std::size_t k = 0; k < n; ++k) bufs.back()[k + 1] = char(k * 31 + i + t);
    auto flag = std::make_shared<std::atomic<bool>>(false);
    released.push_back(flag);
    std::shared_ptr<void> keepalive(new int(0), [flag](void* p) {
      delete static_cast<int*>(p);
      flag->store(true);
    });
    futs.push_back(f.write(bufs.back().data() + 1, n, std::uint64_t(t * ops + i) * kSlot,
                           std::move(keepalive)));
  }
  for (int i = 0; i < ops; ++i) {
    if (i % 2) {
      futs[i].wait();
    } else {
      while (!futs[i].done()) std::this_thread::yield();
    }
    if (!released[i]->load()) {
      std::fprintf(stderr, "stress_io: thread %d op %d done with its keepalive held\n", t, i);
      for (auto& fut : futs) fut.wait();  // the buffers must outlive the requests
      return false;
    }
  }
  for (int i = 0; i < ops; ++i) {
    const std::size_t n = bufs[i].size() - 1;
    std::vector<char> back(n);
    f.read(back.data(), n, std::uint64_t(t * ops + i) * kSlot).wait();
    if (std::memcmp(back.data(), bufs[i].data() + 1, n) != 0) {
      std::fprintf(stderr, "stress_io: mismatch thread %d op %d (%zu bytes)\n", t, i, n);
      return false;
    }
  }
  return true;
}

}  // namespace

// Reads of odd sizes hand their ticket to a ReadyQueue when done; two threads
// pop. Every ticket must come out exactly once, with its future done.
bool completions_arrive_once(tiermem::File& f) {
  constexpr int kReads = 64;
  tiermem::ReadyQueue<int> q;
  std::vector<std::vector<char>> bufs(kReads);
  std::vector<tiermem::Future> futs;
  for (int i = 0; i < kReads; ++i) {
    bufs[i].resize(1 + (std::size_t(i) * 104729) % (2 << 20));
    if (!q.add_pending()) return false;
    futs.push_back(f.read(bufs[i].data(), bufs[i].size(), std::uint64_t(i % 4) * kSlot));
    futs.back().on_done([&q, i] { q.complete(i); });
  }
  std::vector<std::atomic<int>> seen(kReads);
  std::atomic<bool> ok{true};
  std::atomic<int> popped{0};
  q.stop();  // no new items; the pending ones still come out
  auto popper = [&] {
    for (;;) {
      int t = -1;
      const auto r = q.pop(t, std::chrono::microseconds(-1));
      if (r == tiermem::ReadyQueue<int>::Pop::Finished) return;
      if (r != tiermem::ReadyQueue<int>::Pop::Item || t < 0 || t >= kReads) {
        ok = false;
        return;
      }
      if (!futs[t].done()) ok = false;  // handed on only once done
      seen[t]++;
      popped++;
    }
  };
  std::thread a(popper), b(popper);
  a.join();
  b.join();
  for (auto& s : seen) {
    if (s.load() != 1) ok = false;
  }
  // Registered on a finished request: runs at once, on this thread.
  bool ran = false;
  futs[0].on_done([&ran] { ran = true; });
  return ok && popped == kReads && ran && !q.add_pending();
}

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s <dir>\n", argv[0]);
    return 2;
  }
  for (int round = 0; round < 2; ++round) {
    tiermem::Engine engine(4);
    const std::string path = std::string(argv[1]) + "/stress" + std::to_string(round);
    auto f = engine.open(path, 0);
    std::atomic<bool> ok{true};
    std::vector<std::thread> submitters;
    for (int t = 0; t < 3; ++t) {
      submitters.emplace_back([&, t] {
        if (!round_trips(*f, t, 16)) ok = false;
      });
    }
    for (auto& s : submitters) s.join();
    if (!completions_arrive_once(*f)) ok = false;
    // Left in flight: close() must wait for them; later submits fail with EBADF.
    std::vector<char> big(5 << 20, 3);
    for (int i = 0; i < 8; ++i) f->write(big.data(), big.size(), std::uint64_t(i) * 2 * kSlot);
    f->close();
    f->close();
    try {
      f->read(big.data(), 10, 0).wait();
      ok = false;
    } catch (const tiermem::IOError& e) {
      if (e.err() != EBADF) ok = false;
    }
    ::unlink(path.c_str());
    if (!ok) return 1;
    if (round == 0) engine.close();  // round 1: the destructor stops the workers
  }
  std::puts("stress_io: ok");
  return 0;
}
