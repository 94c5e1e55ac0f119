// Stress driver of the I/O core without torch or Python, built by
// tests/test_io.py with -fsanitize=thread (and usable with address/undefined):
//   g++ -std=c++17 -O1 -g -fsanitize=thread -Icsrc csrc/tests/stress_io.cpp \
//       csrc/io_engine.cpp -o stress && ./stress <dir>
// Several threads submit writes of odd sizes from unaligned buffers to one
// file, wait, read back and compare; then requests are left in flight while
// the file is closed, and the engine is destroyed with and without close().
// Every request's keepalive must be let go before its future says done
// (NOTE [Request lifetime]).
// Exit status 0 and "stress_io: ok" on success.
#include <unistd.h>

#include <atomic>
#include <memory>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "io_engine.h"

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
