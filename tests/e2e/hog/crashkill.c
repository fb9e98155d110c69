/*
 * crashkill [-p DEV] COUNTER DELTA PID GAP_MS CMD...: the operator of a crash scenario,
 * resident in memory.
 *
 * Waits until the /proc/vmstat COUNTER (pswpout, pswpin) has grown by DELTA since it started,
 * kills PID with SIGKILL, waits until PID is gone, waits GAP_MS more, then runs CMD (the
 * recovery) and waits for it. A GAP_MS below 0 starts CMD at once instead, before the kill:
 * a recovery that waits for the daemon to die by itself (`uzram recover --wait`). Prints one
 * line:
 *   crashkill: COUNTER +N at the kill; pid gone after A s; I/O pause P s (...); [a read ...;] CMD rc R B s after the kill
 * With -p DEV, P is the device's I/O pause: from the kill until the device completed a request
 * again (its reads, writes and discards completed, /sys/block/NAME/stat, looked at every
 * millisecond from the moment PID is gone: no later completion can be the killed daemon's).
 * Beside it, the time until a 4 KiB O_DIRECT read of DEV, issued as soon as PID is gone,
 * completed: what a request made during the pause waits, the requests queued before it (up
 * to the device's queue depth of swap writes) included. CMD may return later than both: the
 * new daemon serves first and then publishes its records. Without -p, P is from the kill
 * until CMD returned.
 * Exit status: CMD's, or 2 on bad usage or when PID never went away, or 3 when COUNTER stood
 * still for STALL_S seconds before it grew by DELTA (the load ended or died: no kill, and no
 * wait until the scenario's time runs out), or 4 when CMD succeeded but the read of DEV failed.
 *
 * Why a resident helper: the swap scenario's shell had its own pages in swap on the very device
 * whose daemon it killed, so it blocked on them and never ran the recovery. This one is locked
 * in memory and started before the kill; CMD is started with posix_spawn (no copy of this
 * process) from a file system that is never swapped.
 */
#define _GNU_SOURCE /* O_DIRECT */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <semaphore.h>
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
/* CMD still running this long after the kill: print where uzram's threads are */
#define DUMP_S 5

/* /proc/sysrq-trigger, opened at start: see dump_state */
static int sysrq_fd = -1;

/* Prints FILE's lines, each with PREFIX. */
static void cat_file(const char *prefix, const char *file)
{
	char buf[4096];
	FILE *f = fopen(file, "r");

	if (!f)
		return;
	while (fgets(buf, sizeof(buf), f))
		printf("%s%s", prefix, buf);
	fclose(f);
}

/* Every uzram thread's state and kernel stack, and the memory counters: why CMD is slow. */
static void dump_state(void)
{
	char path[300], prefix[64], comm[64];
	DIR *proc = opendir("/proc");
	struct dirent *p;

	printf("crashkill: the recovery is still running after %d s; uzram's threads:\n", DUMP_S);
	fflush(stdout);
	/*
	 * First every task's kernel stack and the memory state, into the kernel log: a write to
	 * a file opened at start needs no new memory. The walk of /proc below allocates (proc
	 * inodes) and once sat in reclaim before it printed a line.
	 */
	if (sysrq_fd >= 0 && (write(sysrq_fd, "t", 1) != 1 || write(sysrq_fd, "m", 1) != 1))
		perror("crashkill: sysrq");
	while (proc && (p = readdir(proc))) {
		if (p->d_name[0] < '1' || p->d_name[0] > '9' || strlen(p->d_name) > 20)
			continue;
		snprintf(path, sizeof(path), "/proc/%s/comm", p->d_name);
		FILE *f = fopen(path, "r");
		if (!f)
			continue;
		int is_uzram = fgets(comm, sizeof(comm), f) && strncmp(comm, "uzram", 5) == 0;
		fclose(f);
		if (!is_uzram)
			continue;
		snprintf(path, sizeof(path), "/proc/%s/task", p->d_name);
		DIR *tasks = opendir(path);
		struct dirent *t;
		while (tasks && (t = readdir(tasks))) {
			if (t->d_name[0] == '.' || strlen(t->d_name) > 20)
				continue;
			snprintf(prefix, sizeof(prefix), "crashkill:  %s/%s ", p->d_name, t->d_name);
			snprintf(path, sizeof(path), "/proc/%s/task/%s/stat", p->d_name, t->d_name);
			cat_file(prefix, path);
			snprintf(path, sizeof(path), "/proc/%s/task/%s/stack", p->d_name, t->d_name);
			cat_file(prefix, path);
		}
		if (tasks)
			closedir(tasks);
	}
	if (proc)
		closedir(proc);
	cat_file("crashkill:  ", "/proc/meminfo");
	fflush(stdout);
}

