// dtensor_launch: the free port, the rank environment, spawning, and waiting for children
// (stopping the others when one fails, killing the ones past the deadline, reaping them all).
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "common/local_ranks.h"

namespace launch = dtensor::launch;

namespace {

using Clock = std::chrono::steady_clock;

bool exists(pid_t pid) { return ::kill(pid, 0) == 0 || errno != ESRCH; }

bool exited_with(const launch::Children::Outcome& o, int code) {
  return !o.hung && WIFEXITED(o.status) && WEXITSTATUS(o.status) == code;
}

// A child that would run for a minute: the tests stop it long before.
pid_t spawn_sleeper() {
  return launch::spawn_function([] {
    std::this_thread::sleep_for(std::chrono::seconds(60));
    return 0;
  });
}

}  // namespace

TEST(LaunchFreePort, IsAPortNothingListensOnAndThatCanBeBound) {
  const int port = launch::free_port();
  ASSERT_GT(port, 0);
  ASSERT_LT(port, 65536);
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  EXPECT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0) << std::strerror(errno);
  ::close(fd);
}

TEST(LaunchRankEnv, IsWhatTorchrunSets) {
  const launch::Env env = launch::rank_env(2, 4, 29500);
  const launch::Env expected = {{"RANK", "2"},
                                {"LOCAL_RANK", "2"},
                                {"WORLD_SIZE", "4"},
                                {"LOCAL_WORLD_SIZE", "4"},
                                {"MASTER_ADDR", "127.0.0.1"},
                                {"MASTER_PORT", "29500"}};
  EXPECT_EQ(env, expected);
}

TEST(LaunchSpawn, ChildGetsItsEnvironmentAndItsExitCodeComesBack) {
  launch::Children children;
  for (int r = 0; r < 3; ++r) {
    launch::ChildSetup setup;
    setup.env = launch::rank_env(r, 3, 1234);
    // Each child exits with RANK + 10: the code shows it saw its own environment.
    children.add(launch::spawn_function(
        [] { return std::atoi(std::getenv("RANK")) + 10 + (std::getenv("MASTER_PORT") ? 0 : 100); },
        setup));
  }
  const auto out = children.wait_all({});
  ASSERT_EQ(out.size(), 3u);
  for (int r = 0; r < 3; ++r) EXPECT_TRUE(exited_with(out[r], r + 10)) << "rank " << r;
}

TEST(LaunchSpawn, MissingProgramReportsEnoentAndExits127) {
  const auto spawned = launch::spawn_program({"dtensor-launch-test-no-such-program"});
  ASSERT_GT(spawned.pid, 0);
  EXPECT_EQ(spawned.exec_errno, ENOENT);
  int status = 0;
  ASSERT_EQ(::waitpid(spawned.pid, &status, 0), spawned.pid);
  EXPECT_EQ(launch::exit_code_of(status), 127);
  EXPECT_EQ(launch::describe_status(status), "exited with code 127");
}

TEST(LaunchSpawn, ProgramRunsWithTheEnvironmentAndExitCode) {
  launch::ChildSetup setup;
  setup.env = {{"DTENSOR_LAUNCH_TEST", "7"}};
  const auto spawned = launch::spawn_program({"/bin/sh", "-c", "exit $DTENSOR_LAUNCH_TEST"}, setup);
  EXPECT_EQ(spawned.exec_errno, 0);
  int status = 0;
  ASSERT_EQ(::waitpid(spawned.pid, &status, 0), spawned.pid);
  EXPECT_EQ(launch::exit_code_of(status), 7);
}

TEST(LaunchChildren, OneFailureStopsTheOthersAfterTheGrace) {
  launch::Children children;
  children.add(launch::spawn_function([] { return 3; }));
  children.add(spawn_sleeper());
  size_t failed = 99;
  launch::Children::WaitOptions options;
  options.stop_signal = SIGKILL;
  options.grace = std::chrono::milliseconds(100);
  options.on_failure = [&](size_t index, int) { failed = index; };
  const auto t0 = Clock::now();
  const auto out = children.wait_all(options);
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - t0).count(), 10.0);
  EXPECT_EQ(failed, 0u);
  EXPECT_TRUE(exited_with(out[0], 3));
  EXPECT_TRUE(WIFSIGNALED(out[1].status) && WTERMSIG(out[1].status) == SIGKILL);
  EXPECT_FALSE(out[1].hung);
}

TEST(LaunchChildren, ChildrenPastTheDeadlineAreKilledAndMarkedHung) {
  launch::Children children;
  children.add(launch::spawn_function([] { return 0; }));
  children.add(spawn_sleeper());
  launch::Children::WaitOptions options;
  options.timeout = std::chrono::milliseconds(300);
  const auto out = children.wait_all(options);
  EXPECT_TRUE(exited_with(out[0], 0));
  EXPECT_TRUE(out[1].hung);
  EXPECT_FALSE(exists(children.pids()[1]));  // killed and reaped
}

TEST(LaunchChildren, DestructorKillsAndReapsChildrenStillRunning) {
  pid_t pid = -1;
  {
    launch::Children children;
    children.add(spawn_sleeper());
    pid = children.pids()[0];
    EXPECT_TRUE(exists(pid));
  }
  EXPECT_FALSE(exists(pid));  // no zombie left either: it was reaped
}
