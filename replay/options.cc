// EngineOptions' defaults and the engines' log (replay/options.h).
#include "replay/options.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <iostream>

namespace torchreplay::replay {

namespace {
const char* GetEnv(const char* name) { return std::getenv(name); }

std::atomic<LogLevel> g_default_log_level{EngineOptions::FromEnvironment(&GetEnv).log_level};
std::atomic<LogSink> g_log_sink{nullptr};
}  // namespace

void SetLogLevel(LogLevel level) { g_default_log_level = level; }
LogLevel DefaultLogLevel() { return g_default_log_level; }
void SetLogSink(LogSink sink) { g_log_sink = sink; }

EngineOptions EngineOptions::FromEnvironment(const char* (*getenv)(const char* name)) {
  auto on_unless_zero = [&](const char* name) {
    const char* env = getenv(name);
    return env == nullptr || std::string(env) != "0";
  };
  EngineOptions o;
  o.prepared_steps = on_unless_zero("TORCHREPLAY_PREPARED_ITERATORS");
  o.fuse_elementwise = on_unless_zero("TORCHREPLAY_FUSE");
  if (const char* level = getenv("TORCHREPLAY_LOG_LEVEL"); level != nullptr) {
    o.log_level = static_cast<LogLevel>(std::min(std::max(std::atoi(level), 0), 3));
  }
  return o;
}

EngineOptions EngineOptions::Defaults() {
  static const EngineOptions from_environment = FromEnvironment(&GetEnv);
  EngineOptions o = from_environment;
  o.log_level = g_default_log_level;
  return o;
}

void EmitLog(LogLevel level, const std::string& line) {
  if (LogSink sink = g_log_sink.load(); sink != nullptr) {
    sink(level, line);
    return;
  }
  static const char* kTags = "DIWE";
  std::cerr << "[torchreplay " << kTags[static_cast<int>(level)] << "] " << line << std::endl;
}

}  // namespace torchreplay::replay
