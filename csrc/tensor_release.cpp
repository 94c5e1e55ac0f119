// Implements tensor_release.h: the queue of tensors dropped off the GIL and
// its drains. See NOTE [Dropping tensors off the GIL] there. Needs ATen and
// the Python C API only (no pybind11, no CUDA).
#include <Python.h>  // first, as Python asks

#include <atomic>
#include <memory>
#include <mutex>
#include <new>
#include <utility>
#include <vector>

#include "tensor_release.h"

namespace tiermem {
namespace {

std::mutex& buried_mutex() {
  static std::mutex* mu = new std::mutex;  // never destroyed: used at exit by threads
  return *mu;
}

std::vector<at::Tensor>& buried() {
  static auto* v = new std::vector<at::Tensor>;  // never destroyed (no GIL at exit)
  return *v;
}

// A drain is queued with the interpreter (Py_AddPendingCall) and not yet run.
std::atomic<bool> drain_scheduled{false};

int drain_pending(void*) {
  drain_buried();
  return 0;
}

bool interpreter_running() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsInitialized() && !Py_IsFinalizing();
#else
  return Py_IsInitialized() && !_Py_IsFinalizing();
#endif
}

}  // namespace

void bury(at::Tensor&& t) {
  if (!t.defined()) return;
  if (PyGILState_Check()) {
    at::Tensor dropped = std::move(t);
    return;
  }
  try {
    std::lock_guard<std::mutex> lk(buried_mutex());
    buried().push_back(std::move(t));
  } catch (const std::bad_alloc&) {
    at::Tensor dropped = std::move(t);  // no memory to queue it: dropped here (takes the GIL)
    return;
  }
  // Ask the main thread to drain at its next bytecode boundary, so that the
  // memory comes back even when no engine call follows (the last restores of
  // a backward pass). Never during finalization, when the call has no
  // interpreter to go to; if the interpreter's queue is full, the next bury
  // asks again (and every binding call drains anyway).
  if (!drain_scheduled.exchange(true) && interpreter_running() &&
      Py_AddPendingCall(&drain_pending, nullptr) != 0) {
    drain_scheduled = false;
  }
}

void drain_buried() {
  drain_scheduled = false;  // a bury from now on schedules a new drain
  std::vector<at::Tensor> dead;
  {
    std::lock_guard<std::mutex> lk(buried_mutex());
    if (buried().empty()) return;
    dead.swap(buried());
  }
  // Destroyed here, no lock held (a tensor's deallocation may run Python).
}

std::shared_ptr<void> hold(at::Tensor t) {
  return std::shared_ptr<void>(new at::Tensor(std::move(t)), [](void* p) {
    auto* owned = static_cast<at::Tensor*>(p);
    bury(std::move(*owned));
    delete owned;  // now undefined: deleting it touches no PyObject
  });
}

}  // namespace tiermem
