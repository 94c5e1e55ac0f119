// Owning tensors from threads that do not hold the Python GIL (implemented in
// tensor_release.cpp).
//
// NOTE [Dropping tensors off the GIL]
//   A tensor that Python also references keeps its PyObject alive while C++
//   holds an extra reference; dropping that last extra reference decrements
//   the PyObject and so takes the GIL (c10's intrusive_ptr, has_pyobject).
//   An engine thread that dropped a buffer on completion therefore waited for
//   the GIL once per request: while a training thread ran Python, up to the
//   interpreter's switch interval (5 ms) per request, and the engine's
//   throughput fell with it. (Taking a second reference to such a tensor
//   takes the GIL too: threads without it only move tensors.) So a tensor
//   dropped on a thread without the GIL is queued here instead ("buried"),
//   and destroyed by the next binding call that holds the GIL anyway (write,
//   read, done, wait, close...; see bindings.cpp and cuda_bindings.cpp), or
//   by a drain that the first bury() since the last drain asks the main
//   thread to run at its next bytecode boundary (Py_AddPendingCall),
//   whichever comes first. So memory comes back about as soon as before, and
//   also when no engine call follows (the last restores of a backward pass).
//   Limit: with sub-interpreters, CPython's PyGILState_Check() says yes on
//   every thread; tensors are then dropped on engine threads, correct but
//   slow as before (torch does not support sub-interpreters either).
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>

namespace tiermem {

// Drops `t` now if this thread holds the GIL, else queues it for the next
// drain_buried(). An undefined tensor is ignored.
void bury(at::Tensor&& t);

// Destroys every queued tensor. Call with the GIL held (any binding call).
void drain_buried();

// Calls drain_buried() when it goes out of scope, also when an exception
// leaves the scope (a failed wait). Construct it with the GIL held.
struct DrainOnExit {
  DrainOnExit() = default;
  DrainOnExit(const DrainOnExit&) = delete;
  DrainOnExit& operator=(const DrainOnExit&) = delete;
  ~DrainOnExit() { drain_buried(); }
};

// A keepalive for the I/O core (std::shared_ptr<void>) owning `t`, whose
// deleter bury()s it. Off the GIL pass an rvalue: copying a tensor that
// Python references may take the GIL as dropping one does.
std::shared_ptr<void> hold(at::Tensor t);

}  // namespace tiermem
