// Minimal std::format for standard libraries that lack <format> (gcc 12's libstdc++).
// mlx-c's private/io.h formats error messages with "{}" placeholders only, so a
// positional substitution through ostream is enough; with a real <format> this is empty.
#pragma once
#include <version>
#if !defined(__cpp_lib_format)
#include <sstream>
#include <string>
#include <string_view>
namespace std {
namespace dspec_format_compat {
inline void put(std::ostringstream& out, std::string_view rest) { out << rest; }
template <class First, class... Rest>
void put(std::ostringstream& out, std::string_view rest, const First& first,
         const Rest&... others) {
  const auto hole = rest.find("{}");
  if (hole == std::string_view::npos) {
    out << rest;
    return;
  }
  out << rest.substr(0, hole) << first;
  put(out, rest.substr(hole + 2), others...);
}
}  // namespace dspec_format_compat
template <class... Args>
std::string format(std::string_view pattern, const Args&... args) {
  std::ostringstream out;
  dspec_format_compat::put(out, pattern, args...);
  return out.str();
}
}  // namespace std
#endif
