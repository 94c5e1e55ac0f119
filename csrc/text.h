// Error messages of the engine, built without iostreams (`tiermem::cat`).
//
// NOTE [No iostreams in the engine]
//   Messages are concatenated from strings and std::to_string, never with
//   <sstream>: a stream's number formatting uses the locale facets of the
//   libstdc++ the process loaded, which may be older than the compiler's
//   headers, and then crashes; std::to_string needs no locale.
#pragma once

#include <cstdint>
#include <string>
#include <type_traits>

namespace tiermem {
namespace text_detail {

inline void put(std::string& out, const std::string& s) { out += s; }
inline void put(std::string& out, const char* s) { out += s ? s : "(null)"; }
inline void put(std::string& out, char c) { out += c; }
inline void put(std::string& out, bool b) { out += b ? "true" : "false"; }

template <typename T, typename = std::enable_if_t<std::is_integral_v<T> &&
                                                  !std::is_same_v<T, bool> &&
                                                  !std::is_same_v<T, char>>>
void put(std::string& out, T v) {
  out += std::to_string(v);
}

}  // namespace text_detail

// The parts one after another: strings, characters, booleans and integers
// (checks.h writes torch's sizes and layouts as strings first). NOTE [No
// iostreams in the engine].
template <typename... Parts>
std::string cat(const Parts&... parts) {
  std::string out;
  (text_detail::put(out, parts), ...);
  return out;
}

}  // namespace tiermem