static double now(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/*
 * The read that measures the I/O pause. Its thread, file and buffer are made before the kill
 * (locked by mlockall): after the kill memory may have run out, and this must not wait for it.
 */
struct probe {
	int fd;
	int stat_fd; /* the device's /sys/block/NAME/stat */
	void *buf;
	sem_t go;
	double done_at; /* CLOCK_MONOTONIC, when the read returned */
	ssize_t got;
	int err;
};

static void *probe_read(void *arg)
{
	struct probe *p = arg;

	while (sem_wait(&p->go) != 0 && errno == EINTR)
		;
	p->got = pread(p->fd, p->buf, 4096, 0);
	p->err = p->got < 0 ? errno : 0;
	p->done_at = now();
	return NULL;
}

/* Requests the device completed so far (reads, writes, discards), from its stat file; -1. */
static long long completed(int stat_fd)
{
	char buf[512];
	unsigned long long f[12] = { 0 };
	ssize_t n = pread(stat_fd, buf, sizeof(buf) - 1, 0);

	if (n <= 0)
		return -1;
	buf[n] = 0;
	/* fields 1, 5 and 12: reads, writes and discards completed */
	if (sscanf(buf, "%llu %llu %llu %llu %llu %llu %llu %llu %llu %llu %llu %llu", &f[0], &f[1],
		   &f[2], &f[3], &f[4], &f[5], &f[6], &f[7], &f[8], &f[9], &f[10], &f[11]) < 5)
		return -1;
	return (long long)(f[0] + f[4] + f[11]);
}

/* Opens DEV and its stat file for the probe and starts its thread, which waits for `go`. 0, or
 * -1 (printed). */
static int probe_start(struct probe *p, pthread_t *thread, const char *dev)
{
	char stat_path[128];
	int err;

	p->fd = open(dev, O_RDONLY | O_DIRECT | O_CLOEXEC);
	if (p->fd < 0) {
		fprintf(stderr, "crashkill: opening %s: %s\n", dev, strerror(errno));
		return -1;
	}
	const char *name = strrchr(dev, '/') ? strrchr(dev, '/') + 1 : dev;
	snprintf(stat_path, sizeof(stat_path), "/sys/block/%s/stat", name);
	p->stat_fd = open(stat_path, O_RDONLY | O_CLOEXEC);
	if (p->stat_fd < 0 || completed(p->stat_fd) < 0) {
		fprintf(stderr, "crashkill: reading %s: %s\n", stat_path, strerror(errno));
		return -1;
	}
	err = posix_memalign(&p->buf, 4096, 4096);
	if (err != 0) {
		fprintf(stderr, "crashkill: probe buffer: %s\n", strerror(err));
		return -1;
	}
	memset(p->buf, 0, 4096);
	if (sem_init(&p->go, 0, 0) != 0) {
		perror("crashkill: sem_init");
		return -1;
	}
	err = pthread_create(thread, NULL, probe_read, p);
	if (err != 0) {
		fprintf(stderr, "crashkill: probe thread: %s\n", strerror(err));
		return -1;
	}
	return 0;
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
	const char *probe_dev = NULL;
	if (argc > 2 && strcmp(argv[1], "-p") == 0) {
		probe_dev = argv[2];
		argv += 2;
		argc -= 2;
	}
	if (argc < 6) {
		fprintf(stderr, "usage: crashkill [-p DEV] COUNTER DELTA PID GAP_MS CMD...\n");
		return 2;
	}
	const char *counter = argv[1];
	long long delta = atoll(argv[2]);
	pid_t pid = (pid_t)atoi(argv[3]);
	long gap = atol(argv[4]);

	if (mlockall(MCL_CURRENT | MCL_FUTURE) != 0)
		perror("crashkill: mlockall");
	sysrq_fd = open("/proc/sysrq-trigger", O_WRONLY | O_CLOEXEC);
	struct probe probe = { .fd = -1 };
	pthread_t probe_thread;
	if (probe_dev && probe_start(&probe, &probe_thread, probe_dev) != 0)
		return 2;
	long long start = vmstat(counter);
	if (start < 0) {
		fprintf(stderr, "crashkill: no counter %s in /proc/vmstat\n", counter);
		return 2;
	}
	pid_t child;
	int err;
	if (gap < 0) {
		err = posix_spawnp(&child, argv[5], NULL, NULL, &argv[5], environ);
		if (err != 0) {
			fprintf(stderr, "crashkill: starting %s: %s\n", argv[5], strerror(err));
			return 2;
		}
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
			if (gap < 0)
				kill(child, SIGKILL);
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
	while (kill(pid, 0) == 0 && tries++ < 3000) {
		/* still there after 2 s: every task's kernel stack into the kernel log, to see
		 * where the dying daemon's threads wait (7.3: gone only after 5 s, now and then) */
		if (tries == 200 && sysrq_fd >= 0 && write(sysrq_fd, "t", 1) != 1)
			perror("crashkill: sysrq");
		pause_ms(10);
	}
	double gone = now() - t0;
	printf("crashkill: %s +%lld: killed pid %d (gone after %.2f s)\n", counter, v - start, (int)pid, gone);
	fflush(stdout);
	if (kill(pid, 0) == 0) {
		fprintf(stderr, "crashkill: pid %d still there %.1f s after SIGKILL\n", (int)pid, gone);
		return 2;
	}
	/* from now on every completion is a new daemon's */
	long long done_before = probe_dev ? completed(probe.stat_fd) : -1;
	double served = 0;
	if (probe_dev)
		sem_post(&probe.go);
	if (gap >= 0) {
		pause_ms(gap);
		err = posix_spawnp(&child, argv[5], NULL, NULL, &argv[5], environ);
		if (err != 0) {
			fprintf(stderr, "crashkill: starting %s: %s\n", argv[5], strerror(err));
			return 2;
		}
	} else {
		gap = 0;
	}
	int status = 0;
	int dumped = 0;
	for (;;) {
		pid_t r = waitpid(child, &status, WNOHANG);
		if (r == child || (r < 0 && errno != EINTR))
			break;
		if (!dumped && now() - t0 > DUMP_S) {
			dumped = 1;
			dump_state();
		}
		if (probe_dev && served == 0 && completed(probe.stat_fd) > done_before)
			served = now();
		pause_ms(probe_dev && served == 0 ? 1 : 20);
	}
	double done = now() - t0;
	int rc = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
	if (!probe_dev || rc != 0) {
		/* (a failed recovery may leave the device paused, and the read waiting for good) */
		printf("crashkill: %s +%lld at the kill; pid %d gone after %.2f s; pause %.2f s (until %s returned); %s rc %d %.2f s after the kill\n",
		       counter, v - start, (int)pid, gone, done, argv[5], argv[5], rc, done);
		fflush(stdout);
		return rc;
	}
	/* CMD succeeded: the device serves, so the read ends */
	pthread_join(probe_thread, NULL);
	/* (the probe's read is itself a completion after done_before) */
	if (served == 0 || served > probe.done_at)
		served = probe.done_at;
	printf("crashkill: %s +%lld at the kill; pid %d gone after %.2f s; I/O pause %.2f s (until %s completed a request again); a read issued then completed after %.2f s; %s rc %d %.2f s after the kill\n",
	       counter, v - start, (int)pid, gone, served - t0, probe_dev, probe.done_at - t0, argv[5], rc, done);
	fflush(stdout);
	if (rc == 0 && probe.got != 4096) {
		fprintf(stderr, "crashkill: the read of %s after the recovery returned %zd: %s\n", probe_dev,
			probe.got, probe.got < 0 ? strerror(probe.err) : "short");
		return 4;
	}
	return rc;
}
