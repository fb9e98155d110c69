/*
 * crashkill COUNTER DELTA PID GAP_MS CMD...: the operator of a crash scenario, resident in memory.
 *
 * Waits until the /proc/vmstat COUNTER (pswpout, pswpin) has grown by DELTA since it started,
 * kills PID with SIGKILL, waits until PID is gone, waits GAP_MS more, then runs CMD (the
 * recovery) and waits for it. Prints one line:
 *   crashkill: COUNTER +N at the kill; pid gone after A s; CMD rc R after B s; pause P s
 * where the pause runs from the kill until CMD returned (CMD returns once the device serves).
 * Exit status: CMD's, or 2 on bad usage or when PID never went away, or 3 when COUNTER stood
 * still for STALL_S seconds before it grew by DELTA (the load ended or died: no kill, and no
 * wait until the scenario's time runs out).
 *
 * Why a resident helper: the swap scenario's shell had its own pages in swap on the very device
 * whose daemon it killed, so it blocked on them and never ran the recovery. This one is locked
 * in memory and started before the kill; CMD is started with posix_spawn (no copy of this
 * process) from a file system that is never swapped.
 */
#include <errno.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

extern char **environ;

#define STALL_S 120

static double now(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static void pause_ms(long ms)
{
	struct timespec ts = { ms / 1000, (ms % 1000) * 1000000L };
	while (nanosleep(&ts, &ts) != 0 && errno == EINTR)
		;
}

/* The value of COUNTER in /proc/vmstat, or -1. */
static long long vmstat(const char *counter)
{
	char name[64];
	long long v, found = -1;
	FILE *f = fopen("/proc/vmstat", "r");

	if (!f)
		return -1;
	while (fscanf(f, "%63s %lld", name, &v) == 2) {
		if (strcmp(name, counter) == 0) {
			found = v;
			break;
		}
	}
	fclose(f);
	return found;
}

int main(int argc, char **argv)
{
	if (argc < 6) {
		fprintf(stderr, "usage: crashkill COUNTER DELTA PID GAP_MS CMD...\n");
		return 2;
	}
	const char *counter = argv[1];
	long long delta = atoll(argv[2]);
	pid_t pid = (pid_t)atoi(argv[3]);
	long gap = atol(argv[4]);

	if (mlockall(MCL_CURRENT | MCL_FUTURE) != 0)
		perror("crashkill: mlockall");
	long long start = vmstat(counter);
	if (start < 0) {
		fprintf(stderr, "crashkill: no counter %s in /proc/vmstat\n", counter);
		return 2;
	}
	long long v = start, seen = start;
	double moved = now();
	while (v - start < delta) {
		pause_ms(20);
		v = vmstat(counter);
		if (v != seen) {
			seen = v;
			moved = now();
		} else if (now() - moved > STALL_S) {
			printf("crashkill: %s stood still at +%lld of %lld for %d s (the load ended?): pid %d not killed\n",
			       counter, v - start, delta, STALL_S, (int)pid);
			fflush(stdout);
			return 3;
		}
	}
	double t0 = now();
	if (kill(pid, SIGKILL) != 0) {
		fprintf(stderr, "crashkill: kill %d: %s\n", (int)pid, strerror(errno));
		return 2;
	}
	/* not our child: gone when signal 0 fails */
	int tries = 0;
	while (kill(pid, 0) == 0 && tries++ < 3000)
		pause_ms(10);
	double gone = now() - t0;
	printf("crashkill: %s +%lld: killed pid %d (gone after %.2f s)\n", counter, v - start, (int)pid, gone);
	fflush(stdout);
	if (kill(pid, 0) == 0) {
		fprintf(stderr, "crashkill: pid %d still there %.1f s after SIGKILL\n", (int)pid, gone);
		return 2;
	}
	pause_ms(gap);
	pid_t child;
	int err = posix_spawnp(&child, argv[5], NULL, NULL, &argv[5], environ);
	if (err != 0) {
		fprintf(stderr, "crashkill: starting %s: %s\n", argv[5], strerror(err));
		return 2;
	}
	int status = 0;
	while (waitpid(child, &status, 0) < 0 && errno == EINTR)
		;
	double done = now() - t0;
	int rc = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
	printf("crashkill: %s +%lld at the kill; pid %d gone after %.2f s; %s rc %d after %.2f s; pause %.2f s\n",
	       counter, v - start, (int)pid, gone, argv[5], rc, done - gone - gap / 1000.0, done);
	fflush(stdout);
	return rc;
}
